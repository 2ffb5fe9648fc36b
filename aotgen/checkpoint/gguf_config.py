"""The HF config.json of a GGUF's architecture, read from its metadata (the tensor names:
gguf_arch.py)."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

from aotgen.checkpoint.gguf_arch import ROPE_FACTORS, ROPE_FREQS, Arch, arch_spec
from aotgen.checkpoint.gguf_arch_deepseek2 import deepseek2_config, minicpm3_config
from aotgen.checkpoint.gguf_arch_gpt_oss import gpt_oss_config
from aotgen.checkpoint.gguf_arch_grouped_moe import (
    dots1_config,
    exaone_moe_config,
    glm4moe_config,
)
from aotgen.checkpoint.gguf_arch_layernorm import LAYERNORM_ARCHS, layernorm_config
from aotgen.checkpoint.gguf_arch_mistral3 import mistral3_rope
from aotgen.checkpoint.gguf_arch_qwen35 import qwen35_config
from aotgen.checkpoint.gguf_arch_softmax_moe import (
    ernie45_moe_config,
    hunyuan_moe_config,
    mellum_config,
)
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
from aotgen.checkpoint.hf import CheckpointError

# The experts' keys of the architectures with a module of their own (the others: _experts).
_MOE_CONFIGS = {
    "glm4moe": glm4moe_config,
    "dots1": dots1_config,
    "exaone-moe": exaone_moe_config,
    "ernie4_5-moe": ernie45_moe_config,
    "hunyuan-moe": hunyuan_moe_config,
}


def read_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The HF config.json of the GGUF's architecture, from its metadata."""
    arch, spec = arch_spec(reader)
    config = _common_config(reader, arch, spec)
    divisors = _frequency_divisors(reader, config)
    own_rope = ("gptneox", "lfm2", "lfm2moe", "gpt-oss", "qwen35", "qwen35moe", "deepseek2")
    own_rope += ("minicpm3", "qwen3next", "mellum")
    own_rope += LAYERNORM_ARCHS
    if divisors and (arch in own_rope or read_rope_scaling(reader, arch)):
        raise CheckpointError(
            f"GGUF {ROPE_FREQS} on {arch} (or with a rope.scaling.type) is not supported"
        )
    if arch == "gptneox":
        return _gptneox_config(reader, arch, config)
    if arch in ("lfm2", "lfm2moe"):
        return _lfm2_config(reader, arch, config)
    if arch in LAYERNORM_ARCHS:
        return layernorm_config(reader, arch, config)
    if arch == "gpt-oss":
        return gpt_oss_config(reader, arch, config)
    if arch == "deepseek2":
        return deepseek2_config(reader, arch, config)
    if arch == "minicpm3":
        return minicpm3_config(reader, arch, config, _rope_factors(reader))
    if arch == "mellum":
        return mellum_config(reader, arch, config)
    if arch == "qwen35":
        return qwen35_config(reader, arch, config)
    if arch in ("qwen35moe", "qwen3next"):
        return qwen35_config(reader, arch, config) | _experts(reader, arch)
    config.update(
        rms_norm_eps=f32(require_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=read_rope_scaling(reader, arch) or divisors,
    )
    if arch in ("phi3", "smollm3", "granite", "granitemoe", "arcee"):
        config.update(_llama_variant(reader, arch, config["head_dim"]))
    if arch == "apertus":  # llama.cpp's Apertus runs xIELU whatever else the file says
        config["hidden_act"] = "xielu"
    if arch == "mistral3":
        config.update(mistral3_rope(reader, arch, config))
    if arch == "hunyuan-dense":  # a stored alpha stretches the base, as Hunyuan's config says
        if alpha := meta_value(reader, f"{arch}.rope.scaling.alpha"):
            config["rope_scaling"] = {"rope_type": "dynamic", "alpha": f32(alpha), "factor": 1.0}
        config["use_qk_norm"] = True
    if arch == "seed_oss":  # biases where the file has them
        config.update(
            attention_bias=has_tensor(reader, "attn_q.bias"),
            attention_out_bias=has_tensor(reader, "attn_output.bias"),
        )
    if arch == "glm4":
        rot = int(meta_value(reader, f"{arch}.rope.dimension_count", config["head_dim"]))
        config.update(
            partial_rotary_factor=rot / config["head_dim"],
            attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        )
    if arch in _MOE_CONFIGS:
        config.update(_MOE_CONFIGS[arch](reader, arch, config))
    elif meta_value(reader, f"{arch}.expert_count"):
        config.update(_experts(reader, arch))
    if arch == "olmo2" and (window := meta_value(reader, f"{arch}.attention.sliding_window")):
        # OLMo 3 (llama.cpp writes it as olmo2): one flag per layer, true where sliding.
        pattern = require_meta(reader, f"{arch}.attention.sliding_window_pattern")
        config.update(
            architectures=["Olmo3ForCausalLM"],
            model_type="olmo3",
            sliding_window=int(window),
            layer_types=read_layer_types(reader, arch, pattern, config["num_hidden_layers"]),
        )
    if arch == "exaone4":
        config.update(_exaone4_windows(reader, arch, config["num_hidden_layers"]))
    if arch == "gemma":  # llama.cpp's GELU is the tanh one; attention by head_dim ** -0.5
        config["hidden_act"] = "gelu_pytorch_tanh"
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma_config(reader, arch, config))
    return config


