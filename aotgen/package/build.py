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
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram

from aotgen import __version__
from aotgen.checkpoint.gguf import import_gguf
from aotgen.checkpoint.hf import Checkpoint, CheckpointError, open_checkpoint
from aotgen.export.aoti import (
    GraphSpec,
    compile_graph,
    constant_sources,
    example_inputs,
    export_graph,
    graph_identity,
    graph_specs,
    package_graphs,
    use_cache_dir,
)
from aotgen.model.llama import ModelConfig, Transformer, load_model, new_kv_cache
from aotgen.package.manifest import (
    FORMAT_VERSION,
    PackageError,
    cuda_problem,
    read_manifest,
    sha256_chunks,
    target_info,
    verify_files,
    write_manifest,
)
from aotgen.package.weights import save_aligned
from aotgen.passes.fuse import FuseLinearsPass
from aotgen.passes.gemv import linears_as_reductions
from aotgen.passes.quantize import QuantizePass, quantize_passes
from aotgen.passes.quantize_options import parse_quantize
from aotgen.passes.tp import (
    fake_process_group,
    parse_parallel,
    plan_summary,
    rank_config,
    resolve_plan,
    shard_model,
)
from aotgen.recipe import Project, Recipe, RecipeError
from aotgen.runtime.tokenizer import Tokenizer
from aotgen.tempdirs import old_dir, partial_dir, remove_stale, sigterm_raises

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
    cached: bool = False  # the compile came from the project cache


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
        h.update(f"{f.name}:{sha256_chunks(f)}\n".encode())
    recipe_dict = recipe.to_dict()
    recipe_dict.pop("checkpoint")  # the content counts, not where it lies
    if "checkpoint" in draft:
        recipe_dict["speculative"]["draft"] = {**draft, "checkpoint": "(content hashed above)"}
    h.update(json.dumps(recipe_dict, sort_keys=True, default=str).encode())
    for quantize in (recipe.quantize, draft.get("quantize")):
        options = parse_quantize(quantize)
        if options and options.method == "gptq":
            h.update(f"calibration:{sha256_chunks(options.calibration)}\n".encode())
    target = json.dumps(target_info(recipe.device))
    h.update(f"{__version__}|{torch.__version__}|{target}".encode())
    # The source itself, not just the version: a changed pass or kernel must not look
    # "up to date".
    root = Path(__file__).resolve().parents[1]
    for src in sorted([*root.rglob("*.py"), *root.rglob("kernels/*.cpp")]):
        h.update(src.read_bytes())
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
            unique[name] = t.contiguous().cpu()
    save_aligned(unique, path)
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
    parts = name.split(".")  # model.layers.N.… (Llama layout), gpt_neox.layers.N.…
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


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


def graph_passes(
    recipe: Recipe, quantize: dict[str, Any] | None
) -> list[Callable[[ExportedProgram], ExportedProgram]]:
    """One model's passes, in order: fuse linears (unless a quantize pattern names them
    apart), then quantize."""
    passes: list[Callable[[ExportedProgram], ExportedProgram]] = []
    quantizers = quantize_passes(quantize, recipe.device)
    if recipe.compile.fuse_linears:
        o = quantizers[0].options if quantizers else None
        exclude = (*o.skip, *(p for p, _ in o.overrides)) if o else ()
        passes.append(FuseLinearsPass(exclude))
    return passes + quantizers


def prepare_models(recipe: Recipe, ckpt: Checkpoint) -> list[ModelBuild]:
    """checkpoint → model(s): the target, plus the draft when the recipe speculates."""
    cfg = ModelConfig.from_hf(ckpt.config)
    weights = ckpt.load_weights()
    dtype = getattr(torch, recipe.dtype)
    graphs = graph_specs(recipe.prefill_chunk, recipe.verify_k)
    models = [
        ModelBuild(
            "target",
            load_model(cfg, weights, recipe.cache_len, dtype).to(recipe.device),
            cfg,
            graphs,
            graph_passes(recipe, recipe.quantize),
        )
    ]
    draft = (recipe.speculative or {}).get("draft")
    if draft:
        # The draft never verifies; on the target's cache it never prefills either.
        skip = ("verify", "prefill") if recipe.speculative.get("share_kv") else ("verify",)
        draft_graphs = [g for g in graphs if g.name not in skip]
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
        models.append(
            ModelBuild(
                "draft",
                load_model(dcfg, dweights, recipe.cache_len, dtype).to(recipe.device),
                dcfg,
                draft_graphs,
                graph_passes(recipe, draft.get("quantize")),
            )
        )
    return models


