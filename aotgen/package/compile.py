"""A model's graphs: export, graph passes, AOTInductor compile (or the project's compile
cache), and what the package needs of each: files, constants, signature.

Tensor parallel: each rank is exported (cheaper than a compile), but only rank 0 is
compiled: the ranks' graphs are identical but for the values of their constants (checked
here), so one compiled graph serves every rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram

from aotgen.export.aoti import (
    GraphSpec,
    compile_graph,
    constant_sources,
    example_inputs,
    export_graph,
    graph_identity,
    replayable,
    row_reads,
)
from aotgen.model.llama import ModelConfig
from aotgen.package.autotune import Autotune
from aotgen.package.models import ModelBuild, recipe_kv_cache
from aotgen.passes.gemv import int8_linears_for_gpu, linears_as_reductions
from aotgen.passes.pack import PackLinears
from aotgen.passes.pack_experts import experts_on_panels
from aotgen.passes.tp import fake_process_group, rank_config, shard_model
from aotgen.recipe import Recipe

# `advance(stage, detail)`: one step of a progress stage ("export", "compile").
Advance = Callable[[str, str], None]


@dataclass
class GraphReport:
    model: str
    graph: str
    export_s: float
    compile_s: float
    so_bytes: int
    cached: bool = False  # the compile came from the project cache


@dataclass
class CompiledModel:
    """One model's compiled graphs and what the package needs to run them."""

    files: dict[str, list[str]]  # package model name -> files for `package_graphs`
    sources: list[dict[str, Tensor]]  # per rank: constant name -> tensor
    signatures: dict[str, Any]  # graph name -> its manifest entry
    graphs: list[GraphReport] = field(default_factory=list)
    group_name: str | None = None  # the process group the compiled collectives name
    tiles: list[dict] = field(default_factory=list)  # the packed kernels' autotune
    packed: int = 0  # weights repacked into panels
    int4_on_q4_1: int = 0  # of them, int4 weights moved onto Q4_1 panels (float32 activations)
    packed_experts: int = 0  # experts modules on panels (passes/pack_experts.py)
    tiles_note: str | None = None  # why the tiles may not be the fastest (Autotune.busy_note)
    gathered: set[str] = field(default_factory=set)  # constants some graph gathers rows of
    read_whole: set[str] = field(default_factory=set)  # constants some graph reads whole

    @property
    def read_by_row(self) -> set[str]:
        """The constants every graph only gathers rows of."""
        return self.gathered - self.read_whole


def graph_signature(spec: GraphSpec, cfg: ModelConfig, cache: list[Tensor]) -> dict[str, Any]:
    t: Any = "T" if spec.dynamic else spec.min_tokens
    b: Any = "B" if spec.batch else 1
    rows = 1 if spec.last_row_logits else t
    tree = [{"name": "tree_mask", "shape": [t, t], "dtype": "bool"}] if spec.tree else []
    slots = [{"name": "slots", "shape": [b], "dtype": "int64"}] if spec.batch else []
    batch = {"batch": {"min": 2, "max": spec.batch}} if spec.batch else {}
    # "key_pos": the runtime passes the cache positions to attend, so nothing reads the
    # position back to the host and the graph can be replayed as a CUDA graph.
    replay = replayable(spec, cache[0].device)
    dtypes = [str(c.dtype).removeprefix("torch.") for c in cache]
    key_pos = [{"name": "key_pos", "shape": ["K"], "dtype": "int64"}] if replay else []
    attention = "key_pos" if replay else "prefix"
    return {
        "tokens": {"min": spec.min_tokens, "max": spec.max_tokens},
        **batch,
        "attention": attention,
        "inputs": [
            {"name": "tokens", "shape": [b, t], "dtype": "int64"},
            {"name": "input_pos", "shape": [b, t] if spec.batch else [t], "dtype": "int64"},
            {
                "name": "kv_caches",
                "count": len(cache),
                "shapes": [[spec.batch or 1, *c.shape[1:]] for c in cache],
                "dtype": dtypes[0],
                **({"dtypes": dtypes} if len(set(dtypes)) > 1 else {}),
            },
            *tree,
            *slots,
            *key_pos,
        ],
        "outputs": [{"name": "logits", "shape": [b, rows, cfg.vocab_size], "dtype": "float32"}],
    }


