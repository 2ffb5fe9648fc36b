"""Running a tensor-parallel package: one process per rank, launched by torchrun.

    aotgen run artifacts/X-tp2 --chat "..."          # launches the ranks itself
    torchrun --nproc-per-node 2 -m aotgen run ...    # the same, launched by hand

Each rank loads the package's one compiled `model.pt2` with its own `rankK/` weight
shard. The compiled graphs all-reduce over the process group whose name was baked in at
build time (`parallel.group_name` in the manifest); this module registers the real
group (gloo on CPU, NCCL on CUDA) under that name.

Rank 0 drives: it runs the ordinary `Engine` (tokenizer, sampling, speculation) and,
before each graph call, tells the other ranks which call to make (tokens, position)
over a separate gloo group. The others only replay those calls, so sampling happens
once and every rank runs the same graphs in the same order. The control group must not
be the package's group: a Python-level gloo collective on the group a compiled graph
then uses deadlocks (the graph holds the GIL while gloo's worker waits for it).

Runtime side: imports no model, export or pass code.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from aotgen.package.manifest import PackageError, read_manifest, verify_package
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.model_runner import ModelRunner
from aotgen.runtime.sampling import SamplingParams
from aotgen.runtime.tokenizer import Tokenizer

# Seconds a collective may wait before the rank gives up (a hung peer; a dead one is seen
# at once because its sockets close).
TIMEOUT_ENV = "AOTGEN_TP_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
# Test hook only: the last rank exits after this many replayed calls.
TEST_EXIT_ENV = "AOTGEN_TP_TEST_EXIT_AFTER"

STOP, FORWARD, DECODE, ALL_REDUCE, FORWARD_ALL_LOGITS = 0, 1, 2, 3, 4
ROLES = ("target", "draft")


class LaunchError(RuntimeError):
    """The ranks could not be started, or one of them failed."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def package_world_size(path: str | Path) -> int:
    """How many ranks a package was built for (cheap: reads the manifest only)."""
    return int(read_manifest(path).get("world_size", 1))


def needs_launch(path: str | Path) -> bool:
    """A TP package run from a plain process: its ranks must be started first."""
    return not under_torchrun() and package_world_size(path) > 1


# ---- launching ------------------------------------------------------------------------------
def threads_per_rank(threads: int | None, local_world_size: int) -> int:
    """Split this node's threads (default: its cores) between the ranks it runs."""
    return max(1, (threads or os.cpu_count() or 1) // local_world_size)


def launch(
    module_args: list[str],
    world_size: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    threads: int | None = None,
) -> None:
    """Run `python -m <module_args>` as `world_size` ranks through torch.distributed.run.

    One node: a local rendezvous on a free port. Several nodes: run this on each with the
    same --nnodes/--master-addr/--master-port and its own --node-rank. Raises LaunchError
    if any rank fails (the elastic agent stops the others at once).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    if nnodes < 1 or world_size % nnodes:
        raise LaunchError(
            f"the package has {world_size} ranks, which --nnodes {nnodes} does not divide: "
            "every node runs the same number of ranks"
        )
    nproc = world_size // nnodes
    args = ["--nproc-per-node", str(nproc), "--nnodes", str(nnodes), "--max-restarts", "0"]
    args += ["--monitor-interval", "0.2"]
    if nnodes > 1:
        if not master_addr:
            raise LaunchError("a multi-node run needs --master-addr (the host of node rank 0)")
        args += ["--node-rank", str(node_rank), "--master-addr", master_addr]
        args += ["--master-port", str(master_port or 29500)]
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(threads, nproc))
    # The agent makes a run directory of its own in the temp dir and leaves it there: give it
    # one that goes when the run ends (a failure's error files are read by then).
    try:
        with tempfile.TemporaryDirectory(prefix="aotgen-ranks-") as logs:
            elastic_run(
                get_args_parser().parse_args([*args, "--log-dir", logs, "-m", *module_args])
            )
    except ChildFailedError as e:
        # Ranks the agent stopped (SIGTERM) after the first failure are not the cause.
        causes = {r: f for r, f in e.failures.items() if f.exitcode != -signal.SIGTERM}
        causes = causes or dict([e.get_first_failure()])
        failed = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(causes.items()))
        raise LaunchError(
            f"tensor-parallel run failed: {failed}; the other ranks were stopped. "
            "See the rank's error above"
        ) from None


# ---- one rank -------------------------------------------------------------------------------
def _timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))


def init_rank(manifest: dict[str, Any], root: Path) -> tuple[int, dist.ProcessGroup]:
    """Join the process group the package's graphs use; returns (rank, control group)."""
    world = int(os.environ["WORLD_SIZE"])
    want = int(manifest.get("world_size", 1))
    if world != want:
        how = (
            "run it without torchrun"
            if want == 1
            else f"launch it with `aotgen run` (it starts the ranks) or "
            f"`torchrun --nproc-per-node {want} -m aotgen run ...`"
        )
        raise PackageError(
            f"{root} was built for {want} rank(s) but this run has WORLD_SIZE={world}: {how}"
        )
    backend = "nccl" if manifest["target"]["device"] == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=_timeout())
    baked = manifest["parallel"]["group_name"]
    if dist.group.WORLD.group_name != baked:
        # The compiled all_reduces look the group up by this name.
        from torch._C._distributed_c10d import _register_process_group

        _register_process_group(baked, dist.group.WORLD)
    control = dist.new_group(backend="gloo", timeout=_timeout())
    return dist.get_rank(), control


