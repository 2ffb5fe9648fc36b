"""gpt-oss (`general.architecture = gpt-oss`) as llama.cpp runs it: its config.json, the
tensors it requires, and its experts regrouped into transformers' GptOss layout.

llama.cpp (src/models/openai-moe.cpp) runs every block with attention sinks, biased q/k/v/o,
a biased router whose top-k logits are softmaxed (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)
and biased experts with OpenAI's clamped SwiGLU (LLM_FFN_SWIGLU_OAI_MOE: alpha 1.702, limit 7.0
fixed in src/llama-graph.cpp build_moe_ffn, no GGUF key sets them). Its converter
(conversion/gpt_oss.py) stores transformers' `gate_up_proj [E, d, 2f]` (gate and up in
alternate columns) as ffn_gate_exps / ffn_up_exps [E, f, d] and `down_proj [E, f, d]` as
ffn_down_exps [E, d, f], each with its bias, float or MXFP4; both come back here as
transformers holds them.
"""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np

from aotgen.checkpoint.gguf_meta import (
    f32,
    meta_value,
    read_layer_types,
    require_meta,
    require_whole_heads,
)
from aotgen.checkpoint.hf import CheckpointError

# llama-graph.cpp build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE: constants, not hyperparameters.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
# ggml's YaRN ramp bounds (llama-hparams.h yarn_beta_fast / yarn_beta_slow): openai-moe reads
# no GGUF key for them, so the values a converter stores are not used.
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0
# What llama.cpp's gpt-oss loads without TENSOR_NOT_REQUIRED (load_arch_tensors): a file
# without one of these does not load there. q/k/v (or attn_qkv) are checked apart.
REQUIRED_PER_BLOCK = (
    "attn_norm.weight",
    "post_attention_norm.weight",
    "attn_output.weight",
    "attn_output.bias",
    "attn_sinks.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp.bias",
    *(f"ffn_{p}_exps.{k}" for p in ("gate", "up", "down") for k in ("weight", "bias")),
)
REQUIRED_GLOBAL = ("token_embd.weight", "output_norm.weight", "output.weight")


