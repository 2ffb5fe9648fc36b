"""Ministral 3 GGUFs (`mistral3`, llama.cpp's src/models/mistral3.cpp) as the HF config of the
same model: YaRN as llama.cpp reads it, and q's growth with the position past each original
context (`attention.temperature_scale`, transformers' `llama_4_scaling_beta`)."""

from __future__ import annotations

from typing import Any

import gguf

from aotgen.checkpoint.gguf_meta import f32, meta_value, require_meta, require_whole_heads
from aotgen.checkpoint.hf import CheckpointError

ROPE = gguf.Keys.Rope


def mistral3_rope(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """`rope_parameters` (5.x keys: Ministral 3's config reads its temperature there).

    YaRN's ramp bounds are read where stored, else ggml's 32 and 1; `yarn_log_mul` is
    transformers' `mscale_all_dim` with `mscale` 1 (llama-context.cpp assumes it), so cos and
    sin are scaled by mscale(factor, 1) / mscale(factor, log_mul), or mscale(factor, 1) without
    it, as transformers computes. Without a temperature the model is Mistral's."""
    require_whole_heads(reader, arch, config["head_dim"], "Ministral 3")
    scaling = config.pop("rope_scaling", None) or {"rope_type": "default"}
    params: dict[str, Any] = {**scaling, "rope_theta": config.pop("rope_theta")}
    if scaling["rope_type"] == "yarn":
        if "original_max_position_embeddings" not in scaling:
            require_meta(reader, f"{arch}.rope.scaling.original_context_length")
        params.update(
            beta_fast=f32(meta_value(reader, ROPE.SCALING_YARN_BETA_FAST.format(arch=arch), 32.0)),
            beta_slow=f32(meta_value(reader, ROPE.SCALING_YARN_BETA_SLOW.format(arch=arch), 1.0)),
            truncate=True,
        )
        if log_mul := meta_value(reader, ROPE.SCALING_YARN_LOG_MUL.format(arch=arch)):
            params.update(mscale=1.0, mscale_all_dim=f32(log_mul))
    elif scaling["rope_type"] not in ("default", "linear"):
        raise CheckpointError(
            f"GGUF {arch}.rope.scaling.type {scaling['rope_type']!r} is not supported on "
            "Ministral 3 (none, linear or yarn)"
        )
    beta = f32(meta_value(reader, gguf.Keys.Attention.TEMPERATURE_SCALE.format(arch=arch), 0.0))
    if not beta:
        mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
        return {**mistral, "rope_parameters": params}
    if "original_max_position_embeddings" not in params:
        raise CheckpointError(
            f"GGUF {arch}.attention.temperature_scale needs YaRN's original context "
            f"({arch}.rope.scaling.original_context_length), as llama.cpp does"
        )
    return {"rope_parameters": {**params, "llama_4_scaling_beta": beta}}