class Control:
    """Rank 0 → other ranks: the next graph call (op, model, position, tokens)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.done = False  # stopped, or a peer is gone: nothing more to tell

    @contextmanager
    def peers(self) -> Iterator[None]:
        """Turn a failed collective (a peer died, or timed out) into one clear error."""
        try:
            yield
        except RuntimeError as e:  # gloo/NCCL errors, DistBackendError included
            self.done = True
            # Drop gloo's "[.../pair.cc:553] " source location: it means nothing to users.
            reason = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().splitlines()[0])[:300]
            raise LaunchError(
                f"rank {dist.get_rank()}: lost contact with the other ranks (one died or hung "
                f"past {TIMEOUT_ENV}={_timeout().total_seconds():.0f} s): {reason}"
            ) from e

    def send(self, op: int, role: int = 0, pos: int = 0, tokens: list[int] | None = None) -> None:
        tokens = tokens or []
        first = tokens[0] if tokens else 0
        # One small broadcast per decode step: a single token travels in the header.
        header = torch.tensor([op, role, pos, len(tokens), first], dtype=torch.long)
        dist.broadcast(header, src=0, group=self.group)
        if len(tokens) > 1:
            dist.broadcast(torch.tensor(tokens, dtype=torch.long), src=0, group=self.group)

    def receive(self) -> tuple[int, int, int, list[int]]:
        header = torch.zeros(5, dtype=torch.long)
        dist.broadcast(header, src=0, group=self.group)
        op, role, pos, n, first = header.tolist()
        tokens = [first] if n == 1 else []
        if n > 1:
            buf = torch.zeros(n, dtype=torch.long)
            dist.broadcast(buf, src=0, group=self.group)
            tokens = buf.tolist()
        return op, role, pos, tokens

    def stop(self) -> None:
        if not self.done:
            self.done = True
            with suppress(RuntimeError):  # at exit: a peer already gone is no news
                self.send(STOP)


class AnnouncedRunner:
    """Rank 0's `ModelRunner`: announces each call to the other ranks, then makes it."""

    def __init__(self, runner: ModelRunner, role: int, control: Control):
        self.runner, self.role, self.control = runner, role, control

    def forward(
        self, tokens: list[int], start_pos: int, all_logits: bool = False, slot: int = 0
    ) -> Tensor:
        if slot:
            raise ValueError("a tensor-parallel package serves one sequence (slot 0)")
        with self.control.peers():
            # Every row's logits take other graphs (verify): the ranks must call the same ones.
            op = FORWARD_ALL_LOGITS if all_logits else FORWARD
            self.control.send(op, self.role, start_pos, tokens)
            return self.runner.forward(tokens, start_pos, all_logits)

    def decode(self, token: int, pos: int, slot: int = 0) -> Tensor:
        if slot:
            raise ValueError("a tensor-parallel package serves one sequence (slot 0)")
        with self.control.peers():
            self.control.send(DECODE, self.role, pos, [token])
            return self.runner.decode(token, pos)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def all_reduce_loop(numel: int, iters: int, group_name: str) -> float:
    """Seconds per all_reduce of `numel` floats, the op the compiled graphs call, on their
    group: the median of `iters` (a shared machine preempts some of them).

    Must be the group's last use: a graph call after a Python-level collective on the same
    group can deadlock (a known gloo trap; it hung 2 of 9 runs in a test).
    """
    x = torch.ones(numel)
    ops = torch.ops._c10d_functional
    times = []
    for i in range(iters + 3):
        t0 = time.perf_counter()
        ops.wait_tensor(ops.all_reduce(x, "sum", group_name))
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def serve(runners: dict[int, ModelRunner], control: Control, group_name: str) -> None:
    """A non-zero rank: replay rank 0's calls until it says stop."""
    exit_after = int(os.environ.get(TEST_EXIT_ENV, 0))
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    calls = 0
    while True:
        with control.peers():
            op, role, pos, tokens = control.receive()
            if op == STOP:
                return
            if op == ALL_REDUCE:  # bench: numel in `pos`, iterations as the token
                all_reduce_loop(pos, tokens[0], group_name)
                continue
            if op == DECODE:
                runners[role].decode(tokens[0], pos)
            else:
                runners[role].forward(tokens, pos, all_logits=op == FORWARD_ALL_LOGITS)
        calls += 1
        if exit_after and last_rank and calls >= exit_after:  # test hook: a rank dies
            print(f"{TEST_EXIT_ENV}: rank exits at {time.time():.3f}", file=sys.stderr, flush=True)
            os._exit(17)


