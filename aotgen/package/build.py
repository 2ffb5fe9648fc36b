"""recipe → package: the build pipeline, one stage after the other.

    checkpoint → model → (module passes) → export → (graph passes) → AOTInductor → package

Everything is written into a temporary directory next to the target and renamed into
place at the end, so an interrupted or failed build never leaves a half-written package.
A content hash of (checkpoint, recipe, aotgen, torch, ISA) makes an unchanged rebuild a
no-op.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor
from torch.export import ExportedProgram

from aotgen import __version__
from aotgen.checkpoint.hf import Checkpoint, open_checkpoint
from aotgen.export.aoti import (
    GraphSpec,
    compile_graph,
    constant_sources,
    example_inputs,
    export_graph,
    graph_specs,
    package_graphs,
    use_cache_dir,
)
from aotgen.model.llama import ModelConfig, Transformer, load_model, new_kv_cache
from aotgen.package.manifest import (
    FORMAT_VERSION,
    PackageError,
    read_manifest,
    sha256_file,
    target_info,
    verify_files,
    write_manifest,
)
from aotgen.recipe import Project, Recipe, RecipeError

PACKAGE_FILE = "model.pt2"


class BuildProgress:
    """Progress hooks; the CLI subclasses this with rich progress bars."""

    def stage(self, name: str, total: int) -> None: ...

    def advance(self, name: str, detail: str = "") -> None: ...


@dataclass
class GraphReport:
    model: str
    graph: str
    export_s: float
    compile_s: float
    so_bytes: int


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


def build_hash(ckpt: Checkpoint, recipe: Recipe) -> str:
    """Identity of a build: same inputs and toolchain → same package."""
    h = hashlib.sha256()
    ckpts = [ckpt]
    draft = (recipe.speculative or {}).get("draft") or {}
    if "checkpoint" in draft:
        ckpts.append(open_checkpoint(draft["checkpoint"]))
    files = [
        f for c in ckpts for f in (c.path / "config.json", *c.weight_files, *c.tokenizer_files)
    ]
    for f in files:
        h.update(f"{f.name}:{sha256_file(f)}\n".encode())
    recipe_dict = recipe.to_dict()
    recipe_dict.pop("checkpoint")  # the content counts, not where it lies
    if "checkpoint" in draft:
        recipe_dict["speculative"] = {**recipe_dict["speculative"], "draft": "checkpoint"}
    h.update(json.dumps(recipe_dict, sort_keys=True, default=str).encode())
    h.update(f"{__version__}|{torch.__version__}|{json.dumps(target_info())}".encode())
    return h.hexdigest()


def _up_to_date(out: Path, digest: str) -> bool:
    try:
        manifest = read_manifest(out)
        if manifest.get("build_hash") != digest:
            return False
        verify_files(manifest, out)
        return True
    except (PackageError, KeyError, OSError):
        return False


def graph_signature(spec: GraphSpec, cfg: ModelConfig, cache: list[Tensor]) -> dict[str, Any]:
    t: Any = "T" if spec.dynamic else spec.min_tokens
    return {
        "tokens": {"min": spec.min_tokens, "max": spec.max_tokens},
        "inputs": [
            {"name": "tokens", "shape": [1, t], "dtype": "int64"},
            {"name": "input_pos", "shape": [t], "dtype": "int64"},
            {
                "name": "kv_caches",
                "count": len(cache),
                "shape": list(cache[0].shape),
                "dtype": str(cache[0].dtype).removeprefix("torch."),
            },
        ],
        "outputs": [{"name": "logits", "shape": [1, t, cfg.vocab_size], "dtype": "float32"}],
    }


def _save_constants(path: Path, tensors: dict[str, Tensor]) -> tuple[dict[str, str], int]:
    """Write each distinct tensor once; names that share storage become aliases."""
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    by_storage: dict[tuple, str] = {}
    for name in sorted(tensors):
        t = tensors[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in by_storage:
            aliases[name] = by_storage[key]
        else:
            by_storage[key] = name
            unique[name] = t.contiguous()
    save_file(unique, str(path))
    return aliases, sum(t.numel() * t.element_size() for t in unique.values())


@dataclass
class ModelBuild:
    """One model of the package (the target, or a draft) ready to export."""

    role: str
    model: Transformer
    config: ModelConfig
    graphs: list[GraphSpec]
    # ExportedProgram -> ExportedProgram transforms, applied to each graph in order.
    graph_passes: list[Callable[[ExportedProgram], ExportedProgram]] = field(default_factory=list)


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def _same_vocab(a: Checkpoint, b: Checkpoint) -> None:
    """Draft and target must tokenize identically, or verification compares nonsense."""
    va = json.loads((a.path / "tokenizer.json").read_text())["model"]["vocab"]
    vb = json.loads((b.path / "tokenizer.json").read_text())["model"]["vocab"]
    if va != vb:
        raise RecipeError(
            f"draft checkpoint {b.path} has a different vocabulary from the target {a.path} "
            f"({len(vb)} vs {len(va)} tokens, or different ids): speculative decoding needs "
            "the same tokenizer"
        )


def _quantize_passes(options: dict | None) -> list[Callable[[ExportedProgram], ExportedProgram]]:
    if not options:
        return []
    from aotgen.passes.quantize import quantize_passes

    return quantize_passes(options)


def prepare_models(recipe: Recipe, ckpt: Checkpoint) -> list[ModelBuild]:
    """checkpoint → model(s): the target, plus the draft when the recipe speculates."""
    cfg = ModelConfig.from_hf(ckpt.config)
    weights = ckpt.load_weights()
    dtype = getattr(torch, recipe.dtype)
    graphs = graph_specs(recipe.prefill_chunk, recipe.verify_k)
    models = [
        ModelBuild(
            "target",
            load_model(cfg, weights, recipe.cache_len, dtype),
            cfg,
            graphs,
            _quantize_passes(recipe.quantize),
        )
    ]
    draft = (recipe.speculative or {}).get("draft")
    if draft:
        draft_graphs = [g for g in graphs if g.name != "verify"]  # the draft never verifies
        passes: list = []
        if "checkpoint" in draft:
            dckpt = open_checkpoint(draft["checkpoint"])
            _same_vocab(ckpt, dckpt)
            dcfg, dweights = ModelConfig.from_hf(dckpt.config), dckpt.load_weights()
        elif "layers" in draft:
            n = draft["layers"]
            if n >= cfg.num_hidden_layers:
                raise RecipeError(
                    f"draft layers={n} must be fewer than the target's {cfg.num_hidden_layers}"
                )
            # Self-speculation: the target's first n layers with its final norm and head.
            dcfg = dataclasses.replace(cfg, num_hidden_layers=n)
            dweights = {k: v for k, v in weights.items() if (_layer_index(k) or 0) < n}
        else:
            dcfg, dweights = cfg, weights
            passes = _quantize_passes(draft["quantize"])
        models.append(
            ModelBuild(
                "draft",
                load_model(dcfg, dweights, recipe.cache_len, dtype),
                dcfg,
                draft_graphs,
                passes,
            )
        )
    return models


def _compile_model(
    mb: ModelBuild, recipe: Recipe, progress: BuildProgress, report: BuildReport
) -> tuple[dict[str, list[str]], dict[str, Tensor], dict[str, Any]]:
    cache = new_kv_cache(mb.config, recipe.cache_len, dtype=getattr(torch, recipe.dtype))
    files: dict[str, list[str]] = {}
    sources: dict[str, Tensor] = {}
    signatures: dict[str, Any] = {}
    for spec in mb.graphs:
        t0 = time.perf_counter()
        ep = export_graph(mb.model, spec, cache)
        for graph_pass in mb.graph_passes:
            ep = graph_pass(ep)
        t1 = time.perf_counter()
        progress.advance("export", f"{mb.role}/{spec.name}")
        graph_files = compile_graph(ep, example_inputs(spec, cache), recipe.compile.max_autotune)
        t2 = time.perf_counter()
        progress.advance("compile", f"{mb.role}/{spec.name}")
        key = f"{mb.role}_{spec.name}"
        files[key] = graph_files
        sources.update(constant_sources(ep))
        signatures[spec.name] = {"package_model": key, **graph_signature(spec, mb.config, cache)}
        so_bytes = sum(os.path.getsize(f) for f in graph_files if f.endswith(".so"))
        report.graphs.append(GraphReport(mb.role, spec.name, t1 - t0, t2 - t1, so_bytes))
    return files, sources, signatures


def _bound_constant_names(pt2: Path, package_models: list[str]) -> set[str]:
    """The constant names the compiled graphs will ask the runtime to bind."""
    from torch._inductor.package import load_package

    names: set[str] = set()
    for key in package_models:
        names.update(load_package(str(pt2), key).loader.get_constant_fqns())
    return names


def build(
    recipe: Recipe,
    project: Project,
    progress: BuildProgress | None = None,
    force: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> BuildReport:
    """Build `recipe` into `project.artifacts_dir / recipe.name`."""
    progress = progress or BuildProgress()
    t_start = time.perf_counter()
    out = project.artifacts_dir / recipe.name
    report = BuildReport(recipe.name, out)
    ckpt = open_checkpoint(recipe.checkpoint)
    digest = build_hash(ckpt, recipe)
    if not force and _up_to_date(out, digest):
        report.up_to_date = True
        report.package_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        return report

    use_cache_dir(project.cache_dir)
    if project.threads:
        torch.set_num_threads(project.threads)
    progress.stage("load", 1)
    models = prepare_models(recipe, ckpt)
    progress.advance("load", str(ckpt.path))
    n_graphs = sum(len(m.graphs) for m in models)
    progress.stage("export", n_graphs)
    progress.stage("compile", n_graphs)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        rank_dir = tmp / "rank0"
        rank_dir.mkdir(parents=True)
        all_files: dict[str, list[str]] = {}
        entries: dict[str, Any] = {}
        sources_by_role: dict[str, dict[str, Tensor]] = {}
        for mb in models:
            files, sources, signatures = _compile_model(mb, recipe, progress, report)
            all_files.update(files)
            sources_by_role[mb.role] = sources
            entries[mb.role] = {
                "config": {**mb.config.__dict__, "extra": None},
                "graphs": signatures,
                "kv_cache": {
                    "layout": "per-layer [k0, v0, k1, v1, ...], each [1, kv_heads, cache_len, "
                    "head_dim], written in place at input_pos",
                    "layers": mb.config.num_hidden_layers,
                    "shape": [
                        1,
                        mb.config.num_key_value_heads,
                        recipe.cache_len,
                        mb.config.head_dim,
                    ],
                    "dtype": recipe.dtype,
                    "cache_len": recipe.cache_len,
                },
            }
        package_graphs(rank_dir / PACKAGE_FILE, all_files)
        for mb in models:
            entry = entries[mb.role]
            names = _bound_constant_names(
                rank_dir / PACKAGE_FILE, [g["package_model"] for g in entry["graphs"].values()]
            )
            missing = names - set(sources_by_role[mb.role])
            if missing:
                raise RuntimeError(f"compiled graph needs constants not found: {sorted(missing)}")
            weights_file = f"{mb.role}.safetensors"
            aliases, nbytes = _save_constants(
                rank_dir / weights_file, {n: sources_by_role[mb.role][n] for n in names}
            )
            entry["weights"] = {"file": f"rank0/{weights_file}", "aliases": aliases}
            report.weight_bytes += nbytes
        tok_dir = tmp / "tokenizer"
        tok_dir.mkdir()
        for f in ckpt.tokenizer_files:
            shutil.copy2(f, tok_dir / f.name)
        manifest = {
            "format_version": FORMAT_VERSION,
            "name": recipe.name,
            "aotgen_version": __version__,
            "torch_version": torch.__version__,
            "build_hash": digest,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "target": target_info(),
            "recipe": recipe.to_dict(),
            "world_size": 1,
            "max_seq_len": recipe.max_seq_len,
            "verify_k": recipe.verify_k,
            "package": f"rank0/{PACKAGE_FILE}",
            "models": entries,
            "tokenizer": {"dir": "tokenizer", "files": [f.name for f in ckpt.tokenizer_files]},
        }
        write_manifest(tmp, manifest)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report.package_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    report.seconds = time.perf_counter() - t_start
    return report


def _replace_dir(new: Path, out: Path) -> None:
    """Swap `new` into `out` with renames; the old package disappears only after."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
