"""What a build costs in quality: held-out perplexity of the eager float model (its KV cache
in the model's dtype) vs the compiled package (same tokens, same windows), recorded in the
manifest and the build report, so a quantized build, or one with a narrower KV cache, says
what it cost."""

from __future__ import annotations

import math
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
    root: Path, mb: ModelBuild, recipe: Recipe, world: int, manifest: dict[str, Any]
) -> tuple[dict[str, float], list[str]]:
    """For a quantized target, one with a narrower KV cache, or a recipe asking for it: the
    perplexities for the build report, and its notes; the package's manifest in `root` is
    rewritten with them."""
    if not (mb.quantizer or mb.gguf or recipe.perplexity or recipe.kv_dtype != recipe.dtype):
        return {}, []
    if world > 1:
        return {}, ["perplexity not measured: a tensor-parallel package runs only with its ranks"]
    from aotgen.runtime.quality import HELDOUT

    ref, got, tokens = _perplexities(root, mb, recipe)
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
        f"{ref:.3f}, {'quantized ' if mb.quantizer or mb.gguf else ''}package {got:.3f} "
        f"({100 * (got / ref - 1):+.2f}%"
        + (f", {recipe.kv_dtype} KV cache)" if recipe.kv_dtype != recipe.dtype else ")")
    )
    return {"reference": ref, "package": got}, [note]


def _perplexities(root: Path, mb: ModelBuild, recipe: Recipe) -> tuple[float, float, int]:
    """The eager model's and the package's perplexity, and the number of tokens."""
    from aotgen.runtime.engine import Engine
    from aotgen.runtime.quality import cross_entropy, cross_entropy_of, heldout_ids

    engine = Engine.load(root, verify=False)
    ids = heldout_ids(engine.tokenizer)[:HELDOUT_TOKENS]
    device = recipe.device
    cache = new_kv_cache(mb.config, recipe.cache_len, getattr(torch, recipe.dtype), device)

    @torch.no_grad()
    def eager(chunk: list[int]) -> Tensor:
        tokens = torch.tensor([chunk], device=device)
        return mb.model(tokens, torch.arange(len(chunk), device=device), cache)[0].cpu()

    ref = math.exp(cross_entropy_of(eager, ids, recipe.max_seq_len))
    got = math.exp(cross_entropy(engine, ids))
    del engine
    return ref, got, len(ids)
