"""torch.export + AOTInductor: the three graphs of a model, compiled without their weights.

Every graph keeps one signature, `(tokens [1, T], input_pos [T], *kv_caches) -> logits`,
and differs only in T: `prefill` (dynamic, 2..prefill_chunk; logits of its last row only),
`decode` (1) and `verify` (verify_k + 1). The optional `score` graph is the prefill graph with
every row's logits; the optional `tree` graph (tree_nodes rows) also
takes a `[T, T]` bool tree mask after the caches; on a GPU the fixed-width graphs also take
`key_pos [K]`, the cache positions they attend (`arange(K)`, K dynamic); the optional batched graphs
`batch_decode` (T = 1) and `batch_verify` (verify_k + 1) take `tokens [B, T]`,
`input_pos [B, T]`, caches with one row per slot and `slots [B]`, for B in 2..max_batch
(model/layers.py). Weights stay out of the `.so` (`package_constants_in_so=False`): the
package stores them once, and the runtime binds that one copy to every graph.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import sysconfig
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental import _config as fx_config
from torch.utils import _pytree as pytree

from aotgen.export import aoti_runtime, shims
from aotgen.tempdirs import partial_dir, private_dir, remove_stale


@dataclass(frozen=True)
class GraphSpec:
    name: str
    min_tokens: int
    max_tokens: int
    batch: int = 0  # batched graphs: the cache's slots, the most sequences per call

    @property
    def dynamic(self) -> bool:
        """Whether the token count varies (the prefill graph); a batch's size always does."""
        return self.min_tokens != self.max_tokens

    @property
    def rows(self) -> int:
        """The most rows one call multiplies through each weight (what kernels tune for)."""
        return self.max_tokens * max(self.batch, 1)

    @property
    def tree(self) -> bool:
        return self.name == "tree"

    @property
    def last_row_logits(self) -> bool:
        """The graph returns its last row's logits only (model/layers.py)."""
        return self.name == "prefill"


def graph_specs(
    prefill_chunk: int, verify_k: int, tree_nodes: int = 0, max_batch: int = 0, score: bool = False
) -> list[GraphSpec]:
    specs = [
        GraphSpec("prefill", 2, prefill_chunk),
        GraphSpec("decode", 1, 1),
        GraphSpec("verify", verify_k + 1, verify_k + 1),
    ]
    if score:
        specs.append(GraphSpec("score", 2, prefill_chunk))
    if tree_nodes:
        specs.append(GraphSpec("tree", tree_nodes, tree_nodes))
    if max_batch:
        specs.append(GraphSpec("batch_decode", 1, 1, max_batch))
        specs.append(GraphSpec("batch_verify", verify_k + 1, verify_k + 1, max_batch))
    return specs


def calibration_spec(prefill_chunk: int) -> GraphSpec:
    """The prefill graph's shape with every row's logits (GPTQ sees the head's inputs too)."""
    return GraphSpec("calibration", 2, prefill_chunk)


def slotted(caches: list[Tensor], slots: int) -> list[Tensor]:
    """Caches like `caches` (`[1, ...]` each) with one row per sequence slot."""
    return [c.new_zeros(slots, *c.shape[1:]) for c in caches]


def example_inputs(spec: GraphSpec, caches: list[Tensor]) -> tuple:
    """A graph's example inputs on the single-sequence `caches` (batched graphs get their
    slotted copy). Positions near the start keep the data-dependent attention length valid."""
    t = spec.max_tokens if spec.dynamic else spec.min_tokens
    device = caches[0].device  # the graph runs where its cache lives
    if spec.batch:
        b = spec.batch
        positions = torch.arange(t, device=device).repeat(b, 1)
        tokens = torch.zeros(b, t, dtype=torch.long, device=device)
        slots = torch.arange(b, device=device)
        return (tokens, positions, slotted(caches, b), None, slots)
    args = (
        torch.zeros(1, t, dtype=torch.long, device=device),
        torch.arange(t, device=device),
        caches,
    )
    # A chain: any tree traces the same graph.
    tree_mask = torch.ones(t, t, dtype=torch.bool, device=device).tril() if spec.tree else None
    if replayable(spec, device):  # traced over the whole cache; the length stays dynamic
        return (*args, tree_mask, None, torch.arange(cache_len(caches), device=device))
    return args if tree_mask is None else (*args, tree_mask)


def cache_len(caches: list[Tensor]) -> int:
    return caches[0].shape[2]