def _gguf_imported(path: Path, cache_dir: Path) -> Path:
    """A GGUF checkpoint's HF-layout dir (`aotgen import-gguf`), imported once per file
    content into the project cache; any other path is returned as is."""
    if path.suffix != ".gguf":
        return path
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    digest = hashlib.sha256("".join(sha256_chunks(path)).encode()).hexdigest()[:16]
    out = Path(cache_dir) / "gguf" / f"{path.stem}-{digest}"
    if not (out / "config.json").is_file():  # import_gguf renames a complete dir into place
        import_gguf(path, out, overwrite=True)
    return out


def _with_imported_checkpoints(recipe: Recipe, cache_dir: Path) -> Recipe:
    """The recipe with GGUF checkpoints (target, draft) replaced by their imported dirs."""
    spec = recipe.speculative
    draft = (spec or {}).get("draft") or {}
    if "checkpoint" in draft:
        imported = _gguf_imported(Path(draft["checkpoint"]), cache_dir)
        spec = {**spec, "draft": {**draft, "checkpoint": str(imported)}}
    checkpoint = _gguf_imported(recipe.checkpoint, cache_dir)
    return dataclasses.replace(recipe, checkpoint=checkpoint, speculative=spec)


def _new_cache(cfg: ModelConfig, recipe: Recipe) -> list[Tensor]:
    return new_kv_cache(cfg, recipe.cache_len, getattr(torch, recipe.dtype), recipe.device)


CALIBRATION_MAX_TOKENS = 16384


def _calibrate(mb: ModelBuild, recipe: Recipe, tokenizer: Tokenizer) -> None:
    """GPTQ's calibration: run the model's prefill graph, after the passes that precede
    quantization (so the weights are the tensors the graphs will hold), over the
    calibration text in prefill-sized chunks, each from position 0."""
    quantizer = _quantizer(mb)
    spec = next(g for g in graph_specs(recipe.prefill_chunk, recipe.verify_k) if g.dynamic)
    cache = _new_cache(mb.config, recipe)
    ep = export_graph(mb.model, spec, cache)
    for graph_pass in mb.graph_passes[: mb.graph_passes.index(quantizer)]:
        ep = graph_pass(ep)
    text = quantizer.options.calibration
    ids = tokenizer.encode(text.read_text())[:CALIBRATION_MAX_TOKENS]
    chunks = [ids[i : i + spec.max_tokens] for i in range(0, len(ids), spec.max_tokens)]
    chunks = [c for c in chunks if len(c) >= spec.min_tokens]
    if not chunks:
        raise RecipeError(
            f"quantize.calibration: {text} holds {len(ids)} tokens; GPTQ needs text, "
            "ideally thousands of tokens"
        )
    device = recipe.device
    batches = [
        (torch.tensor([c], device=device), torch.arange(len(c), device=device), cache)
        for c in chunks
    ]
    quantizer.calibrate(ep, batches, sum(map(len, chunks)))