def _rank_runners(root: Path, manifest: dict[str, Any], rank: int) -> dict[str, ModelRunner]:
    shard = manifest["ranks"][rank]
    pt2 = root / shard["package"]
    runners: dict[str, ModelRunner] = {}
    for role in ROLES:  # the target first: a draft may share its KV cache
        if role in manifest["models"]:
            entry = {**manifest["models"][role], "weights": shard["weights"][role]}
            runners[role] = ModelRunner(root, pt2, entry, runners.get("target"))
    return runners


def start(path: str | Path, threads: int | None = None, verify: bool = True) -> Engine | None:
    """Load a package in this process: the Engine for a plain run or for TP rank 0.

    Any other TP rank loads its shard, replays rank 0's graph calls until rank 0 is done,
    and then gets None. Rank 0 tells them it is done when its process exits.
    """
    root = Path(path)
    if not under_torchrun():
        return Engine.load(root, threads=threads, verify=verify)
    t0 = time.perf_counter()
    manifest = verify_package(root, check_hashes=verify)
    if int(os.environ["WORLD_SIZE"]) == 1 and manifest.get("world_size", 1) == 1:
        return Engine.load(root, threads=threads, verify=False)
    rank, control_group = init_rank(manifest, root)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(threads_per_rank(threads, local))
    runners = _rank_runners(root, manifest, rank)
    control = Control(control_group)
    group_name = manifest["parallel"]["group_name"]
    atexit.register(dist.destroy_process_group)
    if rank:
        serve({ROLES.index(r): m for r, m in runners.items()}, control, group_name)
        return None
    atexit.register(control.stop)  # runs before destroy_process_group (LIFO)
    announced = {r: AnnouncedRunner(m, ROLES.index(r), control) for r, m in runners.items()}
    return Engine(
        Tokenizer.from_dir(root / manifest["tokenizer"]["dir"]),
        announced["target"],
        announced.get("draft"),
        manifest["max_seq_len"],
        manifest["verify_k"],
        root,
        manifest,
        time.perf_counter() - t0,
    )


# ---- benchmark --------------------------------------------------------------------------------
@dataclass
class TPBenchResult:
    package: str
    world_size: int
    threads_per_rank: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_ms: float  # per decode step, all ranks in lock step
    all_reduce_ms: float  # one all_reduce of a [1, 1, hidden] fp32 tensor on the package group
    all_reduces_per_step: int  # 2 per layer (attention and MLP outputs)
    load_s: float

    @property
    def comm_ms(self) -> float:
        """Estimated collective time per decode step."""
        return self.all_reduce_ms * self.all_reduces_per_step

    @property
    def compute_ms(self) -> float:
        return max(self.decode_ms - self.comm_ms, 0.0)


def _bench_rank0(
    engine: Engine, prompt_len: int, gen_tokens: int, runs: int, iters: int
) -> dict[str, Any]:
    control: Control = engine.target.control
    manifest = engine.manifest
    cfg = manifest["models"]["target"]["config"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, engine.tokenizer.vocab_size, (prompt_len,), generator=gen)
    config = GenerationConfig(max_new_tokens=gen_tokens, ignore_eos=True, sampling=SamplingParams())
    prefill, decode = [], []
    for i in range(1 + runs):
        r = engine.generate(prompt.tolist(), config)
        if i:
            prefill.append(r.prefill_tok_s)
            decode.append(r.decode_tok_s)
    # Last, after every graph call: see all_reduce_loop.
    control.send(ALL_REDUCE, 0, cfg["hidden_size"], [iters])
    ar = all_reduce_loop(cfg["hidden_size"], iters, manifest["parallel"]["group_name"])
    dec = statistics.median(decode)
    return asdict(
        TPBenchResult(
            package=str(engine.root),
            world_size=manifest["world_size"],
            threads_per_rank=torch.get_num_threads(),
            prefill_tok_s=statistics.median(prefill),
            decode_tok_s=dec,
            decode_ms=1e3 / dec if dec else float("nan"),
            all_reduce_ms=ar * 1e3,
            all_reduces_per_step=2 * cfg["num_hidden_layers"],
            load_s=engine.load_s,
        )
    )


def bench_tp(
    path: str | Path,
    prompt_len: int = 128,
    gen_tokens: int = 64,
    runs: int = 5,
    threads: int | None = None,
    all_reduce_iters: int = 200,
) -> TPBenchResult:
    """Launch the package's ranks and measure decode speed and the all_reduce cost.

    For `aotgen bench`: call it for packages whose manifest has world_size > 1.
    """
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        args = [path, out, prompt_len, gen_tokens, runs, all_reduce_iters, threads or 0]
        launch(
            ["aotgen.runtime.distributed", "bench", *map(str, args)],
            package_world_size(path),
            threads=threads,
        )
        data = json.loads(out.read_text())
    return TPBenchResult(**data)


def _bench_main(argv: list[str]) -> None:
    path, out, prompt_len, gen_tokens, runs, iters, threads = argv
    engine = start(path, threads=int(threads) or None)
    if engine is None:
        return
    result = _bench_rank0(engine, int(prompt_len), int(gen_tokens), int(runs), int(iters))
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["bench"]:
        _bench_main(sys.argv[2:])
    else:
        sys.exit(f"usage: torchrun ... -m {__spec__.name} bench ARGS (called by bench_tp)")