def dynamic_shapes(spec: GraphSpec, caches: list[Tensor]) -> tuple | None:
    """The token count of `tokens` and `input_pos` is dynamic in the prefill graph, the
    number of sequences in the batched graphs, the attended length (`key_pos`) in the graphs
    replayed on a GPU."""
    if spec.batch == 2:  # one batch size (`max_batch: 2`): export takes no Dim of one value
        return None
    if spec.batch:
        b = Dim(f"{spec.name}_batch", min=2, max=spec.batch)
        return ({0: b}, {0: b}, [None] * len(caches), None, {0: b})
    if replayable(spec, caches[0].device):
        keys = Dim(f"{spec.name}_keys", min=2, max=cache_len(caches))
        return (None, None, [None] * len(caches), None, None, {0: keys})
    if not spec.dynamic:
        return None
    t = Dim(f"{spec.name}_tokens", min=spec.min_tokens, max=spec.max_tokens)
    return ({1: t}, {0: t}, [None] * len(caches))


def replayable(spec: GraphSpec, device: torch.device) -> bool:
    """Whether a graph is exported for CUDA-graph replay: a fixed-width, single-sequence graph
    for a GPU, attending over the `key_pos` it is given (model/layers.py, runtime/cuda_graph.py)."""
    return device.type == "cuda" and not spec.dynamic and not spec.batch


def export_graph(model: nn.Module, spec: GraphSpec, caches: list[Tensor]) -> ExportedProgram:
    # A cache slice `[1, kv, K, d]` is contiguous only at K = cache_len: without size-oblivious
    # guards, tracing a span that may be the whole cache adds the guard K != cache_len.
    oblivious = replayable(spec, caches[0].device)
    with (
        torch.no_grad(),
        warnings.catch_warnings(),
        model.last_row_logits(spec.last_row_logits),
        fx_config.patch(backed_size_oblivious=oblivious),
    ):
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(
            model,
            example_inputs(spec, caches),
            dynamic_shapes=dynamic_shapes(spec, caches),
            strict=False,
        )


def inductor_options(max_autotune: bool, device: str) -> dict:
    options = {
        "aot_inductor.package": True,
        "aot_inductor.package_constants_in_so": False,
        "max_autotune": max_autotune,
    }
    # GCC contracting multiply+add into FMA: on an AVX2-only CPU the 5-row verify reduction
    # ran 15 % faster and chat speculation 1.26-1.27x against 1.08-1.21x (AMD EPYC Zen 3);
    # on AVX-512 (AMD EPYC) it made verify slower (25.4 -> 30.3 ms, docs/benchmarks.md).
    # Packages are tied to the ISA they were built for, so the choice is the build machine's.
    if device == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX2":
        options["cpp.enable_floating_point_contract_flag"] = "fast"
    # The CPU wrapper (argument checks, kernel calls in order) compiled without optimisation:
    # SmolLM2's fp32 build 329 -> 278 s with decode, verify and prefill steps unchanged
    # (within +-3 %, AMD EPYC Zen 1; docs/build-cache.md). The kernels keep their own -O3.
    if device == "cpu":
        options["aot_inductor.compile_wrapper_opt_level"] = "O0"
    return options


def graph_identity(ep: ExportedProgram) -> tuple:
    """The graph as the compiler sees it: its code, and the metadata (not the values) of the
    constants it binds by name. Graphs equal in this compile to the same code, so one compile
    serves every TP rank, and a cached compile serves a later build."""
    consts = constant_sources(ep)
    return (
        ep.graph_module.code,
        # Storage offsets too: Inductor bakes them into the constant table.
        sorted((n, t.shape, t.stride(), t.storage_offset(), t.dtype) for n, t in consts.items()),
    )