def _compile_model(
    mb: ModelBuild,
    recipe: Recipe,
    progress: BuildProgress,
    report: BuildReport,
    compile_cache: Path,
    ranks: list[nn.Module] | None = None,
    rank_cfg: ModelConfig | None = None,
) -> tuple[dict[str, list[str]], list[dict[str, Tensor]], dict[str, Any]]:
    """Export and compile each graph (or take the compile from `compile_cache`); returns
    files, constants per rank, signatures.

    Tensor parallel: `ranks` are the per-rank shards. Each rank is exported (cheaper than
    a compile), but only rank 0 is compiled: the ranks' graphs are identical but for the
    values of their constants (checked here), so one compiled graph serves every rank.
    """
    ranks = ranks or [mb.model]
    cache = _new_cache(rank_cfg or mb.config, recipe)
    # The reduction rewrite is a CPU tuning (passes/gemv.py); GPUs keep their GEMM kernels.
    reductions = recipe.compile.few_token_linears == "reduction" and recipe.device == "cpu"
    files: dict[str, list[str]] = {}
    sources: list[dict[str, Tensor]] = [{} for _ in ranks]
    signatures: dict[str, Any] = {}
    for spec in mb.graphs:
        t0 = time.perf_counter()
        eps = []
        for model in ranks:
            ep = export_graph(model, spec, cache)
            for graph_pass in mb.graph_passes:
                ep = graph_pass(ep)
            if not spec.dynamic and reductions:
                ep = linears_as_reductions(ep)
            eps.append(ep)
        _check_same_code(eps, f"{mb.role}/{spec.name}")
        ep = eps[0]
        t1 = time.perf_counter()
        progress.advance("export", f"{mb.role}/{spec.name}")
        graph_files, cached = compile_graph(
            ep, example_inputs(spec, cache), recipe.compile.max_autotune, compile_cache
        )
        t2 = time.perf_counter()
        progress.advance("compile", f"{mb.role}/{spec.name}{' (cached)' if cached else ''}")
        key = f"{mb.role}_{spec.name}"
        files[key] = graph_files
        for rank_sources, rank_ep in zip(sources, eps, strict=True):
            rank_sources.update(constant_sources(rank_ep))
        signatures[spec.name] = {"package_model": key, **graph_signature(spec, mb.config, cache)}
        so_bytes = sum(os.path.getsize(f) for f in graph_files if f.endswith(".so"))
        report.graphs.append(GraphReport(mb.role, spec.name, t1 - t0, t2 - t1, so_bytes, cached))
    return files, sources, signatures


def _compile_sharded(
    mb: ModelBuild,
    recipe: Recipe,
    progress: BuildProgress,
    report: BuildReport,
    compile_cache: Path,
    styles: dict[str, str],
    world: int,
) -> tuple[dict[str, list[str]], list[dict[str, Tensor]], dict[str, Any], str]:
    """All ranks of one model, compiled in this process against a fake process group;
    also returns the group name the compiled collectives refer to."""
    with fake_process_group(world) as group_name:
        ranks = [shard_model(mb.model, styles, r, world, group_name) for r in range(world)]
        compiled = _compile_model(
            mb, recipe, progress, report, compile_cache, ranks, rank_config(mb.config, world)
        )
    return (*compiled, group_name)


def _cache_sharing(role: str, recipe: Recipe) -> dict[str, str]:
    """A draft made from the target's weights runs on the target's KV cache (its first
    layers): no draft prefill, no catch-up step. The runtime checks the layouts match."""
    if role == "draft" and (recipe.speculative or {}).get("share_kv"):
        return {"shared_with": "target"}
    return {}


def _check_same_code(eps: list[ExportedProgram], where: str) -> None:
    """One compile may serve all ranks only if their graphs differ in constant values alone."""
    first = graph_identity(eps[0])
    for rank, ep in enumerate(eps[1:], start=1):
        if graph_identity(ep) != first:
            raise RuntimeError(
                f"{where}: rank {rank}'s exported graph differs from rank 0's beyond its "
                "weights, so one compiled graph cannot serve both (a sharding bug)"
            )


def _bound_constant_names(pt2: Path, package_models: list[str], device: str) -> set[str]:
    """The constant names the compiled graphs will ask the runtime to bind."""
    from aotgen.runtime.engine import open_loader

    names: set[str] = set()
    for key in package_models:
        names.update(open_loader(pt2, key, torch.device(device)).get_constant_fqns())
    return names


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


