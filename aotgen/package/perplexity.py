"""What a build costs in quality: held-out perplexity of the eager float model (its KV cache
in the model's dtype) vs the compiled package (same tokens, same windows), recorded in the
manifest and the build report, so a quantized build, or one with a narrower KV cache, says
what it cost. The eager side is kept in the build cache: the quantized variants of one
checkpoint share it."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aotgen.model.llama import new_kv_cache
from aotgen.package.manifest import write_manifest
from aotgen.package.models import ModelBuild
from aotgen.recipe import Recipe

# All of heldout.txt for real BPE vocabularies (~3.5k tokens); tiny test vocabularies
# split it into ~13k, which would only make test builds slower.
HELDOUT_TOKENS = 4096


def measure_perplexity(
    root: Path,
    mb: ModelBuild,
    recipe: Recipe,
    world: int,
    manifest: dict[str, Any],
    cache: Path | None = None,
) -> tuple[dict[str, float], list[str]]:
    """For a quantized target, one with a narrower KV cache, or a recipe asking for it: the
    perplexities for the build report, and its notes; the package's manifest in `root` is
    rewritten with them. `cache`: where eager references are kept (build cache's
    `perplexity/`)."""
    if not (mb.quantizer or mb.gguf or recipe.perplexity or recipe.kv_dtype != recipe.dtype):
        return {}, []
    if world > 1:
        return {}, ["perplexity not measured: a tensor-parallel package runs only with its ranks"]
    from aotgen.runtime.quality import HELDOUT

    ref, got, tokens, kept = _perplexities(root, mb, recipe, cache)
    entry = manifest["models"][mb.role]
    (entry["quantization"] or entry)["perplexity"] = {
        "text": HELDOUT.name,
        "tokens": tokens,
        "window": recipe.max_seq_len,
        "reference": round(ref, 4),
        "package": round(got, 4),
    }
    write_manifest(root, manifest)
    note = (
        f"{mb.role}: perplexity on {HELDOUT.name} ({tokens} tokens): {recipe.dtype} eager "
        f"{ref:.3f}{' (from the build cache)' if kept else ''}, "
        f"{'quantized ' if mb.quantizer or mb.gguf else ''}package {got:.3f} "
        f"({100 * (got / ref - 1):+.2f}%"
        + (f", {recipe.kv_dtype} KV cache)" if recipe.kv_dtype != recipe.dtype else ")")
    )
    return {"reference": ref, "package": got}, [note]


def _perplexities(
    root: Path, mb: ModelBuild, recipe: Recipe, cache: Path | None
) -> tuple[float, float, int, bool]:
    """The eager model's and the package's perplexity, the number of tokens, and whether the
    eager one came from `cache`."""
    from aotgen.runtime.engine import Engine
    from aotgen.runtime.quality import cross_entropy, heldout_ids

    engine = Engine.load(root, verify=False)
    ids = heldout_ids(engine.tokenizer)[:HELDOUT_TOKENS]
    ref, kept = _reference_cross_entropy(mb, recipe, ids, cache)
    got = math.exp(cross_entropy(engine, ids))
    del engine
    return math.exp(ref), got, len(ids), kept


def _reference_cross_entropy(
    mb: ModelBuild, recipe: Recipe, ids: list[int], cache: Path | None
) -> tuple[float, bool]:
    """The eager model's cross-entropy on `ids`, and whether it came from `cache`, where it is
    kept for the same weights, code and tokens (the eager float model of an int8, an int4 and
    a GGUF-blocks build of one checkpoint is one model)."""
    from aotgen.runtime.quality import cross_entropy_of

    path = cache / f"{_reference_key(mb, recipe, ids)}.json" if cache else None
    if path is not None and (kept := _read_reference(path)) is not None:
        return kept, True
    device = recipe.device
    kv = new_kv_cache(mb.config, recipe.cache_len, getattr(torch, recipe.dtype), device)

    @torch.no_grad()
    def eager(chunk: list[int]) -> Tensor:
        tokens = torch.tensor([chunk], device=device)
        return mb.model(tokens, torch.arange(len(chunk), device=device), kv)[0].cpu()

    value = cross_entropy_of(eager, ids, recipe.max_seq_len)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"cross_entropy": value, "tokens": len(ids)}))
        tmp.replace(path)  # whole or absent for a concurrent build
    return value, False


def _read_reference(path: Path) -> float | None:
    """A kept cross-entropy, or None where there is none (or it is unreadable: measure it)."""
    try:
        return float(json.loads(path.read_text())["cross_entropy"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _reference_key(mb: ModelBuild, recipe: Recipe, ids: list[int]) -> str:
    """Everything the eager measurement depends on: the model's tensors (names, dtypes,
    shapes, bytes) and config, the cache length, window, device, the tokens, torch and
    aotgen's own source."""
    h = hashlib.sha256()
    for name, t in mb.model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    parts = (repr(mb.config), recipe.cache_len, recipe.max_seq_len, recipe.device, ids)
    h.update(repr((parts, torch.__version__, _source_digest())).encode())
    return h.hexdigest()


def _source_digest() -> str:
    """aotgen's Python and C++ sources: a changed model or kernel measures again."""
    package = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(package.rglob("*")):
        if f.suffix in (".py", ".cpp", ".h"):
            h.update(f.relative_to(package).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()