def compile_key(
    ep: ExportedProgram, args: tuple, options: dict, objects: Sequence[shims.KernelObject] = ()
) -> str:
    """Everything an AOTInductor compile depends on: the graph, its input shapes and dynamic
    ranges, the options and the rest of Inductor's config, the thread count (the C++ backend
    sizes its parallel loops by it), torch, the CPU's ISA or the GPU, the C++ compiler, and
    the objects it links (their names carry the key of their source and flags)."""
    from torch._inductor import config
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

    leaves = [t for t in pytree.tree_leaves(args) if t is not None]
    inputs = [(t.shape, t.stride(), t.dtype, t.device) for t in leaves]
    # aot_compile fills aot_inductor.metadata in (device, ISA) on its first call: drop it,
    # or a process's first graph would key differently from the same graph later.
    inductor = {
        k: v for k, v in config.save_config_portable().items() if k != "aot_inductor.metadata"
    }
    device = args[0].device
    hardware = (
        f"{torch.cuda.get_device_properties(device).name} sm{torch.cuda.get_device_capability()}"
        f" cuda {torch.version.cuda}"
        if device.type == "cuda"
        else torch.backends.cpu.get_cpu_capability()
    )
    parts = (
        graph_identity(ep),
        inputs,
        sorted((str(k), str(v)) for k, v in ep.range_constraints.items()),
        json.dumps({k: v for k, v in options.items() if k != shims.C_SHIMS}, sort_keys=True),
        json.dumps(inductor, sort_keys=True, default=repr),
        torch.get_num_threads(),
        torch.__version__,
        hardware,
        get_compiler_version_info(get_cpp_compiler()),
        sorted(obj.path.name for obj in objects),
    )
    if c_shims := options.get(shims.C_SHIMS):  # the custom kernels' declarations
        parts += (sorted((str(op), decl) for op, decl in c_shims.items()),)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def compile_graph(
    ep: ExportedProgram, args: tuple, max_autotune: bool, cache: Path | None = None
) -> tuple[list[str], bool]:
    """AOTInductor-compile one exported graph; returns the files for `package_aoti` and
    whether they came from `cache`.

    A compile takes minutes (about one per 30-layer graph here) and the same graph recurs
    across builds: a speculative recipe's target graphs are the plain recipe's, and a new
    draft or k leaves most graphs as they were. So compiles are kept in `cache` by
    `compile_key`: the weights are not in the `.so`, so equal keys compile to equal files.
    """
    import torch._inductor

    cpu = args[0].device.type == "cpu"
    options = inductor_options(max_autotune, args[0].device.type)
    with shims.kernel_dir(cache) as kernels:
        link, objects = shims.link_options(ep.graph, kernels)
        if cpu:
            objects.append(aoti_runtime.runtime_object(kernels))
        options.update(link)
        options.update(shims.library_options(objects))
        entry = cache / compile_key(ep, args, options, objects) if cache else None
        if entry and (cached := _cached_files(entry)) is not None:
            return cached, True
        with (
            warnings.catch_warnings(),
            shims.linking(objects),
            aoti_runtime.graph_only() if cpu else contextlib.nullcontext(),
        ):
            warnings.simplefilter("ignore", FutureWarning)
            files = torch._inductor.aot_compile(ep.module(), args, options=options)
    if entry:
        _store(entry, [f for f in files if f])
    return files, False


CACHE_INDEX = "files.json"  # {file name: sha256}, written last


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _cached_files(entry: Path) -> list[str] | None:
    """The files of a cache entry if every one still has the sha256 it was stored with;
    a damaged entry (a truncated or corrupted `.so` would crash or mislead the build that
    loads it) is removed, with a warning, and the graph compiles again."""
    index = entry / CACHE_INDEX
    if not index.is_file():
        return None
    try:
        digests = json.loads(index.read_text())
        ok = isinstance(digests, dict) and all(
            _sha256(entry / name) == digest for name, digest in digests.items()
        )
    except (OSError, ValueError, TypeError):
        ok = False
    if ok:
        return [str(entry / name) for name in digests]
    warnings.warn(
        f"compile cache entry {entry} is damaged (a file does not match its sha256); "
        "removing it and compiling again",
        stacklevel=2,
    )
    shutil.rmtree(entry, ignore_errors=True)
    return None


def _store(entry: Path, files: list[str]) -> None:
    """Copy a compile's files into the cache with their sha256: into a temporary dir,
    renamed into place, so a reader sees a complete entry or none (and a concurrent
    build's copy is as good)."""
    if not all(isinstance(f, str) for f in files):
        return  # e.g. weights packaged as objects: not plain files, not cached
    names = [Path(f).name for f in files]
    if len(set(names)) < len(names):
        return  # the package keeps base names only; clashing ones cannot be stored as such
    remove_stale(entry.parent)
    tmp = partial_dir(entry)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f, name in zip(files, names, strict=True):
        shutil.copy2(f, tmp / name)
    digests = {name: _sha256(tmp / name) for name in names}
    (tmp / CACHE_INDEX).write_text(json.dumps(digests))
    try:
        tmp.rename(entry)
    except OSError:  # another build stored it first
        shutil.rmtree(tmp, ignore_errors=True)