def _build(
    recipe: Recipe,
    project: Project,
    progress: BuildProgress | None,
    force: bool,
    log: Callable[[str], None],
) -> BuildReport:
    progress = progress or BuildProgress()
    t_start = time.perf_counter()
    out = project.artifacts_dir / recipe.name
    report = BuildReport(recipe.name, out)
    if recipe.device == "cuda" and (problem := cuda_problem()):
        raise RecipeError(
            f"recipe {recipe.name!r}: device cuda, but {problem}. Build on the machine class "
            "the package will run on (its kernels are compiled for that GPU), or use device: cpu"
        )
    recipe = _with_imported_checkpoints(recipe, project.cache_dir)
    ckpt = open_checkpoint(recipe.checkpoint)
    digest = build_hash(ckpt, recipe)
    if not force and _up_to_date(out, digest):
        report.up_to_date = True
        report.package_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        return report

    use_cache_dir(project.cache_dir)
    compile_cache = project.cache_dir / "graphs"
    if project.threads:
        torch.set_num_threads(project.threads)
    progress.stage("load", 1)
    models = prepare_models(recipe, ckpt)
    tp = parse_parallel(recipe.parallel)
    world = tp.world_size if tp else 1
    # Check every model's TP plan before compiling anything: a bad plan fails in seconds.
    tp_styles = {mb.role: resolve_plan(mb.model, tp) for mb in models} if world > 1 else {}
    progress.advance("load", str(ckpt.path))
    calibrated = [mb for mb in models if (q := _quantizer(mb)) and q.needs_calibration]
    if calibrated and world > 1:
        raise RecipeError(
            "quantize.method gptq does not combine with `parallel` yet (it calibrates the "
            "unsharded model); use method rtn, or build without parallel"
        )
    for mb in calibrated:
        log(f"{mb.role}: GPTQ calibration")
        _calibrate(mb, recipe, Tokenizer.from_dir(ckpt.path))
    n_graphs = sum(len(m.graphs) for m in models)
    progress.stage("export", n_graphs)
    progress.stage("compile", n_graphs)

    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale(out.parent):
        log(f"removed {stale}, left by a build that was killed")
    tmp = partial_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        rank_dir = tmp / "rank0"
        rank_dir.mkdir(parents=True)
        all_files: dict[str, list[str]] = {}
        entries: dict[str, Any] = {}
        sources_by_role: dict[str, list[dict[str, Tensor]]] = {}
        group_name = None
        for mb in models:
            if world > 1:
                files, sources, signatures, group_name = _compile_sharded(
                    mb, recipe, progress, report, compile_cache, tp_styles[mb.role], world
                )
            else:
                files, sources, signatures = _compile_model(
                    mb, recipe, progress, report, compile_cache
                )
            all_files.update(files)
            sources_by_role[mb.role] = sources
            for fuser in (p for p in mb.graph_passes if isinstance(p, FuseLinearsPass)):
                report.notes.append(f"{mb.role}: {fuser.note()}")
            quantizer = _quantizer(mb)
            if quantizer:
                report.notes.extend(f"{mb.role}: {n}" for n in quantizer.notes())
            entries[mb.role] = {
                "config": {**mb.config.__dict__, "extra": None},
                "quantization": quantizer.manifest_entry() if quantizer else None,
                "graphs": signatures,
                "kv_cache": {
                    "layout": "per-layer [k0, v0, k1, v1, ...], each [1, kv_heads, cache_len, "
                    "head_dim], written in place at input_pos",
                    "layers": mb.config.num_hidden_layers,
                    "shape": [
                        1,
                        mb.config.num_key_value_heads // world,  # per rank
                        recipe.cache_len,
                        mb.config.head_dim,
                    ],
                    "dtype": recipe.dtype,
                    "cache_len": recipe.cache_len,
                    **_cache_sharing(mb.role, recipe),
                },
            }
        # One compiled package; with TP it is shared by all ranks and lies at the top level.
        pt2 = tmp / PACKAGE_FILE if world > 1 else rank_dir / PACKAGE_FILE
        package_graphs(pt2, all_files)
        ranks: list[dict[str, Any]] = [
            {"package": pt2.relative_to(tmp).as_posix(), "weights": {}} for _ in range(world)
        ]
        for mb in models:
            entry = entries[mb.role]
            names = _bound_constant_names(
                pt2, [g["package_model"] for g in entry["graphs"].values()], recipe.device
            )
            weights_file = f"{mb.role}.safetensors"
            for rank, sources in enumerate(sources_by_role[mb.role]):
                missing = names - set(sources)
                if missing:
                    raise RuntimeError(
                        f"compiled graph needs constants not found: {sorted(missing)}"
                    )
                (tmp / f"rank{rank}").mkdir(exist_ok=True)
                aliases, nbytes = _save_constants(
                    tmp / f"rank{rank}" / weights_file, {n: sources[n] for n in names}
                )
                ranks[rank]["weights"][mb.role] = {
                    "file": f"rank{rank}/{weights_file}",
                    "aliases": aliases,
                }
                report.weight_bytes += nbytes
            entry["weights"] = ranks[0]["weights"][mb.role]
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
            "target": target_info(recipe.device),
            "recipe": recipe.to_dict(),
            "world_size": world,
            "max_seq_len": recipe.max_seq_len,
            "verify_k": recipe.verify_k,
            "package": pt2.relative_to(tmp).as_posix(),
            "models": entries,
            "tokenizer": {"dir": "tokenizer", "files": [f.name for f in ckpt.tokenizer_files]},
        }
        if world > 1:
            manifest["parallel"] = {
                "tensor": world,
                # Baked into the compiled all_reduces: the runtime registers its group so.
                "group_name": group_name,
                "plan": {role: plan_summary(st) for role, st in tp_styles.items()},
                "shared_code": "one compiled package for all ranks; weights per rank",
            }
            manifest["ranks"] = ranks
        write_manifest(tmp, manifest)
        measure = bool(_quantizer(models[0])) or recipe.perplexity
        if measure and world > 1:
            report.notes.append(
                "perplexity not measured: a tensor-parallel package runs only with its ranks"
            )
        elif measure:
            _measure_quality(tmp, models[0], recipe, manifest, report)
            write_manifest(tmp, manifest)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report.package_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    report.seconds = time.perf_counter() - t_start
    return report


