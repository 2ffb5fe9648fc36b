"""A latent-attention checkpoint written as llama.cpp's converter writes it
(conversion/deepseek.py DeepseekV2Model, conversion/base.py): `deepseek2` metadata, kv_b_proj
split into attn_k_b (each head's key rows transposed) and attn_v_b, or kept whole as
attn_kv_b the way files from before that split hold it; MiniCPM3's `minicpm3`
(conversion/minicpm.py MiniCPM3Model)."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

LATENT_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def latent_meta(w: gguf.GGUFWriter, cfg: dict[str, Any], split: bool, sigmoid: bool) -> None:
    """deepseek2's keys: the latent as one KV head of the latent's width with a head's widths
    under *_mla (`split`), or a head's widths as key/value length (older files); the routing
    (sigmoid as DeepSeek-V3's config.json names it in `scoring_func`)."""
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_head_count_kv(1 if split else cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    params = cfg["rope_parameters"]
    w.add_rope_freq_base(params["rope_theta"])
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split:
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(cfg["v_head_dim"])
    else:
        w.add_key_length(cfg["qk_nope_head_dim"] + rope)
        w.add_value_length(cfg["v_head_dim"])
    w.add_rope_dimension_count(rope)
    experts = cfg.get("n_routed_experts")
    dense = cfg.get("first_k_dense_replace") if experts else cfg["num_hidden_layers"]
    w.add_leading_dense_block_count(dense)
    w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    w.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    gating = gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    w.add_expert_gating_func(gating)


def latent_tensors(hf: str, x: np.ndarray, cfg: dict[str, Any], split: bool):
    """The GGUF tensors of an HF tensor the converter changes; None for the others."""
    layer = hf.split(".")[2] if hf.startswith("model.layers.") else None
    if hf.endswith("mlp.gate.e_score_correction_bias"):
        return [(f"blk.{layer}.exp_probs_b.bias", x)]
    if not hf.endswith("kv_b_proj.weight"):
        return None
    if not split:
        return [(f"blk.{layer}.attn_kv_b.weight", x)]
    heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    per_head = x.reshape(heads, nope + cfg["v_head_dim"], x.shape[1])
    keys, values = per_head[:, :nope], per_head[:, nope:]
    return [
        (f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(keys.transpose(0, 2, 1))),
        (f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(values)),
    ]


def minicpm3_meta(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """minicpm3's keys (no RoPE base, no value width: llama.cpp's defaults) and LongRoPE's
    factors as tensors."""
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_key_length(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    params = cfg["rope_parameters"]
    if params.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            factors = np.asarray(params[f"{kind}_factor"], np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
