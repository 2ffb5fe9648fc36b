"""DeepSeek-V2 / V3's latent attention (`general.architecture = deepseek2`: DeepSeek-V2,
V2-Lite, V2.5, Coder-V2, V3, R1, Kimi K2, Moonlight, Youtu-LLM; and `minicpm3`) as llama.cpp
runs it: its config.json, its tensors' expected shapes, and `kv_b_proj` put back together.

llama.cpp's converter (conversion/deepseek.py) writes the latent attention as multi-query
attention over the latent: `head_count_kv` 1, `key_length` / `value_length` the latent's
width (`key_length_mla` / `value_length_mla` a head's), and splits transformers'
`kv_b_proj [heads * (nope + v), rank]` into `attn_k_b [heads, rank, nope]` (each head's key
rows transposed) and `attn_v_b [heads, v, rank]`. Files from before that split hold
`attn_kv_b` itself and a head's widths in `key_length` / `value_length`. llama.cpp rotates
adjacent pairs (its NORM RoPE, q/k not permuted), as DeepSeek does.

Routing, as src/llama-graph.cpp build_moe_ffn runs it: softmax probabilities
(`expert_gating_func` 1, or none stored: DeepSeek-V2) or sigmoid scores (2: DeepSeek-V3)
plus `exp_probs_b`; with `expert_group_count` > 1, only the `expert_group_used_count` groups
whose two best scores sum highest; the chosen weights renormalised where
`expert_weights_norm`, times `expert_weights_scale`. DeepSeek-V3's routing is exactly that;
DeepSeek-V2's is that without groups (transformers ranks its groups by their best one).
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

from aotgen.checkpoint.gguf_meta import f32, has_tensor, meta_value, require_meta
from aotgen.checkpoint.hf import CheckpointError

# DeepSeek's MLP names (GLM-4.5, dots.llm1, K-EXAONE and ERNIE 4.5 MoE use them too): the
# dense MLP, the router, the routed experts stacked [E, out, in], the shared experts as one MLP.
DEEPSEEK_MLP = {
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
DEEPSEEK2_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",  # V2-Lite: no q bottleneck
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",  # joined into kv_b_proj by deepseek2_tensors
    "attn_v_b": "self_attn.v_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    **DEEPSEEK_MLP,
}
DEEPSEEK2_PARAMS = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
LATENT_ARCHS = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "YoutuForCausalLM",
    "MiniCPM3ForCausalLM",
)
# llama.cpp's MiniCPM3 (src/models/minicpm3.cpp) scales by constants, whatever the file holds:
# MiniCPM3-4B's own.
MINICPM3_SCALES = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256}
_SOFTMAX, _SIGMOID = gguf.ExpertGatingFuncType.SOFTMAX, gguf.ExpertGatingFuncType.SIGMOID


def deepseek2_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """transformers' config of what llama.cpp runs: DeepseekV3 for sigmoid routing, DeepseekV2
    for softmax, Youtu where every block is dense."""
    key = f"{arch}.attention"
    rope = int(require_meta(reader, f"{arch}.rope.dimension_count"))
    rank = int(require_meta(reader, f"{key}.kv_lora_rank"))
    mla = "_mla" if meta_value(reader, f"{key}.key_length_mla") is not None else ""
    k_dim = int(require_meta(reader, f"{key}.key_length{mla}"))
    v_dim = int(require_meta(reader, f"{key}.value_length{mla}"))
    if k_dim <= rope:
        raise CheckpointError(
            f"GGUF {key}.key_length{mla} {k_dim} is not wider than "
            f"rope.dimension_count {rope}: not a latent-attention file"
        )
    if meta_value(reader, f"{key}.temperature_scale"):
        raise CheckpointError(
            f"GGUF {key}.temperature_scale (Mistral Large 3's attention temperature) is not "
            "supported on deepseek2"
        )
    q_rank = meta_value(reader, f"{key}.q_lora_rank")
    n_layer = config["num_hidden_layers"]
    config = {k: v for k, v in config.items() if k != "head_dim"} | {
        "num_key_value_heads": config["num_attention_heads"],
        "q_lora_rank": int(q_rank) if q_rank else None,
        "kv_lora_rank": rank,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": k_dim - rope,
        "v_head_dim": v_dim,
        "rms_norm_eps": f32(require_meta(reader, f"{key}.layer_norm_rms_epsilon")),
        "rope_parameters": _rope(reader, arch, config["max_position_embeddings"]),
        "rope_interleave": True,
        "attention_bias": False,
    }
    experts = int(meta_value(reader, f"{arch}.expert_count", 0) or 0)
    dense = int(meta_value(reader, f"{arch}.leading_dense_block_count", 0))
    if not experts or dense >= n_layer:
        return config | {"architectures": ["YoutuForCausalLM"], "model_type": "youtu"}
    return config | _routing(reader, arch, config, experts, dense)


def minicpm3_config(
    reader: gguf.GGUFReader, arch: str, config: dict[str, Any], factors: dict[str, list[float]]
) -> dict[str, Any]:
    """transformers' MiniCPM3 config of what llama.cpp runs: a head's key width as
    `key_length` (the latent not split), values as wide as hidden / heads, RoPE on halves at
    llama.cpp's base (the converter stores none: 10000), LongRoPE where the file holds its
    factors, short below the original context and long past it (llama.cpp's choice by the
    context it runs), and llama.cpp's fixed scales."""
    key = f"{arch}.attention"
    rope = int(require_meta(reader, f"{arch}.rope.dimension_count"))
    k_dim = int(require_meta(reader, f"{key}.key_length"))
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    base = f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
    if factors:
        original = meta_value(reader, f"{arch}.rope.scaling.original_context_length")
        original = int(original or config["max_position_embeddings"])
        params = {"rope_type": "longrope", "rope_theta": base, **factors}
        params["original_max_position_embeddings"] = original
    config = {k: v for k, v in config.items() if k != "head_dim"}
    return (
        config
        | MINICPM3_SCALES
        | {
            "q_lora_rank": int(require_meta(reader, f"{key}.q_lora_rank")),
            "kv_lora_rank": int(require_meta(reader, f"{key}.kv_lora_rank")),
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": k_dim - rope,
            "v_head_dim": int(meta_value(reader, f"{key}.value_length", hidden // heads)),
            "rms_norm_eps": f32(require_meta(reader, f"{key}.layer_norm_rms_epsilon")),
            "rope_parameters": params,
        }
    )


def _routing(
    reader: gguf.GGUFReader, arch: str, config: dict[str, Any], experts: int, dense: int
) -> dict[str, Any]:
    """The experts' keys. No gating stored is softmax (DeepSeek-V2's files), except for
    GLM-4.7-Flash's shape (47 or 48 blocks, 154,880 tokens), which llama.cpp runs sigmoid."""
    glm = config["num_hidden_layers"] in (47, 48) and config["vocab_size"] == 154880
    gating = meta_value(reader, f"{arch}.expert_gating_func") or (_SIGMOID if glm else _SOFTMAX)
    if gating not in (_SOFTMAX, _SIGMOID):
        raise CheckpointError(
            f"GGUF {arch}.expert_gating_func {gating}: deepseek2 routes by softmax (1) or "
            "sigmoid (2)"
        )
    out = routing_keys(reader, arch, experts, dense)
    groups, used = out.pop("n_group"), out.pop("topk_group")
    if gating == _SIGMOID:
        return out | {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "n_group": groups,
            "topk_group": used,
        }
    normalise, biased = out["norm_topk_prob"], has_tensor(reader, "exp_probs_b.bias")
    if normalise or biased or (groups > 1 and used < groups):
        what = "in groups" if not (normalise or biased) else "renormalising its weights"
        what = "with exp_probs_b" if biased else what
        raise CheckpointError(
            f"GGUF {arch} with a softmax router {what}: llama.cpp runs it in a way "
            "DeepSeek-V2 does not (it weighs by the probabilities as they are, unbiased, and "
            "ranks a group by its best one); not supported"
        )
    return out | {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "topk_method": "greedy",
    }


def routing_keys(reader: gguf.GGUFReader, arch: str, experts: int, dense: int) -> dict[str, Any]:
    """DeepSeek-V3's routing keys as src/llama-graph.cpp build_moe_ffn runs them: `experts`
    after `dense` dense blocks, `expert_group_used_count` of `expert_group_count` groups (1:
    none), the chosen weights renormalised only where `expert_weights_norm` is stored true,
    scaled by `expert_weights_scale` (0 or none stored: unscaled)."""
    groups = int(meta_value(reader, f"{arch}.expert_group_count", 1) or 1)
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": int(require_meta(reader, f"{arch}.expert_used_count")),
        "n_shared_experts": int(meta_value(reader, f"{arch}.expert_shared_count", 0) or 0),
        "moe_intermediate_size": int(require_meta(reader, f"{arch}.expert_feed_forward_length")),
        "first_k_dense_replace": dense,
        "routed_scaling_factor": f32(meta_value(reader, f"{arch}.expert_weights_scale", 0)) or 1.0,
        "norm_topk_prob": bool(meta_value(reader, f"{arch}.expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": int(meta_value(reader, f"{arch}.expert_group_used_count", groups) or groups),
    }


def _rope(reader: gguf.GGUFReader, arch: str, n_ctx: int) -> dict[str, Any]:
    """`rope_parameters`: unscaled, or DeepSeek's YaRN. llama.cpp's deepseek2 leaves cos and
    sin unscaled and multiplies the softmax scale by (1 + yarn_log_multiplier · ln factor)²:
    transformers' YaRN with `mscale` = `mscale_all_dim` = yarn_log_multiplier / 0.1 (the
    converter's [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]), ggml's ramp (beta 32 and 1, floored and
    ceiled ends)."""
    base = f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0))
    kind = meta_value(reader, f"{arch}.rope.scaling.type", "none")
    factor = f32(meta_value(reader, f"{arch}.rope.scaling.factor", 0.0)) or 1.0
    if kind in ("none", "linear") and factor == 1.0:
        return {"rope_type": "default", "rope_theta": base}
    gain = f32(meta_value(reader, f"{arch}.rope.scaling.attn_factor", 1.0))
    if kind != "yarn" or gain != 1.0:
        raise CheckpointError(
            f"GGUF {arch}.rope.scaling.type {kind!r} (factor {factor}, attn_factor {gain}) is "
            "not supported on deepseek2 (none, or yarn without attn_factor)"
        )
    mscale = f32(meta_value(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    original = meta_value(reader, f"{arch}.rope.scaling.original_context_length") or n_ctx
    return {
        "rope_type": "yarn",
        "rope_theta": base,
        "factor": factor,
        "original_max_position_embeddings": int(original),
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": mscale,
        "mscale_all_dim": mscale,
        "truncate": True,
    }


def deepseek2_shape(name: str, kind: str, c: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape the latent attention's config implies for a block's tensor (`name` without
    its `.weight` / `.bias` `kind`); None for one it does not know."""
    d, heads, rank = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_rank, experts = c.get("q_lora_rank") or 0, c.get("n_routed_experts") or 0
    f, moe_f = c["intermediate_size"], c.get("moe_intermediate_size") or 0
    shared = moe_f * (c.get("n_shared_experts") or 0)
    shapes = {
        "self_attn.q_proj": (heads * (nope + rope), d),
        "self_attn.q_a_proj": (q_rank, d),
        "self_attn.q_a_layernorm": (q_rank,),
        "self_attn.q_b_proj": (heads * (nope + rope), q_rank),
        "self_attn.kv_a_proj_with_mqa": (rank + rope, d),
        "self_attn.kv_a_layernorm": (rank,),
        "self_attn.kv_b_proj": (heads * (nope + v), rank),
        "self_attn.k_b_proj": (heads, rank, nope),
        "self_attn.v_b_proj": (heads, v, rank),
        "self_attn.o_proj": (d, heads * v),
        "mlp.gate_proj": (f, d),
        "mlp.up_proj": (f, d),
        "mlp.down_proj": (d, f),
        "mlp.gate": (experts, d),
        "mlp.gate.e_score_correction_bias": (experts,),
        "mlp.experts.gate_proj": (experts, moe_f, d),
        "mlp.experts.up_proj": (experts, moe_f, d),
        "mlp.experts.down_proj": (experts, d, moe_f),
        "mlp.shared_experts.gate_proj": (shared, d),
        "mlp.shared_experts.up_proj": (shared, d),
        "mlp.shared_experts.down_proj": (d, shared),
    }
    module = name.split(".", 3)[3]
    if module in ("input_layernorm", "post_attention_layernorm"):
        return (d,)
    return shapes.get(module if kind == "weight" else f"{module}.{kind}")


def deepseek2_tensors(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, Any]:
    """transformers' `kv_b_proj [heads * (nope + v), rank]` from llama.cpp's split halves: each
    head's key rows (attn_k_b transposed back) then its value rows; DeepSeek-V3's expert bias
    as zeros where the file has none (llama.cpp then selects by the scores alone)."""
    out: dict[str, np.ndarray] = {}
    rank = config["kv_lora_rank"]
    for name, w in tensors.items():  # llama.cpp's split halves back in one
        if name.endswith(".self_attn.k_b_proj.weight"):
            stem = name.removesuffix(".k_b_proj.weight")
            values = tensors.get(f"{stem}.v_b_proj.weight")
            if values is None:
                raise CheckpointError(
                    f"GGUF block {stem.split('.')[2]} has attn_k_b without attn_v_b"
                )
            keys = w.transpose(0, 2, 1)  # [heads, nope, rank]
            joined = np.concatenate([keys, values], axis=1).reshape(-1, rank)
            out[f"{stem}.kv_b_proj.weight"] = np.ascontiguousarray(joined)
        elif name.endswith(".self_attn.v_b_proj.weight"):
            if f"{name.removesuffix('.v_b_proj.weight')}.k_b_proj.weight" not in tensors:
                raise CheckpointError(
                    f"GGUF block {name.split('.')[2]} has attn_v_b without attn_k_b"
                )
        else:
            out[name] = w
    if config["architectures"] == ["DeepseekV3ForCausalLM"]:  # exp_probs_b is optional there
        add_expert_bias(out, config, "mlp.gate.e_score_correction_bias")
    return out


def add_expert_bias(tensors: dict[str, np.ndarray], config: dict[str, Any], leaf: str) -> None:
    """DeepSeek-V3's routing's expert bias as zeros on the sparse blocks where the file has
    none (llama.cpp then selects by the scores alone)."""
    experts = config.get("n_routed_experts") or config["num_experts"]
    for i in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        tensors.setdefault(f"model.layers.{i}.{leaf}", np.zeros(experts, np.float32))
