"""The config.json of the LayerNorm architectures (Phi-2, StableLM, StarCoder2, Command R,
Cohere2 and Nemotron) from a GGUF's metadata, as llama.cpp runs them."""

from __future__ import annotations

from typing import Any

import gguf

from aotgen.checkpoint.gguf_meta import (
    f32,
    has_tensor,
    meta_value,
    read_layer_types,
    read_rope_scaling,
    require_meta,
    require_whole_heads,
    swa_period,
)

LAYERNORM_ARCHS = ("phi2", "stablelm", "starcoder2", "command-r", "cohere2", "nemotron")


def layernorm_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Phi-2, StableLM and StarCoder2 as llama.cpp runs them (Command R and Cohere2:
    _cohere_config). Its converter stores no RoPE base for Phi-2 and StableLM (llama.cpp's
    default 10000 applies) and no StarCoder2 window (llama.cpp attends to the whole context);
    llama.cpp's StableLM runs the parallel residual exactly where a block has no ffn_norm,
    whatever `use_parallel_residual` says."""
    if arch in ("command-r", "cohere2"):
        return _cohere_config(reader, arch, config)
    if arch == "nemotron":
        return _nemotron_config(reader, arch, config)
    head_dim = config["head_dim"]
    rot = int(meta_value(reader, f"{arch}.rope.dimension_count", head_dim))
    eps = f32(require_meta(reader, f"{arch}.attention.layer_norm_epsilon"))
    config["rope_theta"] = f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0))
    if arch == "starcoder2":
        require_whole_heads(reader, arch, head_dim, "llama.cpp's StarCoder2")
        return config | {
            "norm_epsilon": eps,
            "hidden_act": "gelu_pytorch_tanh",
            "use_bias": has_tensor(reader, "attn_output.bias"),
            "sliding_window": None,
        }
    # Written even when 1: transformers' Phi defaults to 0.5, StableLM to 0.25.
    config |= {"layer_norm_eps": eps, "partial_rotary_factor": rot / head_dim}
    if arch == "phi2":  # gelu_new: GELU's tanh approximation, as llama.cpp's
        return config | {"hidden_act": "gelu_new", "qk_layernorm": False}
    return config | {
        "hidden_act": "silu",
        "use_qkv_bias": has_tensor(reader, "attn_q.bias"),
        "qk_layernorm": has_tensor(reader, "attn_q_norm.weight"),
        "use_parallel_residual": not has_tensor(reader, "ffn_norm.weight"),
    }


def _cohere_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Command R (`command-r`) and Cohere2: whole heads rotated by adjacent pairs (llama.cpp's
    NORM RoPE, q/k rows as HF has them), logits x logit_scale, the embeddings as the head
    (llama.cpp loads no `output`). Cohere2 as llama.cpp runs it: three sliding-window layers
    in four unless the GGUF stores another period, only they rotated, with the global base.
    llama.cpp loads Command R's q/k norms in models of 64 layers or more only (Command R+);
    elsewhere they are taken as the tensors give them."""
    head_dim = config["head_dim"]
    require_whole_heads(reader, arch, head_dim, "Cohere's RoPE")
    config |= {
        "hidden_act": "silu",
        "layer_norm_eps": f32(require_meta(reader, f"{arch}.attention.layer_norm_epsilon")),
        "rope_theta": f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "logit_scale": f32(require_meta(reader, f"{arch}.logit_scale")),
        "attention_bias": has_tensor(reader, "attn_q.bias"),
    }
    if arch == "command-r":
        return config | {"use_qk_norm": has_tensor(reader, "attn_q_norm.weight")}
    n_layer = config["num_hidden_layers"]
    return config | {
        "sliding_window": int(require_meta(reader, f"{arch}.attention.sliding_window")),
        "layer_types": read_layer_types(reader, arch, swa_period(reader, arch), n_layer),
    }


def _nemotron_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Nemotron as llama.cpp runs it: relu² whatever the config said, rope.dimension_count
    dims of each head rotated (NEOX RoPE: q/k rows as HF has them), RoPE scaled linearly
    where a factor is stored. Its converter counts those dims as hidden_size x the factor /
    heads, not HF's head_dim x the factor where head_dim is not hidden_size / heads: the count
    stored is kept. The LayerNorm1P weights are stored plus one (undone in gguf.py)."""
    rot = int(meta_value(reader, f"{arch}.rope.dimension_count", config["head_dim"]))
    return config | {
        "hidden_act": "relu2",
        "norm_eps": f32(require_meta(reader, f"{arch}.attention.layer_norm_epsilon")),
        "partial_rotary_factor": rot / config["head_dim"],  # written: transformers' default 0.5
        "rope_theta": f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": read_rope_scaling(reader, arch),
        "attention_bias": has_tensor(reader, "attn_q.bias"),
        "mlp_bias": has_tensor(reader, "ffn_up.bias"),
    }
