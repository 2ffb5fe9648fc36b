"""The config keys of the multi-head latent attention families (DeepSeek-V2 / V3,
GLM-4.7-Flash, Youtu-LLM, MiniCPM3; model/mla.py): each family's defaults, as
transformers' config classes hold them, and the attention's fields."""

from __future__ import annotations

import math
from typing import Any

from aotgen.model.config import DEEPSEEK_V2, DEEPSEEK_V3, GLM4_MOE_LITE, MINICPM3, YOUTU

_ATTENTION = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64)
# transformers writes only the keys that differ from its config class's defaults: these are
# the ones the model reads.
DEFAULTS: dict[str, dict[str, Any]] = {
    DEEPSEEK_V2: dict(
        **_ATTENTION,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        moe_intermediate_size=1407,
        routed_scaling_factor=1.0,
        first_k_dense_replace=0,
        topk_method="greedy",
        norm_topk_prob=False,
    ),
    DEEPSEEK_V3: dict(
        **_ATTENTION,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        norm_topk_prob=True,
    ),
    GLM4_MOE_LITE: dict(
        _ATTENTION,
        q_lora_rank=768,
        qk_nope_head_dim=192,
        v_head_dim=256,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=4,
        moe_intermediate_size=1536,
        routed_scaling_factor=1.8,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
    ),
    YOUTU: dict(**_ATTENTION, v_head_dim=128, tie_word_embeddings=True),
    MINICPM3: dict(
        q_lora_rank=768,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        tie_word_embeddings=True,
        scale_emb=12,
        scale_depth=1.4,
        dim_model_base=256,
    ),
}


def with_defaults(hf: dict, arch: str) -> dict:
    """`hf` over its family's defaults; GLM-4.7-Flash's dense layer 0 and sparse others
    where it names no `mlp_layer_types` (transformers' default, `first_k_dense_replace`
    unread)."""
    out = {**DEFAULTS[arch], **hf}
    if arch == GLM4_MOE_LITE and not out.get("mlp_layer_types"):
        out["mlp_layer_types"] = ["dense"] + ["sparse"] * (hf["num_hidden_layers"] - 1)
    if arch == MINICPM3 and out.get("v_head_dim") is None:
        out["v_head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    return out


def latent_fields(hf: dict, arch: str, scaling: dict | None) -> dict[str, Any]:
    """`ModelConfig`'s fields of the latent attention: the cache row (latent and shared key)
    as one KV head of `head_dim`, the rotated dims, and the softmax scale, YaRN's
    `mscale_all_dim` squared on it as transformers applies it."""
    dims = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for key in dims:
        if isinstance(hf.get(key), bool) or not isinstance(hf.get(key), int) or hf[key] <= 0:
            raise ValueError(f"config.json: {key} must be a positive integer, got {hf.get(key)!r}")
    rank, nope, rope = hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    if rope % 2:
        raise ValueError(f"config.json: qk_rope_head_dim={rope} must be even")
    scale = (nope + rope) ** -0.5
    all_dims = (scaling or {}).get("mscale_all_dim")
    if scaling and all_dims:
        factor = scaling.get("factor") or 1.0
        gain = 1.0 if factor <= 1 else 0.1 * all_dims * math.log(factor) + 1.0
        scale *= gain * gain
    bias = bool(hf.get("attention_bias", False))
    return dict(
        num_key_value_heads=1,
        head_dim=rank + rope,
        rotary_dim=rope,
        kv_lora_rank=rank,
        q_lora_rank=hf.get("q_lora_rank") or 0,
        qk_nope_head_dim=nope,
        v_head_dim=hf["v_head_dim"],
        attention_multiplier=scale,
        attention_bias=bias,
        attention_out_bias=bias,
        # DeepSeek rotates adjacent pairs (V2 always, the others by `rope_interleave`).
        interleaved_rope=arch == DEEPSEEK_V2
        or (arch != MINICPM3 and bool(hf.get("rope_interleave", True))),
        **(_minicpm3_multipliers(hf) if arch == MINICPM3 else {}),
    )


def _minicpm3_multipliers(hf: dict) -> dict[str, float]:
    """MiniCPM3's scalings as Granite's multipliers: embeddings × `scale_emb`, each block's
    output × `scale_depth / √layers`, the last hidden state (so the logits) ÷ `hidden_size /
    dim_model_base`; None where given makes each a no-op, as transformers reads it."""
    layers, hidden = hf["num_hidden_layers"], hf["hidden_size"]
    depth = hf.get("scale_depth")
    base = hf.get("dim_model_base") or hidden
    return dict(
        embedding_multiplier=float(hf.get("scale_emb", 12)),
        residual_multiplier=1.0 if depth is None else depth / math.sqrt(layers),
        logits_scaling=hidden / base,
    )
