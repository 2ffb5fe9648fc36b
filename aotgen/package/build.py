"""recipe → package: the build pipeline, one stage after the other.

    checkpoint → model → (module passes) → export → (graph passes) → AOTInductor → package

The stages (`_build`): read and hash the inputs (package/inputs.py) → skip an up-to-date
package → load the models (package/models.py) → calibrate (GPTQ) → compile their graphs
(package/compile.py) → write the package (graphs, weights, tokenizer, manifest) → measure
its perplexity (package/perplexity.py) → publish. Each stage takes what the ones before
it returned.

Everything is written into a temporary directory next to the target and renamed into
place at the end, so an interrupted or failed build never leaves a half-written package.
A content hash of (checkpoint, recipe, aotgen, torch, ISA) makes an unchanged rebuild a
no-op.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aotgen import __version__
from aotgen.export.aoti import compiler_path, package_graphs, use_cache_dir
from aotgen.model.llama import ModelConfig, cache_dtypes, cache_shapes
from aotgen.package.compile import (
    CompiledModel,
    GraphReport,
    bound_constant_names,
    compile_model,
    compile_sharded,
)
from aotgen.package.inputs import BuildInputs, read_inputs, up_to_date
from aotgen.package.manifest import FORMAT_VERSION, target_info, write_manifest
from aotgen.package.models import (
    ModelBuild,
    calibrate,
    prepare_models,
    recipe_kv_cache,
    ring_cells,
    ring_window,
)
from aotgen.package.perplexity import measure_perplexity
from aotgen.package.weights import save_constants
from aotgen.passes.fuse import FuseLinearsPass
from aotgen.passes.quantize_experts import Int8Experts
from aotgen.passes.tp import parse_parallel, plan_summary, rank_config, resolve_plan
from aotgen.recipe import Project, Recipe, RecipeError
from aotgen.runtime.tokenizer import CHAT_TEMPLATE_FILE
from aotgen.tempdirs import old_dir, partial_dir, remove_stale, sigterm_raises

PACKAGE_FILE = "model.pt2"


class BuildProgress:
    """Progress hooks; the CLI subclasses this with rich progress bars."""

    def stage(self, name: str, total: int) -> None: ...

    def advance(self, name: str, detail: str = "") -> None: ...


@dataclass
class BuildReport:
    name: str
    path: Path
    up_to_date: bool = False
    graphs: list[GraphReport] = field(default_factory=list)
    weight_bytes: int = 0
    package_bytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # Held-out perplexity of a quantized target: {"reference": eager float, "package": ...}.
    perplexity: dict[str, float] = field(default_factory=dict)


def build(
    recipe: Recipe,
    project: Project,
    progress: BuildProgress | None = None,
    force: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> BuildReport:
    """Build `recipe` into `project.artifacts_dir / recipe.name`. Writes nothing else there:
    a SIGTERM mid-build removes the partial package like any other failure."""
    with sigterm_raises():
        return _build(recipe, project, progress, force, log)


@dataclass(frozen=True)
class _Models:
    """The package's models, and how they are split across tensor-parallel ranks."""

    models: list[ModelBuild]
    world: int
    tp_styles: dict[str, dict[str, str]]  # role -> module path -> sharding style

    @property
    def n_graphs(self) -> int:
        return sum(len(m.graphs) for m in self.models)


