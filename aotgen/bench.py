"""Benchmarks of built packages: prefill / decode tok/s and the memory roofline.

Decode of a small model on CPU is bound by reading the weights once per token, and past a
few thousand tokens of context by reading the KV cache too, so the honest yardstick is
`(weight + KV-cache bytes per token) × tok/s ÷ measured read bandwidth`.
Runtime-side only: imports no model code.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from aotgen.package.manifest import kv_position_bytes
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationResult
from aotgen.runtime.onnx_backend import onnx_weight_bytes
from aotgen.runtime.sampling import SamplingParams
from aotgen.runtime.tree import Tree
from aotgen.runtime.tree_draft import TreeParams


def measure_bandwidth(mbytes: int = 512, runs: int = 5, device: str = "cpu") -> float:
    """Read bandwidth in GB/s of `device`'s memory: best of `runs` sums over a buffer far
    larger than cache (`.item()` waits for a GPU to finish)."""
    buf = torch.ones(mbytes * (1 << 20) // 4, device=device)
    buf.sum().item()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        buf.sum().item()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def weight_bytes(engine: Engine) -> int:
    """Bytes of target weights read per decoded token: every weight once, but of a mixture
    of experts' stacked experts only the k of E that one token is routed to, and of a table
    the graphs only gather rows of (an untied embedding, RoPE's) one row."""
    entry = engine.manifest["models"]["target"]
    if engine.backend == "onnxruntime":
        return onnx_weight_bytes(engine.root, entry)
    cfg = engine.target.config
    routed = cfg.get("num_experts_per_tok", 0) / cfg["num_experts"] if cfg.get("num_experts") else 1
    weights = engine.target.weights
    by_row = set(entry["weights"].get("read_by_row", []))  # older packages: every weight whole
    read_whole = {t.untyped_storage().data_ptr() for n, t in weights.items() if n not in by_row}
    seen, total = set(), 0.0
    for name, t in weights.items():
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            share = routed if ".experts." in name else 1
            nbytes = t.untyped_storage().nbytes()
            total += (nbytes if key in read_whole else nbytes / t.shape[0]) * share
    return int(total)


def kv_read_bytes(
    position_bytes: list[int], windows: list[int | None], prompt_len: int, gen_tokens: int
) -> int:
    """Mean bytes of KV cache a decode step reads after a `prompt_len`-token prompt: each
    layer's `position_bytes` (its keys and values, or a convolution's inputs, at one position)
    times the positions it attends: all of them, or its last `windows[layer]`."""
    steps = range(prompt_len + 1, prompt_len + gen_tokens)  # keys each decode step attends
    if not steps:
        return 0
    layers = zip(position_bytes, windows, strict=True)
    return round(sum(b * min(n, w or n) for b, w in layers for n in steps) / len(steps))


def package_kv_bytes(entry: dict, prompt_len: int, gen_tokens: int) -> int:
    """`kv_read_bytes` of a package's model, from its manifest entry: the cache's shapes and
    dtype, and which layers slide or convolve."""
    cfg = entry["config"]
    per = kv_position_bytes(entry["kv_cache"])
    kinds = cfg.get("layer_types") or ["full_attention"] * len(per)
    # A ring's layers attend every cell written (model/layers.py), a full cache's the window;
    # a linear-attention layer reads one state (and its convolution's last inputs, a few kB).
    window = entry["kv_cache"].get("ring", {}).get("cells") or cfg.get("sliding_window")
    caps = {"sliding_attention": window, "conv": cfg.get("conv_kernel"), "linear_attention": 1}
    return kv_read_bytes(per, [caps.get(k) for k in kinds], prompt_len, gen_tokens)


def gguf_kv_bytes(path: Path, prompt_len: int, gen_tokens: int) -> int:
    """`kv_read_bytes` of a GGUF's model in llama.cpp's default cache (f16 keys and values;
    a convolution layer's small rolling state not counted; a linear-attention layer's float32
    recurrent state, read once a step)."""
    from aotgen.checkpoint.gguf import open_gguf
    from aotgen.checkpoint.gguf_config import read_config

    cfg = read_config(open_gguf(path))
    layers = cfg["num_hidden_layers"]
    heads = cfg.get("kv_heads_per_layer") or [cfg["num_key_value_heads"]] * layers
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kinds = cfg.get("layer_types") or ["full_attention"] * layers
    window = cfg.get("sliding_window")
    windows = [
        1 if k == "linear_attention" else window if k == "sliding_attention" else None
        for k in kinds
    ]
    state = cfg.get("linear_num_value_heads", 0) * cfg.get("linear_key_head_dim", 0)
    state *= cfg.get("linear_value_head_dim", 0) * 4
    per = [
        state if k == "linear_attention" else 2 * h * head_dim * 2
        for h, k in zip(heads, kinds, strict=True)
    ]
    return kv_read_bytes(per, windows, prompt_len, gen_tokens)


class BenchError(RuntimeError):
    """A benchmark that cannot run as asked (missing optional extra or input)."""


@dataclass
class BenchResult:
    package: str
    prefill_tok_s: float
    decode_tok_s: float
    decode_ms: float
    weight_bytes: int
    load_s: float
    spec: str = ""
    device: str = "cpu"  # whose memory bandwidth the roofline divides by
    kv_bytes: int = 0  # of KV cache a decode step reads, on average

    def roofline(self, bandwidth_gbs: float) -> float:
        """Fraction of the memory roofline the decode reaches: weights and KV cache read."""
        return (self.weight_bytes + self.kv_bytes) * self.decode_tok_s / (bandwidth_gbs * 1e9)


def prompt_ids(vocab: int, n: int) -> list[int]:
    """The benchmarks' prompt: `n` seeded random ids (the same for every runtime)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab, (n,), generator=gen).tolist()


class PackageRunner:
    """One aotgen package: timed generations through the Python runtime."""

    def __init__(
        self,
        path: str | Path,
        prompt_len: int,
        gen_tokens: int,
        threads: int | None,
        backend: str = "aoti",
        label: bool = False,
    ):
        self.engine = Engine.load(path, threads=threads, backend=backend)
        self.name, self.load_s = Path(path).name, self.engine.load_s
        if label:  # several backends in one table
            self.name += f" ({'AOTInductor' if backend == 'aoti' else 'ONNX Runtime'})"
        self.device = self.engine.target.device.type
        self.weight_bytes = weight_bytes(self.engine)
        entry = self.engine.manifest["models"]["target"]
        self.kv_bytes = package_kv_bytes(entry, prompt_len, gen_tokens)
        self.prompt = prompt_ids(self.engine.tokenizer.vocab_size, prompt_len)
        # Every run prefills the whole prompt: the same prompt again would find it cached.
        self.cfg = GenerationConfig(
            max_new_tokens=gen_tokens,
            ignore_eos=True,
            sampling=SamplingParams(),
            reuse_prefix=False,
        )

    def run(self) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) of one greedy generation, eos ignored."""
        r = self.engine.generate(self.prompt, self.cfg)
        return r.prefill_tok_s, r.decode_tok_s


class LlamaCppRunner:
    """The same measurement through llama.cpp (`llama-cpp-python`, an optional extra that
    builds llama.cpp from source: `pip install 'aotgen[llamacpp]'`), for a same-run baseline.

    Prompt ids, greedy decoding and the timed spans match `PackageRunner`: prefill is the
    prompt's forward pass, decode the `gen_tokens - 1` single-token steps after it.
    """

    device = "cpu"

    def __init__(self, gguf: str | Path, prompt_len: int, gen_tokens: int, threads: int | None):
        try:
            import llama_cpp
            import numpy as np
            from llama_cpp import Llama
        except ImportError as e:
            raise BenchError(
                "--llama-cpp needs the optional `llama-cpp-python` package "
                "(pip install llama-cpp-python, the aotgen[llamacpp] extra; it compiles llama.cpp, "
                "~15-20 minutes)"
            ) from e
        path = Path(gguf)
        if not path.is_file():
            raise BenchError(f"{path}: no such GGUF file")
        threads = threads or torch.get_num_threads()
        t0 = time.perf_counter()
        self.llm = Llama(
            str(path),
            n_ctx=prompt_len + gen_tokens + 8,
            n_batch=prompt_len,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.name, self.load_s = f"llama.cpp {path.name}", time.perf_counter() - t0
        self.weight_bytes = path.stat().st_size
        self.kv_bytes = gguf_kv_bytes(path, prompt_len, gen_tokens)
        vocab = self.llm.n_vocab()
        self.prompt, self.gen_tokens = prompt_ids(vocab, prompt_len), gen_tokens
        # Greedy: argmax of the last position's logits (all that llama.cpp computes).
        logits = partial(llama_cpp.llama_get_logits, self.llm.ctx)
        self.greedy = lambda: int(np.ctypeslib.as_array(logits(), (vocab,)).argmax())

    def run(self) -> tuple[float, float]:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(self.prompt)
        tok = self.greedy()
        t1 = time.perf_counter()
        for _ in range(self.gen_tokens - 1):
            self.llm.eval([tok])
            tok = self.greedy()
        t2 = time.perf_counter()
        return len(self.prompt) / (t1 - t0), (self.gen_tokens - 1) / (t2 - t1)


def bench_interleaved(
    runners: list[PackageRunner | LlamaCppRunner], runs: int = 5, warmup: int = 1
) -> list[BenchResult]:
    """Median of `runs` timed generations per runner after `warmup` ones, taken round-robin
    (run 1 of every runner, then run 2, ...) so that a machine's drifting speed affects all
    alike instead of whichever ran last."""
    times: list[list[tuple[float, float]]] = [[] for _ in runners]
    for i in range(warmup + runs):
        for runner, ts in zip(runners, times, strict=True):
            t = runner.run()
            if i >= warmup:
                ts.append(t)
    results = []
    for runner, ts in zip(runners, times, strict=True):
        dec = statistics.median(d for _, d in ts)
        results.append(
            BenchResult(
                package=runner.name,
                prefill_tok_s=statistics.median(p for p, _ in ts),
                decode_tok_s=dec,
                decode_ms=1e3 / dec if dec else float("nan"),
                weight_bytes=runner.weight_bytes,
                kv_bytes=runner.kv_bytes,
                load_s=runner.load_s,
                device=runner.device,
            )
        )
    return results


def requantize_gguf(src: str | Path, dst: str | Path, ftype: str) -> Path:
    """Write `src` re-quantized as `ftype` (Q8_0, F32, ...) with llama.cpp's own quantizer, so the
    baseline has the formats the int8 / int4 targets name (the bundled model is Q4_1)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(
        llama_cpp, "LLAMA_FTYPE_" + ("ALL_F32" if ftype == "F32" else f"MOSTLY_{ftype}")
    )
    params.allow_requantize = True
    params.nthread = torch.get_num_threads()
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise BenchError(f"llama.cpp could not re-quantize {src} to {ftype}")
    return dst


PROMPTS_FILE = Path(__file__).parent / "data" / "bench_prompts.json"


def median_call_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `reps` calls of `fn`, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def step_costs(engine: Engine, reps: int = 20) -> dict[str, float]:
    """Median ms of one target decode, one verify block and one draft decode step.

    These decide speculative speed-up: (tokens per verify) / (k·c + v), with c = draft step /
    decode step and v = verify step / decode step.
    """
    prompt = list(range(100, 164))
    costs: dict[str, float] = {}
    median_ms = partial(median_call_ms, reps=reps)
    t = engine.target
    t.forward(prompt, 0)
    costs["decode_ms"] = median_ms(lambda: t.decode(5, len(prompt)))
    block = [5] * (engine.verify_k + 1)
    costs["verify_ms"] = median_ms(lambda: t.forward(block, len(prompt), all_logits=True))
    if getattr(t, "tree_len", 0):  # a full tree-graph call (its rows are padded anyway)
        tree = Tree([5] * t.tree_len, [-1] + list(range(t.tree_len - 1)), [None] * t.tree_len)
        costs["tree_ms"] = median_ms(lambda: t.tree_forward(tree, len(prompt)))
    if engine.draft is not None:
        d = engine.draft
        d.forward(prompt, 0)
        costs["draft_ms"] = median_ms(lambda: d.decode(5, len(prompt)))
    return costs


@dataclass
class LookupRun:
    """One generation by llama.cpp's `llama-lookup` (its n-gram speculative decoding)."""

    predicted: int  # tokens generated
    drafted: int
    accepted: int
    decode_s: float


def llama_lookup_binary() -> Path:
    """`llama-lookup` from $LLAMA_CPP_BIN (llama.cpp's build/bin), else from PATH."""
    folder = os.environ.get("LLAMA_CPP_BIN")
    found = Path(folder) / "llama-lookup" if folder else shutil.which("llama-lookup")
    if not found or not Path(found).is_file():
        raise BenchError(
            "--llama-lookup needs llama.cpp's llama-lookup binary: set LLAMA_CPP_BIN to the "
            "directory holding it, or put it on PATH"
        )
    return Path(found)


def run_llama_lookup(
    binary: Path,
    gguf: Path,
    prompt: str,
    n: int,
    k: int,
    threads: int | None,
    lookup_cache: Path | None = None,
) -> LookupRun:
    """Greedy `llama-lookup` on prompt (text with its special tokens, parsed as such); with
    `lookup_cache`, its dynamic n-gram cache file (`-lcd`), read and written back."""
    t = str(threads or torch.get_num_threads())
    cmd = [binary, "-m", gguf, "-p", prompt, "-n", str(n), "--spec-draft-n-max", str(k)]
    cmd += ["-t", t, "-tb", t, "--temp", "0", "-c", "4096"]
    cmd += ["-lcd", lookup_cache] if lookup_cache else []
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    drafted = re.search(r"n_drafted\s+=\s+(\d+)", log)
    accepted = re.search(r"n_accept\s+=\s+(\d+)", log)
    if proc.returncode != 0 or not (decoded and drafted and accepted):
        tail = log.strip().splitlines()[-1:] or ["no output"]
        raise BenchError(f"llama-lookup failed (exit {proc.returncode}): {tail[0]}")
    return LookupRun(int(decoded[1]), int(drafted[1]), int(accepted[1]), float(decoded[2]))


@dataclass
class SpecBenchRow:
    mode: str
    task: str
    tok_s: float  # end to end: all tokens over prefill + decode time
    tokens: int
    decode_tok_s: float = float("nan")  # tokens after the first over the time after it
    acceptance: float = float("nan")
    mean_accepted_length: float = float("nan")
    by_position: list[float] | None = None
    same_as_plain: bool | None = True  # None: not compared (llama.cpp's own runs)
    branch_steps: int = 0  # tree modes: steps whose accepted path left the main chain
    steps: int = 0


def bench_speculative(
    path: str | Path,
    max_new_tokens: int = 96,
    k: int | None = None,
    threads: int | None = None,
    rounds: int = 3,
    llama_lookup: Path | None = None,
    tree: TreeParams | None = None,
    sampling: SamplingParams | None = None,
) -> tuple[list[SpecBenchRow], dict[str, float]]:
    """Plain vs speculative decode in one run, on chat prompts and on two input-grounded
    copy/edit prompts (a row each): n-gram lookup, and with a draft in the package the draft
    alone and the draft behind lookup (draft+ngram), all on the same loaded package. With
    `llama_lookup` (a GGUF of the same weights), llama.cpp's `llama-lookup` runs the grounded
    prompts too, with the same draft length. A package with a tree graph adds each
    speculative mode as a tree (`tree`, default TreeParams()).

    Greedy by default. With `sampling` (temperature > 0) every mode samples, each generation
    seeded by its prompt and pass (the same seed for every mode): outputs then differ between
    modes by design, so `same_as_plain` is None and the speculative modes' exactness is the
    distribution tests' business (tests/test_tree_sampling.py, tests/test_speculative.py).

    The modes take turns on each prompt (plain, n-gram, draft, ..., then the next prompt), for
    `rounds` passes over the prompts, so the machine's speed, which can drift by tens of
    percent from minute to minute, affects every mode alike.
    """
    import json

    engine = Engine.load(path, threads=threads)
    binary = llama_lookup_binary() if llama_lookup else None
    k_used = min(k or engine.verify_k, engine.verify_k)
    prompts = json.loads(PROMPTS_FILE.read_text())
    tasks = {"chat": [engine.chat_ids(p) for p in prompts["chat"]]}
    for i, template in enumerate(prompts["grounded"], 1):
        tasks[f"grounded {i}"] = [engine.chat_ids(template.format(text=prompts["grounded_text"]))]
    sampling = sampling or SamplingParams()
    configs = speculative_configs(engine, max_new_tokens, k, tree)
    modes = list(configs)
    rows = []
    for task, prompt_ids in tasks.items():
        for cfg in configs.values():
            engine.generate(prompt_ids[0], replace(cfg, sampling=sampling))  # warm-up
        results: dict[str, list[GenerationResult]] = {mode: [] for mode in modes}
        lookups: list[LookupRun] = []
        for rnd in range(rounds):
            for i, ids in enumerate(prompt_ids):
                seeded = replace(sampling, seed=rnd * len(prompt_ids) + i)
                for mode, cfg in configs.items():
                    results[mode].append(engine.generate(ids, replace(cfg, sampling=seeded)))
                if binary and task != "chat":
                    text = engine.tokenizer.decode(ids)
                    args = (binary, llama_lookup, text, max_new_tokens, k_used, threads)
                    lookups.append(run_llama_lookup(*args))
        plain_ids = [r.token_ids for r in results["plain"]] if sampling.greedy else None
        rows += [_spec_row(task, mode, results[mode], plain_ids) for mode in modes]
        if lookups:
            rows.append(_lookup_row(task, lookups))
    return rows, step_costs(engine)


def speculative_configs(
    engine: Engine, max_new_tokens: int, k: int | None, tree: TreeParams | None
) -> dict[str, GenerationConfig]:
    """The benched modes: plain, n-gram, the draft ones, and with a tree graph in the package
    each speculative mode again as a tree ("<mode> tree", `tree` or the default TreeParams)."""
    modes = ["ngram"] + (["draft", "draft+ngram"] if engine.draft is not None else [])
    # The modes take turns on each prompt: each prefills it all, as it would alone.
    plain = GenerationConfig(max_new_tokens=max_new_tokens, reuse_prefix=False)
    configs = {"plain": plain}
    for mode in modes:
        configs[mode] = replace(plain, speculative=mode, k=k)
    if getattr(engine.target, "tree_len", 0):
        for mode in modes:
            configs[f"{mode} tree"] = replace(
                plain, speculative=mode, k=k, tree=tree or TreeParams()
            )
    return configs


def _lookup_row(task: str, runs: list[LookupRun]) -> SpecBenchRow:
    """llama-lookup's runs as a table row: tokens after the first over its decode time."""
    predicted = sum(r.predicted for r in runs)
    accepted = sum(r.accepted for r in runs)
    decode_tok_s = sum(r.predicted - 1 for r in runs) / sum(r.decode_s for r in runs)
    row = SpecBenchRow(
        "llama-lookup", task, decode_tok_s, predicted, decode_tok_s, same_as_plain=None
    )
    row.acceptance = accepted / max(sum(r.drafted for r in runs), 1)
    row.mean_accepted_length = predicted / max(predicted - accepted, 1)
    return row


def _spec_row(
    task: str, mode: str, results: list[GenerationResult], plain_ids: list[list[int]] | None
) -> SpecBenchRow:
    """One table row: decode and end-to-end tok/s over all runs, and the pooled spec stats."""
    n_tok = sum(len(r.token_ids) for r in results)
    secs = sum(r.decode_s + r.prefill_s for r in results)
    same = None if plain_ids is None else [r.token_ids for r in results] == plain_ids
    # Decode: what speculation changes. The target's prefill is the same in every mode; a
    # draft's own prefill runs after the first token, so it is counted here.
    decode_tok_s = sum(len(r.token_ids) - 1 for r in results) / sum(r.decode_s for r in results)
    row = SpecBenchRow(mode, task, n_tok / secs, n_tok, decode_tok_s, same_as_plain=same)
    stats = [r.spec for r in results if r.spec]
    if not stats:
        return row
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    steps = sum(s.steps for s in stats)
    row.steps, row.branch_steps = steps, sum(s.branch_steps for s in stats)
    row.acceptance = accepted / max(drafted, 1)
    row.mean_accepted_length = (accepted + steps) / max(steps, 1)
    width = max(len(s.accepted_by_position) for s in stats)

    def pooled(attr: str) -> list[int]:
        return [
            sum(getattr(s, attr)[i] for s in stats if i < len(getattr(s, attr)))
            for i in range(width)
        ]

    row.by_position = [
        a / p if p else float("nan")
        for a, p in zip(pooled("accepted_by_position"), pooled("proposed_by_position"), strict=True)
    ]
    return row