def _frequency_divisors(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict | None:
    """`rope_freqs` as the config of the same rotation: LongRoPE with the divisors as both
    factor lists, its original context the whole context and no attention gain, so every
    position rotates by the base frequencies over the divisors, as in llama.cpp."""
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return None
    divisors = [f32(x) for x in np.asarray(t.data, np.float32).reshape(-1).tolist()]
    return {
        "rope_type": "longrope",
        "short_factor": divisors,
        "long_factor": divisors,
        "original_max_position_embeddings": config["max_position_embeddings"],
        "attention_factor": 1.0,
    }


def _common_config(reader: gguf.GGUFReader, arch: str, spec: Arch) -> dict[str, Any]:
    """What every architecture's config holds. The blocks the model runs: all but the last
    `nextn_predict_layers` (a multi-token-prediction head's, left out as transformers leaves
    out `mtp.*`). `num_key_value_heads` is the largest of a per-block list (LFM2: 0 on
    convolution layers), kept as `kv_heads_per_layer`. gpt-oss's
    MLP width is its experts' (llama.cpp reads no feed_forward_length for it), as is that of
    a glm4moe file without one (Solar Open: every block sparse)."""
    hidden = int(require_meta(reader, f"{arch}.embedding_length"))
    n_block = int(require_meta(reader, f"{arch}.block_count"))
    ff_key = "expert_feed_forward_length" if arch == "gpt-oss" else "feed_forward_length"
    if arch == "glm4moe" and meta_value(reader, f"{arch}.{ff_key}") is None:
        ff_key = "expert_feed_forward_length"
    ff = require_meta(reader, f"{arch}.{ff_key}")
    n_head = int(require_meta(reader, f"{arch}.attention.head_count"))
    n_kv = meta_value(reader, f"{arch}.attention.head_count_kv", n_head)
    tokens = meta_value(reader, "tokenizer.ggml.tokens")
    vocab_size = meta_value(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        vocab_size = int(embd.shape[-1]) if embd is not None else None
    return {
        "architectures": [spec.hf_arch],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(max(ff) if isinstance(ff, list) else ff),
        "num_hidden_layers": n_block - int(meta_value(reader, f"{arch}.nextn_predict_layers", 0)),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(max(n_kv) if isinstance(n_kv, list) else n_kv),
        "head_dim": int(meta_value(reader, f"{arch}.attention.key_length", hidden // n_head)),
        "max_position_embeddings": int(require_meta(reader, f"{arch}.context_length")),
        "vocab_size": int(vocab_size) if vocab_size is not None else None,
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": meta_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta_value(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta_value(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _gptneox_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    head_dim = config.pop("head_dim")
    del config["num_key_value_heads"]
    rot = int(meta_value(reader, f"{arch}.rope.dimension_count", head_dim))
    return config | {
        "layer_norm_eps": f32(require_meta(reader, f"{arch}.attention.layer_norm_epsilon")),
        "rotary_pct": rot / head_dim,
        "rotary_emb_base": f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "use_parallel_residual": bool(meta_value(reader, f"{arch}.use_parallel_residual", True)),
        "hidden_act": "gelu",
        "attention_bias": any(t.name.endswith("attn_qkv.bias") for t in reader.tensors),
    }


def _lfm2_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """LFM2 (-MoE): the blocks with KV heads attend, the others are short convolutions."""
    n_layer = config["num_hidden_layers"]
    kv_per_layer = meta_value(reader, f"{arch}.attention.head_count_kv")
    if not isinstance(kv_per_layer, list) or len(kv_per_layer) != n_layer:
        raise CheckpointError(
            f"GGUF {arch}.attention.head_count_kv must list each of the {n_layer} blocks"
        )
    config.update(
        layer_types=["full_attention" if n else "conv" for n in kv_per_layer],
        conv_L_cache=int(require_meta(reader, f"{arch}.shortconv.l_cache")),
        norm_eps=f32(require_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=f32(meta_value(reader, f"{arch}.rope.freq_base", 1e6)),
    )
    if arch == "lfm2":  # feed_forward_length is the width LFM2 derives: no adjusting again
        config["block_auto_adjust_ff_dim"] = False
    else:
        config.update(_lfm2_experts(reader, arch))
    return config


def _exaone4_windows(reader: gguf.GGUFReader, arch: str, n_layer: int) -> dict[str, Any]:
    """llama.cpp windows EXAONE 4 at 64 layers only (the 32B): three layers in four (or the
    period stored), the window stored or 4096, only those layers rotated. At any other depth
    it attends to the whole context and rotates every layer, whatever window is stored."""
    if n_layer != 64:
        return {"sliding_window": None, "layer_types": ["full_attention"] * n_layer}
    return {
        "sliding_window": int(meta_value(reader, f"{arch}.attention.sliding_window", 4096)),
        "layer_types": read_layer_types(reader, arch, swa_period(reader, arch), n_layer),
    }


def _gemma_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's fixed Gemma choices: every 6th layer global (Gemma 2: every 2nd), local
    RoPE base 10000 (Gemma 2: the global one), attention scaled by head_dim ** -0.5 (hidden /
    heads on the 27B: 62 layers in Gemma 3, 46 in Gemma 2). Newer converters may store the
    pattern (a period or one flag per layer) and base."""
    n_layer = config["num_hidden_layers"]
    period, largest = (6, 62) if arch == "gemma3" else (2, 46)
    pattern = meta_value(reader, f"{arch}.attention.sliding_window_pattern", period)
    scale_dim = config["hidden_size"] // config["num_attention_heads"]
    gemma = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(require_meta(reader, f"{arch}.attention.sliding_window")),
        "layer_types": read_layer_types(reader, arch, pattern, n_layer),
        "query_pre_attn_scalar": scale_dim if n_layer == largest else config["head_dim"],
    }
    if arch == "gemma3":
        gemma["rope_local_base_freq"] = f32(meta_value(reader, f"{arch}.rope.freq_base_swa", 1e4))
        return gemma
    for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        gemma[key] = f32(meta_value(reader, f"{arch}.{key}", default))  # llama.cpp's
    return gemma


def _lfm2_experts(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """LFM2-MoE as llama.cpp runs it: sigmoid scores, the chosen experts' renormalised."""
    gating = meta_value(reader, f"{arch}.expert_gating_func")
    if gating != gguf.ExpertGatingFuncType.SIGMOID:
        raise CheckpointError(f"GGUF {arch}.expert_gating_func {gating!r}: LFM2-MoE is sigmoid")
    scale = meta_value(reader, f"{arch}.expert_weights_scale")
    return {
        "num_experts": int(require_meta(reader, f"{arch}.expert_count")),
        "num_experts_per_tok": int(require_meta(reader, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(require_meta(reader, f"{arch}.expert_feed_forward_length")),
        "num_dense_layers": int(meta_value(reader, f"{arch}.leading_dense_block_count", 0)),
        "norm_topk_prob": True,
        "routed_scaling_factor": f32(scale) if scale else 1.0,
        "use_expert_bias": any(t.name.endswith("exp_probs_b.bias") for t in reader.tensors),
    }


def _experts(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """A mixture of experts' config keys. llama.cpp renormalises the chosen experts' weights
    for Mixtral (a `llama` GGUF with experts), Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next and Granite
    MoE whatever the original config said,
    never for Qwen2-MoE and OLMoE, and runs every block as MoE."""
    out: dict[str, Any] = {
        "num_experts": int(require_meta(reader, f"{arch}.expert_count")),
        "num_experts_per_tok": int(require_meta(reader, f"{arch}.expert_used_count")),
        "norm_topk_prob": arch in ("llama", "qwen3moe", "granitemoe", "qwen35moe", "qwen3next"),
    }
    for key, hf in (
        ("expert_feed_forward_length", "moe_intermediate_size"),
        ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
    ):
        if (value := meta_value(reader, f"{arch}.{key}")) is not None:
            out[hf] = int(value)
    if arch == "llama":
        out.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=out.pop("num_experts"),
        )
    if arch == "qwen2moe":
        out["qkv_bias"] = any(t.name.endswith("attn_q.bias") for t in reader.tensors)
    return out


def _llama_variant(reader: gguf.GGUFReader, arch: str, head_dim: int) -> dict[str, Any]:
    """The config keys of the Llama variants, from what llama.cpp stores of them."""
    if arch == "smollm3":  # llama.cpp rotates all but every fourth layer, as the HF default
        return {"no_rope_layer_interval": 4}
    if arch == "arcee":  # llama.cpp runs relu² whatever the config said, and whole heads
        require_whole_heads(reader, arch, head_dim, "llama.cpp's Arcee")
        return {"hidden_act": "relu2"}
    if arch in ("granite", "granitemoe"):
        keys = {
            "attention.scale": "attention_multiplier",
            "embedding_scale": "embedding_multiplier",
            "residual_scale": "residual_multiplier",
            "logit_scale": "logits_scaling",
        }
        found = {hf: meta_value(reader, f"{arch}.{key}") for key, hf in keys.items()}
        return {hf: f32(value) for hf, value in found.items() if value is not None}
    out: dict[str, Any] = {}  # phi3
    rot = int(meta_value(reader, f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        out["partial_rotary_factor"] = rot / head_dim
    window = int(meta_value(reader, f"{arch}.attention.sliding_window", 0) or 0)
    out["sliding_window"] = window or None  # 0: none (Phi-4)
    factors = _rope_factors(reader)
    if factors:
        original = require_meta(reader, f"{arch}.rope.scaling.original_context_length")
        out["original_max_position_embeddings"] = int(original)
        out["rope_scaling"] = {"rope_type": "longrope", **factors}
        gain = meta_value(reader, f"{arch}.rope.scaling.attn_factor")
        if gain is not None:
            out["rope_scaling"]["attention_factor"] = f32(gain)
    return out


def _rope_factors(reader: gguf.GGUFReader) -> dict[str, list[float]]:
    """LongRoPE's factors the file holds as tensors, by their config key: both or none."""
    factors = {
        key: [f32(x) for x in t.data.tolist()]
        for t in reader.tensors
        if (key := ROPE_FACTORS.get(t.name)) is not None
    }
    if len(factors) == 1:
        raise CheckpointError("GGUF has one of rope_factors_long / rope_factors_short only")
    return factors