def package_graphs(path: Path, files: dict[str, list[str]]) -> None:
    from torch._inductor.package import package_aoti

    package_aoti(str(path), files)


def constant_sources(ep: ExportedProgram) -> dict[str, Tensor]:
    """Every tensor the compiled graph may ask for by name: parameters, buffers, constants."""
    return {**ep.state_dict, **ep.constants}


def row_reads(ep: ExportedProgram) -> tuple[set[str], set[str]]:
    """(the constants the graph reads only by row: embedding tables and per-position tables,
    gathered at the tokens or positions of a step; the constants it reads otherwise). A step
    reads one row of the first per token, the whole of the second (`aotgen bench`'s bytes)."""
    aten = torch.ops.aten
    lifted = {
        spec.arg.name: spec.target
        for spec in ep.graph_signature.input_specs
        if spec.kind != InputKind.USER_INPUT
    }

    def gathers_rows(user: torch.fx.Node, table: torch.fx.Node) -> bool:
        if user.target in (aten.embedding.default, aten.index.Tensor):
            return user.args[0] is table
        return user.target is aten.index_select.default and user.args[:2] == (table, 0)

    by_row, whole = set(), set()
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in lifted:
            rows = bool(node.users) and all(gathers_rows(u, node) for u in node.users)
            (by_row if rows else whole).add(lifted[node.name])
    return by_row, whole


def compiler_path(cache_dir: Path) -> Path:
    """`cache_dir` as a path the C++ compiler can be given: torch's C++ builder splits its
    command line as a shell would (shlex) without quoting the paths in it, so a cache under
    a directory named with a space or a quote would name no file. Such a cache is reached
    through a link in this user's private temp dir (`tempdirs.private_dir`), named by the
    cache's path (the same link for every build: the compiles' cache keys stay the same)."""
    from aotgen.recipe import ProjectError

    _check_headers()
    cache_dir = Path(cache_dir).absolute()
    if _shell_safe(cache_dir):
        return cache_dir
    if not _shell_safe(Path(tempfile.gettempdir())):
        raise ProjectError(
            f"the cache dir {str(cache_dir)!r} holds a space or a quote, which torch's C++ "
            'builder cannot pass to the compiler; set cache_dir = "DIR" in aotgen.toml to a '
            "path without them"
        )
    digest = hashlib.sha256(str(cache_dir).encode()).hexdigest()[:16]
    link = private_dir() / f"cache-{digest}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() and link.resolve() == cache_dir.resolve()):
        tmp = link.with_name(f"{link.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(cache_dir, target_is_directory=True)
        tmp.replace(link)  # atomic: a concurrent build sees the old link or the new one
    return link


def _check_headers() -> None:
    """torch's and Python's headers are on every compile command: no link can stand in."""
    from aotgen.recipe import ProjectError

    for needed, what in (
        (Path(torch.__file__).parent, "torch"),
        (Path(sysconfig.get_path("include")), "Python"),
    ):
        if not _shell_safe(needed):
            raise ProjectError(
                f"{what} is installed under {str(needed)!r}, a path with a space or a quote, "
                "which torch's C++ builder cannot pass to the compiler; install it under a "
                "path without them"
            )


def _shell_safe(path: Path) -> bool:
    try:
        return shlex.split(str(path)) == [str(path)]
    except ValueError:  # an unclosed quote
        return False


_INDUCTOR_DIRS: set[str] = set()  # what use_cache_dir set: a later build's project replaces it


def use_cache_dir(cache_dir: Path) -> None:
    """Keep Inductor's working files in the project cache dir, `inductor/` (compiled graphs
    are reused through `compile_graph`'s own cache there, `graphs/`), unless the user's
    TORCHINDUCTOR_CACHE_DIR names another. Importing Inductor sets that variable to torch's
    default, `$TMPDIR/torchinductor_USER`, a path any user of the machine may create first and
    plant sources in that a compile takes as its own. Its precompiled headers, which torch
    keeps there whatever the variable says, go to this user's private temp dir."""
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    ours = str(Path(cache_dir).absolute() / "inductor")
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir(), *_INDUCTOR_DIRS):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = ours
        _INDUCTOR_DIRS.add(ours)
    headers = private_dir() / "precompiled_headers"
    codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = str(headers), str(headers / "locks")
