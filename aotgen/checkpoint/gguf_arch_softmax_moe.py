"""Mixtures of experts whose router llama.cpp fixes in its graph, softmax probabilities with
the chosen ones renormalised, whatever the file stores: `ernie4_5-moe` (ERNIE 4.5 MoE),
`hunyuan-moe` (Hunyuan-A13B) and `mellum` (Mellum's mixture of experts).

ERNIE 4.5 MoE (src/models/ernie4-5-moe.cpp): ERNIE 4.5's attention (RoPE on adjacent pairs,
q/k as HF has them), dense blocks before `leading_dense_block_count`, experts picked by
probability plus `exp_probs_b` and one ungated shared MLP `expert_shared_feed_forward_length`
wide (its converter writes intermediate_size / KV heads there: equal to the shared experts'
width in the released 21B-A3B), experts on every block after the dense ones (llama.cpp loads
no other layout).

Hunyuan-A13B (src/models/hunyuan-moe.cpp): q/k norms after RoPE (halves), every block its
experts and one ungated shared MLP, both `feed_forward_length` wide; the converter stores the
NTK-alpha-stretched RoPE base itself.

Mellum (src/models/mellum.cpp): Qwen3-MoE's blocks, experts on every one; windowed blocks by
`sliding_window_pattern` (a flag per block, or a period: 4 where none is stored) where a
window is stored, rotated at the full-attention base (`freq_base_swa` is not used) without
scaling; the others with the stored YaRN, whose attention gain llama.cpp computes itself
(1 + 0.1 ln factor) and whose ramp ends it floors and ceils (betas 32 and 1).
"""

from __future__ import annotations

import math
from typing import Any

import gguf

from aotgen.checkpoint.gguf_arch_deepseek2 import DEEPSEEK_MLP
from aotgen.checkpoint.gguf_meta import (
    f32,
    has_tensor,
    meta_value,
    read_layer_types,
    read_rope_scaling,
    require_meta,
)
from aotgen.checkpoint.hf import CheckpointError

_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
}
_EXPERTS = {k: v for k, v in DEEPSEEK_MLP.items() if k.endswith("_exps")}
ERNIE45_MOE_LAYER = {**_ATTENTION, **DEEPSEEK_MLP}
ERNIE45_MOE_PARAMS = {"exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias"}
HUNYUAN_MOE_LAYER = {
    **_ATTENTION,
    **_EXPERTS,
    "attn_q_norm": "self_attn.query_layernorm",
    "attn_k_norm": "self_attn.key_layernorm",
    "ffn_gate_inp": "mlp.gate.wg",
    "ffn_gate_shexp": "mlp.shared_mlp.gate_proj",
    "ffn_up_shexp": "mlp.shared_mlp.up_proj",
    "ffn_down_shexp": "mlp.shared_mlp.down_proj",
}
MELLUM_LAYER = {
    **_ATTENTION,
    **_EXPERTS,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}


def ernie45_moe_config(
    reader: gguf.GGUFReader, arch: str, config: dict[str, Any]
) -> dict[str, Any]:
    """transformers' ERNIE 4.5 MoE config of what llama.cpp runs."""
    _refuse_scale(reader, arch)
    if has_tensor(reader, "attn_output.bias"):  # llama.cpp loads it and adds nothing
        raise CheckpointError(f"GGUF {arch} with attention biases is not supported")
    step = int(require_meta(reader, f"{arch}.interleave_moe_layer_step"))
    if step != 1:
        raise CheckpointError(
            f"GGUF {arch}.interleave_moe_layer_step {step}: llama.cpp loads experts on every "
            "block after the dense ones only (step 1)"
        )
    width = int(require_meta(reader, f"{arch}.expert_feed_forward_length"))
    shared = int(meta_value(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0)
    if shared % width:
        raise CheckpointError(
            f"GGUF {arch}.expert_shared_feed_forward_length {shared} is not a whole number of "
            f"experts {width} wide"
        )
    return {
        "moe_num_experts": int(require_meta(reader, f"{arch}.expert_count")),
        "moe_k": int(require_meta(reader, f"{arch}.expert_used_count")),
        "moe_intermediate_size": width,
        "moe_num_shared_experts": shared // width,
        "moe_layer_start_index": int(meta_value(reader, f"{arch}.leading_dense_block_count", 0)),
        "moe_layer_end_index": config["num_hidden_layers"] - 1,
        "moe_layer_interval": 1,
        "use_bias": False,
    }


def hunyuan_moe_config(
    reader: gguf.GGUFReader, arch: str, config: dict[str, Any]
) -> dict[str, Any]:
    """transformers' Hunyuan MoE config of what llama.cpp runs: one shared MLP as wide as an
    expert, q/k norms, the stored base unscaled."""
    _refuse_scale(reader, arch)
    width = config["intermediate_size"]
    shared = int(meta_value(reader, f"{arch}.expert_shared_feed_forward_length", width) or width)
    if shared != width:
        raise CheckpointError(
            f"GGUF {arch}.expert_shared_feed_forward_length {shared} differs from "
            f"feed_forward_length {width}: Hunyuan's shared MLP is as wide as an expert"
        )
    return {
        "num_experts": int(require_meta(reader, f"{arch}.expert_count")),
        "moe_topk": int(require_meta(reader, f"{arch}.expert_used_count")),
        "num_shared_expert": 1,
        "use_qk_norm": True,
    }


def mellum_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """transformers' Mellum config of what llama.cpp runs (the common keys in `config`)."""
    _refuse_scale(reader, arch)
    n_layer = config["num_hidden_layers"]
    window = int(meta_value(reader, f"{arch}.attention.sliding_window", 0) or 0)
    # no window: a period of 1, every block full
    pattern = meta_value(reader, f"{arch}.attention.sliding_window_pattern", 4) if window else 1
    experts, used = (
        int(require_meta(reader, f"{arch}.{k}")) for k in ("expert_count", "expert_used_count")
    )
    width = int(meta_value(reader, f"{arch}.expert_feed_forward_length", 0) or 0)
    return config | {
        "rms_norm_eps": f32(require_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": _mellum_rope(reader, arch),
        "sliding_window": window or None,
        "layer_types": read_layer_types(reader, arch, pattern, n_layer),
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": width or config["intermediate_size"] // used,
        "norm_topk_prob": True,
        "mlp_layer_types": ["sparse"] * n_layer,
    }


def _mellum_rope(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    base = f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
    scaling = read_rope_scaling(reader, arch)
    if scaling and scaling["rope_type"] != "yarn":
        raise CheckpointError(
            f"GGUF {arch}.rope.scaling.type {scaling['rope_type']!r} is not supported (none "
            "or yarn)"
        )
    if scaling:
        factor = scaling["factor"]
        full = {
            **full,
            **scaling,
            "attention_factor": 1.0 + 0.1 * math.log(factor),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": True,
        }
    return {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": base},
    }


def _refuse_scale(reader: gguf.GGUFReader, arch: str) -> None:
    """These graphs weigh by `expert_weights_scale` where one is stored; transformers' models
    have none."""
    scale = f32(meta_value(reader, f"{arch}.expert_weights_scale", 0.0))
    if scale not in (0.0, 1.0):
        raise CheckpointError(
            f"GGUF {arch}.expert_weights_scale {scale} is not supported (the model has no "
            "routed scale)"
        )