def gpt_oss_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """transformers' GptOssConfig of what llama.cpp runs (openai-moe.cpp load_arch_hparams):
    the window on the layers its pattern marks (a per-layer list, or a period, default 2:
    layer i slides iff i % 2 == 0), one RoPE base for every layer, the experts' width as
    `intermediate_size`, the fixed SwiGLU constants."""
    head_dim = config["head_dim"]
    require_whole_heads(reader, arch, head_dim, "gpt-oss")
    widths = meta_value(reader, f"{arch}.expert_feed_forward_length")
    if isinstance(widths, list) and len(set(widths)) > 1:
        raise CheckpointError(
            f"GGUF {arch}.expert_feed_forward_length differs between blocks ({sorted(set(widths))})"
            "; transformers' gpt-oss has one width"
        )
    base = f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0))
    swa_base = meta_value(reader, f"{arch}.rope.freq_base_swa")
    if swa_base is not None and f32(swa_base) != base:
        raise CheckpointError(
            f"GGUF {arch}.rope.freq_base_swa {f32(swa_base)} differs from rope.freq_base {base}"
            ": transformers' gpt-oss turns every layer at one base"
        )
    n_layer = config["num_hidden_layers"]
    pattern = meta_value(reader, f"{arch}.attention.sliding_window_pattern", 2)
    return config | {
        "rms_norm_eps": f32(require_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": _rope(reader, arch, base, config["max_position_embeddings"]),
        "sliding_window": int(require_meta(reader, f"{arch}.attention.sliding_window")),
        "layer_types": read_layer_types(reader, arch, pattern, n_layer),
        "num_local_experts": int(require_meta(reader, f"{arch}.expert_count")),
        "num_experts_per_tok": int(require_meta(reader, f"{arch}.expert_used_count")),
        "attention_bias": True,
        "swiglu_limit": SWIGLU_LIMIT,
        "swiglu_alpha": SWIGLU_ALPHA,
    }


def _rope(reader: gguf.GGUFReader, arch: str, base: float, n_ctx: int) -> dict[str, Any]:
    """`rope_parameters` as ggml turns q and k (written as 5.x's rope_parameters: given
    `rope_theta` alone, transformers' GptOssConfig would add its default YaRN).

    llama.cpp's defaults where keys are absent: scaling type linear, factor none. YaRN as
    ggml computes it (ggml_rope_yarn_corr_dims floors and ceils the ramp's ends: `truncate`;
    beta_fast 32, beta_slow 1 whatever the file stores; cos and sin times (1 + 0.1 ln factor)
    x rope.scaling.attn_factor, llama-context.cpp and ggml-cpu rope_yarn); the original
    context from rope.scaling.original_context_length, else the context length."""
    kind = meta_value(reader, f"{arch}.rope.scaling.type", "linear")
    factor = meta_value(reader, f"{arch}.rope.scaling.factor")
    if factor is None:  # llama.cpp's older key
        factor = meta_value(reader, f"{arch}.rope.scale_linear", 0.0)
    factor = f32(factor) or 1.0  # 0: unscaled
    gain = f32(meta_value(reader, f"{arch}.rope.scaling.attn_factor", 1.0))
    if kind == "yarn":
        original = meta_value(reader, f"{arch}.rope.scaling.original_context_length") or n_ctx
        return {
            "rope_type": "yarn",
            "rope_theta": base,
            "factor": factor,
            "beta_fast": YARN_BETA_FAST,
            "beta_slow": YARN_BETA_SLOW,
            "truncate": True,
            "original_max_position_embeddings": int(original),
            "attention_factor": (1.0 + 0.1 * math.log(factor)) * gain,
        }
    if kind not in ("none", "linear"):
        raise CheckpointError(
            f"GGUF {arch}.rope.scaling.type {kind!r} is not supported on gpt-oss (none, linear "
            "or yarn)"
        )
    if gain != 1.0:
        raise CheckpointError(
            f"GGUF {arch}.rope.scaling.attn_factor {gain} without YaRN: transformers' gpt-oss "
            "scales cos and sin only with YaRN"
        )
    if kind == "none" or factor == 1.0:
        return {"rope_type": "default", "rope_theta": base}
    return {"rope_type": "linear", "rope_theta": base, "factor": factor}


def check_gpt_oss_tensors(names: set[str], n_layer: int) -> None:
    """Refuse a file llama.cpp's gpt-oss would not load: a missing sink, bias, norm or head."""
    for name in REQUIRED_GLOBAL:
        if name not in names:
            raise CheckpointError(f"GGUF gpt-oss has no {name} (llama.cpp's gpt-oss requires it)")
    for i in range(n_layer):
        apart = all(f"blk.{i}.attn_{p}.weight" in names for p in "qkv")
        required = REQUIRED_PER_BLOCK if apart else ("attn_qkv.weight", *REQUIRED_PER_BLOCK)
        for name in required:
            if f"blk.{i}.{name}" not in names:
                raise CheckpointError(
                    f"GGUF gpt-oss block {i} lacks {name} (llama.cpp's gpt-oss requires it)"
                )


def gpt_oss_tensors(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, Any]:
    """transformers' GptOss names and layout: the sinks without `.weight`; gate and up
    interleaved again as columns of `gate_up_proj [E, d, 2f]` (gate = [..., ::2]) and of
    `gate_up_proj_bias [E, 2f]`; `down_proj [E, f, d]`, `down_proj_bias [E, d]`. q/k/v biases
    a file leaves out (llama.cpp runs without them) are written as zeros: transformers'
    `attention_bias` gives all four projections one."""
    out: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        layer, sep, rest = name.partition(".mlp.experts.")
        if name.endswith(".self_attn.sinks.weight"):
            out[name.removesuffix(".weight")] = w
        elif not sep:
            out[name] = w
        elif rest in ("gate_proj.weight", "gate_proj.bias"):
            kind = rest.rsplit(".", 1)[1]
            up = tensors[f"{layer}.mlp.experts.up_proj.{kind}"]
            pairs = np.stack([w, up], axis=2)  # [E, f, 2, ...]: gate then up, per unit
            fused = pairs.reshape(w.shape[0], 2 * w.shape[1], *w.shape[2:])
            stem = f"{layer}.mlp.experts.gate_up_proj"
            if kind == "weight":
                out[stem] = np.ascontiguousarray(fused.transpose(0, 2, 1))
            else:
                out[f"{stem}_bias"] = np.ascontiguousarray(fused)
        elif rest == "down_proj.weight":
            out[f"{layer}.mlp.experts.down_proj"] = np.ascontiguousarray(w.transpose(0, 2, 1))
        elif rest == "down_proj.bias":
            out[f"{layer}.mlp.experts.down_proj_bias"] = w
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    for i in range(config["num_hidden_layers"]):
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            bias = f"model.layers.{i}.self_attn.{proj}_proj.bias"
            out.setdefault(bias, np.zeros(rows, np.float32))
    return out