def compile_model(
    mb: ModelBuild,
    recipe: Recipe,
    advance: Advance,
    compile_cache: Path,
    ranks: list[nn.Module] | None = None,
    rank_cfg: ModelConfig | None = None,
    retune_busy: bool = False,
) -> CompiledModel:
    """Export and compile each graph (or take the compile from `compile_cache`).
    `ranks`: the per-rank shards under tensor parallel. `retune_busy`: measure again the
    cached tiles that were measured under load."""
    ranks = ranks or [mb.model]
    cache = recipe_kv_cache(rank_cfg or mb.config, recipe)
    # CPU tunings (passes/pack.py, passes/gemv.py); GPUs keep their GEMM kernels.
    packers = None
    if recipe.compile.packed_linears and recipe.device == "cpu":  # tiles measured on first use
        tuner = Autotune(compile_cache.parent / "autotune", retune_busy)
        rows = tuple(spec.rows for spec in mb.graphs)
        packers = [PackLinears(tuner.choose, mb.gguf, rows) for _ in ranks]
    compiled = CompiledModel({}, [{} for _ in ranks], {})
    with ExitStack() as panels:
        if packers:  # the experts on panels too, in every graph (passes/pack_experts.py)
            rows_faster = packers[0].bf16_rows_faster
            swapped = [panels.enter_context(experts_on_panels(m, rows_faster)) for m in ranks]
            compiled.packed_experts = swapped[0]
        _compile_graphs(mb, recipe, advance, compile_cache, ranks, cache, packers, compiled)
    if packers:
        compiled.tiles = tuner.summary()
        compiled.tiles_note = tuner.busy_note()
        compiled.packed = len(packers[0].packed_names)
        compiled.int4_on_q4_1 = len(packers[0].int4_names)
    return compiled


def _compile_graphs(
    mb: ModelBuild,
    recipe: Recipe,
    advance: Advance,
    compile_cache: Path,
    ranks: list[nn.Module],
    cache: list[Tensor],
    packers: list[PackLinears] | None,
    compiled: CompiledModel,
) -> None:
    """Each of the model's graphs exported (every rank), compiled once, into `compiled`."""
    reductions = recipe.compile.few_token_linears == "reduction" and recipe.device == "cpu"
    for spec in mb.graphs:
        t0 = time.perf_counter()
        eps = [
            export_with_passes(model, mb, spec, cache, reductions, packers[r] if packers else None)
            for r, model in enumerate(ranks)
        ]
        _check_same_code(eps, f"{mb.role}/{spec.name}")
        ep = eps[0]
        t1 = time.perf_counter()
        advance("export", f"{mb.role}/{spec.name}")
        graph_files, cached = compile_graph(
            ep, example_inputs(spec, cache), recipe.compile.max_autotune, compile_cache
        )
        t2 = time.perf_counter()
        advance("compile", f"{mb.role}/{spec.name}{' (cached)' if cached else ''}")
        key = f"{mb.role}_{spec.name}"
        compiled.files[key] = graph_files
        for rank_sources, rank_ep in zip(compiled.sources, eps, strict=True):
            rank_sources.update(constant_sources(rank_ep))
        by_row, whole = row_reads(ep)
        compiled.gathered |= by_row
        compiled.read_whole |= whole
        signature = graph_signature(spec, mb.config, cache)
        compiled.signatures[spec.name] = {"package_model": key, **signature}
        so_bytes = sum(os.path.getsize(f) for f in graph_files if f.endswith(".so"))
        report = GraphReport(mb.role, spec.name, t1 - t0, t2 - t1, so_bytes, cached)
        compiled.graphs.append(report)


def export_with_passes(
    model: nn.Module,
    mb: ModelBuild,
    spec: GraphSpec,
    cache: list[Tensor],
    reductions: bool,
    packer: PackLinears | None,
) -> ExportedProgram:
    """One graph of `model` exported and put through the model's graph passes, as the package
    compiles it (scripts/gpu_bench.py exports its baseline through it too)."""
    ep = export_graph(model, spec, cache)
    for graph_pass in mb.graph_passes:
        ep = graph_pass(ep)
    if packer is not None:
        ep = packer(ep, spec.rows)
    if not spec.dynamic and not spec.batch and reductions:
        ep = linears_as_reductions(ep)
    if cache[0].is_cuda:
        ep = int8_linears_for_gpu(ep)
    return ep


def compile_sharded(
    mb: ModelBuild,
    recipe: Recipe,
    advance: Advance,
    compile_cache: Path,
    styles: dict[str, str],
    world: int,
    retune_busy: bool = False,
) -> CompiledModel:
    """All ranks of one model, compiled in this process against a fake process group,
    whose name the compiled collectives refer to."""
    with fake_process_group(world) as group_name:
        ranks = [shard_model(mb.model, styles, r, world, group_name) for r in range(world)]
        compiled = compile_model(
            mb, recipe, advance, compile_cache, ranks, rank_config(mb.config, world), retune_busy
        )
    compiled.group_name = group_name
    return compiled


def _check_same_code(eps: list[ExportedProgram], where: str) -> None:
    """One compile may serve all ranks only if their graphs differ in constant values alone."""
    first = graph_identity(eps[0])
    for rank, ep in enumerate(eps[1:], start=1):
        if graph_identity(ep) != first:
            raise RuntimeError(
                f"{where}: rank {rank}'s exported graph differs from rank 0's beyond its "
                "weights, so one compiled graph cannot serve both (a sharding bug)"
            )


def bound_constant_names(pt2: Path, package_models: list[str], device: str) -> set[str]:
    """The constant names the compiled graphs will ask the runtime to bind."""
    from aotgen.runtime.graph_loader import open_loader

    names: set[str] = set()
    for key in package_models:
        names.update(open_loader(pt2, key, torch.device(device)).get_constant_fqns())
    return names