# All of heldout.txt for real BPE vocabularies (~3.5k tokens); tiny test vocabularies
# split it into ~13k, which would only make test builds slower.
HELDOUT_TOKENS = 4096


def _quantizer(mb: ModelBuild) -> QuantizePass | None:
    """The model's quantization pass, if any (it reports notes and a manifest entry)."""
    return next((p for p in mb.graph_passes if isinstance(p, QuantizePass)), None)


def _measure_quality(
    root: Path, mb: ModelBuild, recipe: Recipe, manifest: dict[str, Any], report: BuildReport
) -> None:
    """Held-out perplexity of the eager float model vs the compiled package (same tokens,
    same windows), so a quantized build reports what it cost."""
    from aotgen.runtime.engine import Engine
    from aotgen.runtime.quality import HELDOUT, cross_entropy, cross_entropy_of, heldout_ids

    engine = Engine.load(root, verify=False)
    ids = heldout_ids(engine.tokenizer)[:HELDOUT_TOKENS]
    cache = _new_cache(mb.config, recipe)
    device = recipe.device

    @torch.no_grad()
    def eager(chunk: list[int]) -> Tensor:
        tokens = torch.tensor([chunk], device=device)
        return mb.model(tokens, torch.arange(len(chunk), device=device), cache)[0].cpu()

    ref = math.exp(cross_entropy_of(eager, ids, recipe.max_seq_len))
    got = math.exp(cross_entropy(engine, ids))
    del engine
    report.perplexity = {"reference": ref, "package": got}
    entry = manifest["models"][mb.role]
    (entry["quantization"] or entry)["perplexity"] = {
        "text": HELDOUT.name,
        "tokens": len(ids),
        "window": recipe.max_seq_len,
        "reference": round(ref, 4),
        "package": round(got, 4),
    }
    report.notes.append(
        f"{mb.role}: perplexity on {HELDOUT.name} ({len(ids)} tokens): {recipe.dtype} eager "
        f"{ref:.3f}, {'quantized ' if _quantizer(mb) else ''}package {got:.3f} "
        f"({100 * (got / ref - 1):+.2f}%)"
    )


def _replace_dir(new: Path, out: Path) -> None:
    """Swap `new` into `out` with renames; the old package disappears only after."""
    old = old_dir(out)
    if out.exists():
        out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