@dataclass
class _Compiled:
    """Every model's compiled graphs, and the manifest entries describing them."""

    files: dict[str, list[str]] = field(default_factory=dict)  # package model -> files
    entries: dict[str, Any] = field(default_factory=dict)  # role -> manifest entry
    sources: dict[str, list[dict[str, Tensor]]] = field(default_factory=dict)  # role -> ranks
    read_by_row: dict[str, set[str]] = field(default_factory=dict)  # role -> gathered constants
    group_name: str | None = None
    graphs: list[GraphReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _build(
    recipe: Recipe,
    project: Project,
    progress: BuildProgress | None,
    force: bool,
    log: Callable[[str], None],
) -> BuildReport:
    progress = progress or BuildProgress()
    t_start = time.perf_counter()
    project = dataclasses.replace(project, cache_dir=compiler_path(project.cache_dir))
    out = project.artifacts_dir / recipe.name
    report = BuildReport(recipe.name, out)
    inputs = read_inputs(recipe, project)
    if "onnx" in recipe.formats:
        _onnx_export()  # a missing optional package fails now, not after the compiles
    if not force and up_to_date(out, inputs.digest):
        report.up_to_date = True
        report.package_bytes = _tree_bytes(out)
        return report
    plan = _load_models(inputs, project, progress)
    _calibrate_models(plan, inputs, log)
    progress.stage("export", plan.n_graphs)
    progress.stage("compile", plan.n_graphs)
    tmp = _partial_dir(out, log)
    try:
        (tmp / "rank0").mkdir(parents=True)
        graphs_cache = project.cache_dir / "graphs"
        compiled = _compile_models(plan, inputs.recipe, progress, graphs_cache, force)
        report.graphs, report.notes = compiled.graphs, compiled.notes
        if quantized := inputs.ckpt.quant_note():
            report.notes.insert(0, quantized)
        manifest, report.weight_bytes = _write_package(tmp, inputs, plan, compiled)
        report.perplexity, notes = measure_perplexity(
            tmp,
            plan.models[0],
            inputs.recipe,
            plan.world,
            manifest,
            project.cache_dir / "perplexity",
        )
        report.notes.extend(notes)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report.package_bytes = _tree_bytes(out)
    report.seconds = time.perf_counter() - t_start
    return report


def _load_models(inputs: BuildInputs, project: Project, progress: BuildProgress) -> _Models:
    """Load the models and check their tensor-parallel plans before compiling anything:
    a bad plan fails in seconds."""
    recipe = inputs.recipe
    use_cache_dir(project.cache_dir)
    if project.threads:
        torch.set_num_threads(project.threads)
    progress.stage("load", 1)
    models = prepare_models(recipe, inputs.ckpt, inputs.adapters)
    tp = parse_parallel(recipe.parallel)
    world = tp.world_size if tp else 1
    tp_styles = {mb.role: resolve_plan(mb.model, tp) for mb in models} if world > 1 else {}
    progress.advance("load", str(inputs.ckpt.path))
    return _Models(models, world, tp_styles)


def _calibrate_models(plan: _Models, inputs: BuildInputs, log: Callable[[str], None]) -> None:
    """GPTQ's calibration run of each model that quantizes with it."""
    calibrated = [mb for mb in plan.models if (q := mb.quantizer) and q.needs_calibration]
    if calibrated and plan.world > 1:
        raise RecipeError(
            "quantize.method gptq does not combine with `parallel` yet (it calibrates the "
            "unsharded model); use method rtn, or build without parallel"
        )
    for mb in calibrated:
        log(f"{mb.role}: GPTQ calibration")
        calibrate(mb, inputs.recipe, inputs.tokenizer)


def _partial_dir(out: Path, log: Callable[[str], None]) -> Path:
    """An empty place to write the package next to `out`, after clearing what killed
    builds left there."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale(out.parent):
        log(f"removed {stale}, left by a build that was killed")
    tmp = partial_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _compile_models(
    plan: _Models, recipe: Recipe, progress: BuildProgress, compile_cache: Path, force: bool
) -> _Compiled:
    """Compile every model's graphs; describe each model for the manifest and the report.
    `force` also measures again the tiles cached from a busy machine."""
    result = _Compiled()
    for mb in plan.models:
        if plan.world > 1:
            styles = plan.tp_styles[mb.role]
            compiled = compile_sharded(
                mb, recipe, progress.advance, compile_cache, styles, plan.world, force
            )
            result.group_name = compiled.group_name
        else:
            compiled = compile_model(mb, recipe, progress.advance, compile_cache, retune_busy=force)
        result.graphs.extend(compiled.graphs)
        result.files.update(compiled.files)
        result.sources[mb.role] = compiled.sources
        result.read_by_row[mb.role] = compiled.read_by_row
        for fuser in (p for p in mb.graph_passes if isinstance(p, FuseLinearsPass)):
            result.notes.append(f"{mb.role}: {fuser.note()}")
        if mb.quantizer:
            result.notes.extend(f"{mb.role}: {n}" for n in mb.quantizer.notes())
        if mb.gguf:
            result.notes.append(f"{mb.role}: {mb.gguf.note()}")
        if compiled.packed:
            result.notes.append(f"{mb.role}: {_packed_note(compiled)}")
        result.entries[mb.role] = _model_entry(mb, compiled.signatures, recipe, plan.world)
        if mb.gguf:
            result.entries[mb.role]["quantization"] = mb.gguf.manifest_entry()
        result.entries[mb.role]["packed_linears"] = {
            "weights": compiled.packed,
            "int4_on_q4_1": compiled.int4_on_q4_1,
            "experts": compiled.packed_experts,  # experts modules on panels
            "tiles": compiled.tiles,  # the autotune's measurements (package/autotune.py)
        }
    return result


def _packed_note(compiled: CompiledModel) -> str:
    """One line per row count: the tiles chosen and the time against BLAS, all shapes."""
    by_rows: dict[int, list[dict]] = {}
    for t in compiled.tiles:
        by_rows.setdefault(t["rows"], []).append(t)
    parts = []
    for rows, tiles in sorted(by_rows.items()):
        us, blas = sum(t["us"] for t in tiles), sum(t["blas_us"] for t in tiles)
        chosen = ", ".join(sorted({f"{t['tile_rows']}x{t['tile_panels']}" for t in tiles}))
        parts.append(f"{rows} rows: tiles {chosen}, {us / 1e3:.2f} ms vs BLAS {blas / 1e3:.2f} ms")
    note = f"packed_linears: {compiled.packed} weights"
    if compiled.int4_on_q4_1:
        note += f" ({compiled.int4_on_q4_1} int4 on Q4_1 panels: float32 activations)"
    if compiled.packed_experts:
        note += f", the experts of {compiled.packed_experts} layers"
    note += "; per shape once: " + "; ".join(parts)
    if compiled.tiles_note is not None:
        note += (
            f". Tiles {compiled.tiles_note}: maybe not the fastest (`aotgen build --force` on a"
            " quiet machine measures them again)"
        )
    return note


def _model_entry(
    mb: ModelBuild, signatures: dict[str, Any], recipe: Recipe, world: int
) -> dict[str, Any]:
    """A model's manifest entry; its weights are added once they are written."""
    quantizer = mb.quantizer
    quantization = quantizer.manifest_entry() if quantizer else None
    cells = ring_cells(mb.config, recipe)
    if quantization and any(isinstance(m, Int8Experts) for m in mb.model.modules()):
        quantization["experts"] = {"scheme": "int8", "granularity": "per-channel", "method": "rtn"}
    return {
        "config": {**mb.config.__dict__, "extra": None},
        "quantization": quantization,
        "graphs": signatures,
        "kv_cache": {
            "layout": "per-layer [k0, v0, k1, v1, ...]: keys and values [1, kv_heads, "
            "cache_len, head_dim] (a convolution layer's inputs [1, 1, cache_len, hidden / 2] "
            "twice; int8: each row's codes, then its float32 scale's 4 bytes), written in "
            "place at input_pos; with `ring`, sliding layers hold `cells` positions, position "
            "p in cell p % cells (linear-attention layers: a ring of convolution inputs [1, 1, "
            "cells, conv_dim] and one of states [1, Hv, cells, Dk * Dv]; `dtypes`, where "
            "given, each tensor's)",
            "layers": mb.config.num_hidden_layers,
            "shapes": cache_shapes(  # per rank
                rank_config(mb.config, world),
                recipe.cache_len,
                1,
                getattr(torch, recipe.kv_dtype),
                cells,
            ),
            "dtype": recipe.kv_dtype,
            **_state_dtypes(mb.config, recipe.kv_dtype),
            "cache_len": recipe.cache_len,
            **({"ring": {"cells": cells, "window": ring_window(mb.config)}} if cells else {}),
            **_cache_sharing(mb.role, recipe),
        },
    }


def _state_dtypes(cfg: ModelConfig, dtype: str) -> dict[str, list[str]]:
    """`dtypes`, each cache tensor's, where some differ from `dtype` (a linear-attention
    layer's float32 states in a bfloat16 cache)."""
    dtypes = [str(d).removeprefix("torch.") for d in cache_dtypes(cfg, getattr(torch, dtype))]
    return {"dtypes": dtypes} if set(dtypes) != {dtype} else {}


def _cache_sharing(role: str, recipe: Recipe) -> dict[str, str]:
    """A draft made from the target's weights runs on the target's KV cache (its first
    layers): no draft prefill, no catch-up step. The runtime checks the layouts match."""
    if role == "draft" and (recipe.speculative or {}).get("share_kv"):
        return {"shared_with": "target"}
    return {}


def _write_package(
    tmp: Path, inputs: BuildInputs, plan: _Models, compiled: _Compiled
) -> tuple[dict[str, Any], int]:
    """The compiled graphs, the weights they bind, the tokenizer and the manifest, in
    `tmp`; returns the manifest and the bytes of weights written."""
    # One compiled package; with TP it is shared by all ranks and lies at the top level.
    pt2 = tmp / PACKAGE_FILE if plan.world > 1 else tmp / "rank0" / PACKAGE_FILE
    package_graphs(pt2, compiled.files)
    ranks, weight_bytes = _write_weights(tmp, pt2, plan, compiled, inputs.recipe.device)
    tok_dir = tmp / "tokenizer"
    tok_dir.mkdir()
    for f in inputs.ckpt.tokenizer_files:
        shutil.copy2(f, tok_dir / f.name)
    if inputs.chat_template is not None:  # both runtimes read chat_template.jinja first
        (tok_dir / CHAT_TEMPLATE_FILE).write_text(inputs.chat_template, encoding="utf-8")
    _write_onnx(tmp, plan, compiled, inputs.recipe)
    manifest = _manifest(inputs, plan, compiled, pt2.relative_to(tmp).as_posix(), ranks)
    write_manifest(tmp, manifest)
    return manifest, weight_bytes


def _onnx_export() -> Any:
    """export/onnx.py, or a recipe error naming the optional packages it needs."""
    try:
        from aotgen.export import onnx
    except ImportError as e:
        raise RecipeError(
            f"formats onnx needs the optional onnx and onnxscript packages ({e}): "
            "pip install 'aotgen[onnx]'"
        ) from None
    return onnx


def _write_onnx(tmp: Path, plan: _Models, compiled: _Compiled, recipe: Recipe) -> None:
    """`formats: [aoti, onnx]`: every model's graphs as ONNX too, from the model's modules,
    with the quantized weights ONNX Runtime has an operator for (docs/onnx.md)."""
    if "onnx" not in recipe.formats:
        return
    onnx = _onnx_export()
    for mb in plan.models:
        cache = recipe_kv_cache(mb.config, recipe)
        graphs = [g for g in mb.graphs if not g.batch]  # batched graphs are AOTInductor-only
        options = mb.quantizer.options if mb.quantizer else None
        entry = onnx.export_model(tmp, mb.role, mb.model, graphs, cache, options)
        compiled.entries[mb.role]["onnx"] = entry
        weights = entry["weights"]
        if isinstance(weights, dict) and "float32" in weights:
            compiled.notes.append(
                f"{mb.role}: ONNX graphs keep float32 weights: {weights['float32']}"
            )
        elif isinstance(weights, dict):
            n = len(weights["quantized"])
            compiled.notes.append(
                f"{mb.role}: ONNX graphs: {n} ops with quantized weights (MatMulNBits)"
            )


def _write_weights(
    tmp: Path, pt2: Path, plan: _Models, compiled: _Compiled, device: str
) -> tuple[list[dict[str, Any]], int]:
    """Each rank's weights file per model, holding the constants the compiled graphs bind;
    returns the manifest's per-rank entries and the bytes written."""
    package = pt2.relative_to(tmp).as_posix()
    ranks: list[dict[str, Any]] = [{"package": package, "weights": {}} for _ in range(plan.world)]
    weight_bytes = 0
    for mb in plan.models:
        entry = compiled.entries[mb.role]
        names = bound_constant_names(
            pt2, [g["package_model"] for g in entry["graphs"].values()], device
        )
        weights_file = f"{mb.role}.safetensors"
        for rank, sources in enumerate(compiled.sources[mb.role]):
            missing = names - set(sources)
            if missing:
                raise RuntimeError(f"compiled graph needs constants not found: {sorted(missing)}")
            (tmp / f"rank{rank}").mkdir(exist_ok=True)
            aliases, nbytes = save_constants(
                tmp / f"rank{rank}" / weights_file, {n: sources[n] for n in names}
            )
            ranks[rank]["weights"][mb.role] = {
                "file": f"rank{rank}/{weights_file}",
                "aliases": aliases,
                # Read a row per token (embedding and position tables): `aotgen bench`'s bytes.
                "read_by_row": sorted(names & compiled.read_by_row[mb.role]),
            }
            weight_bytes += nbytes
        entry["weights"] = ranks[0]["weights"][mb.role]
    return ranks, weight_bytes


def _tokenizer_files(inputs: BuildInputs) -> list[str]:
    names = [f.name for f in inputs.ckpt.tokenizer_files]
    if inputs.chat_template is not None and CHAT_TEMPLATE_FILE not in names:
        names.append(CHAT_TEMPLATE_FILE)
    return names


def _manifest(
    inputs: BuildInputs, plan: _Models, compiled: _Compiled, package: str, ranks: list[dict]
) -> dict[str, Any]:
    recipe = inputs.recipe
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": recipe.name,
        "aotgen_version": __version__,
        "torch_version": torch.__version__,
        "build_hash": inputs.digest,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": target_info(recipe.device),
        "recipe": recipe.to_dict(),
        "world_size": plan.world,
        "max_seq_len": recipe.max_seq_len,
        "verify_k": recipe.verify_k,
        "package": package,
        "models": compiled.entries,
        "tokenizer": {"dir": "tokenizer", "files": _tokenizer_files(inputs)},
    }
    if plan.world > 1:
        manifest["parallel"] = {
            "tensor": plan.world,
            # Baked into the compiled all_reduces: the runtime registers its group so.
            "group_name": compiled.group_name,
            "plan": {role: plan_summary(st) for role, st in plan.tp_styles.items()},
            "shared_code": "one compiled package for all ranks; weights per rank",
        }
        manifest["ranks"] = ranks
    return manifest


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _replace_dir(new: Path, out: Path) -> None:
    """Swap `new` into `out` with renames; the old package disappears only after."""
    old = old_dir(out)
    if out.exists():
        out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
