"""What a GGUF's `general.architecture` means in Hugging Face terms: tensor names and
config.json keys (the shapes they imply are checked in gguf_check.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from aotgen.checkpoint.hf import CheckpointError

# llama.cpp tensor names -> HF names, per architecture. "{i}" is the layer index.
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_LAYER = {
    **_LLAMA_LAYER,
    **_QK_NORM,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_OLMO2_LAYER = {  # norms after attention and the MLP; q/k norms across heads
    **{k: v for k, v in _LLAMA_LAYER.items() if k not in ("attn_norm", "ffn_norm")},
    **_QK_NORM,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLM4_LAYER = {  # a norm after attention and on both sides of the MLP; gate/up fused
    **{k: v for k, v in _LLAMA_LAYER.items() if k not in ("ffn_gate", "ffn_up")},
    "post_attention_norm": "post_self_attn_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "post_ffw_norm": "post_mlp_layernorm",
}
# Mixture-of-experts blocks: the router, each projection's experts stacked [E, out, in] (split
# into HF's one tensor per expert at import), Qwen2-MoE's shared expert and its gate.
_MOE_LAYER = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_LFM2_LAYER = {  # attention or a short convolution (shortconv.*) in each block
    "attn_norm": "operator_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
_LFM2_MOE_LAYER = {  # experts stacked [E, out, in]; exp_probs_b the expert bias
    **_LFM2_LAYER,
    "ffn_gate_inp": "feed_forward.gate",
    "ffn_gate_exps": "feed_forward.experts.gate_proj",
    "ffn_up_exps": "feed_forward.experts.up_proj",
    "ffn_down_exps": "feed_forward.experts.down_proj",
    "exp_probs_b": "feed_forward.expert_bias",
}
_LFM2_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "token_embd_norm": "model.embedding_norm",
    "output": "lm_head",
}
_LLAMA_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Gemma (1): llama.cpp always runs the embeddings as the head and loads no `output`.
_GEMMA_GLOBAL = {k: v for k, v in _LLAMA_GLOBAL.items() if k != "output"}
_PHI2_LAYER = {  # q/k/v apart, or fused (attn_qkv: Phi-2 converted before its HF port)
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.dense",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_PHI2_GLOBAL = {**_LLAMA_GLOBAL, "output_norm": "model.final_layernorm"}
# StableLM's q/k norms: one [heads, head_dim] tensor, a norm per head in HF (split at import).
_STABLELM_LAYER = {
    **_LLAMA_LAYER,
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
}
# Cohere's block: one LayerNorm feeding attention and the MLP side by side; Command R's q/k
# norms (_QK_NORM) [heads, head_dim] as HF has them, Cohere2 without.
_COHERE_LAYER = {k: v for k, v in _LLAMA_LAYER.items() if k != "ffn_norm"}
# Nemotron's and Arcee's MLP: no gate (up, relu², down); an ffn_gate is refused.
_UP_DOWN_LAYER = {k: v for k, v in _LLAMA_LAYER.items() if k != "ffn_gate"}
# gpt-oss: q/k/v (or fused attn_qkv, split at import) and o with biases, a sink logit per head,
# the norm after attention stored as post_attention_norm; the router and the experts (each
# projection stacked [E, out, in] with a bias [E, out]) regrouped into transformers' GptOss
# layout at import (gguf_arch_gpt_oss.py).
_GPT_OSS_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if not k.startswith("ffn_")},
    "attn_qkv": "self_attn.qkv_proj",
    "attn_sinks": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_STARCODER2_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if not k.startswith("ffn_")},
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}


@dataclass(frozen=True)
class Arch:
    """How one `general.architecture` maps onto an HF architecture aotgen builds."""

    hf_arch: str
    model_type: str
    layers: dict[str, str]
    globals: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_GLOBAL))
    layer_prefix: str = "model.layers"


ARCHS: dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", "llama", {**_LLAMA_LAYER, **_MOE_LAYER}),  # and Mixtral
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", _LLAMA_LAYER),
    "qwen3": Arch("Qwen3ForCausalLM", "qwen3", {**_LLAMA_LAYER, **_QK_NORM}),
    "gemma": Arch("GemmaForCausalLM", "gemma", _LLAMA_LAYER, _GEMMA_GLOBAL),
    "gemma2": Arch("Gemma2ForCausalLM", "gemma2", _GEMMA3_LAYER),  # no q/k norm tensors
    "gemma3": Arch("Gemma3ForCausalLM", "gemma3_text", _GEMMA3_LAYER),
    "phi3": Arch("Phi3ForCausalLM", "phi3", _PHI3_LAYER),
    "olmo2": Arch("Olmo2ForCausalLM", "olmo2", _OLMO2_LAYER),
    "smollm3": Arch("SmolLM3ForCausalLM", "smollm3", _LLAMA_LAYER),
    "granite": Arch("GraniteForCausalLM", "granite", _LLAMA_LAYER),
    # q/k rows as HF has them (adjacent pairs rotated: llama.cpp's NORM RoPE, no permutation)
    "ernie4_5": Arch("Ernie4_5ForCausalLM", "ernie4_5", _LLAMA_LAYER),
    "glm4": Arch("Glm4ForCausalLM", "glm4", _GLM4_LAYER),  # q/k rows as HF has them, too
    "qwen2moe": Arch("Qwen2MoeForCausalLM", "qwen2_moe", {**_LLAMA_LAYER, **_MOE_LAYER}),
    "qwen3moe": Arch(
        "Qwen3MoeForCausalLM", "qwen3_moe", {**_LLAMA_LAYER, **_QK_NORM, **_MOE_LAYER}
    ),
    "olmoe": Arch("OlmoeForCausalLM", "olmoe", {**_LLAMA_LAYER, **_QK_NORM, **_MOE_LAYER}),
    "granitemoe": Arch("GraniteMoeForCausalLM", "granitemoe", {**_LLAMA_LAYER, **_MOE_LAYER}),
    "lfm2": Arch("Lfm2ForCausalLM", "lfm2", _LFM2_LAYER, _LFM2_GLOBAL),
    "lfm2moe": Arch("Lfm2MoeForCausalLM", "lfm2_moe", _LFM2_MOE_LAYER, _LFM2_GLOBAL),
    # LayerNorms with biases; q/k rows as HF has them (NEOX RoPE, no permutation).
    "phi2": Arch("PhiForCausalLM", "phi", _PHI2_LAYER, _PHI2_GLOBAL),
    "stablelm": Arch("StableLmForCausalLM", "stablelm", _STABLELM_LAYER),
    "starcoder2": Arch("Starcoder2ForCausalLM", "starcoder2", _STARCODER2_LAYER),
    # q/k rows as HF has them (NORM RoPE); no `output`: llama.cpp runs the embeddings as head.
    "command-r": Arch("CohereForCausalLM", "cohere", {**_COHERE_LAYER, **_QK_NORM}, _GEMMA_GLOBAL),
    "cohere2": Arch("Cohere2ForCausalLM", "cohere2", _COHERE_LAYER, _GEMMA_GLOBAL),
    "exaone4": Arch("Exaone4ForCausalLM", "exaone4", _OLMO2_LAYER),  # NEOX RoPE: as HF has them
    "nemotron": Arch("NemotronForCausalLM", "nemotron", _UP_DOWN_LAYER),  # NEOX: as HF has them
    "arcee": Arch("ArceeForCausalLM", "arcee", _UP_DOWN_LAYER),
    # q/k rows as HF has them (NEOX RoPE, no permutation)
    "gpt-oss": Arch("GptOssForCausalLM", "gpt_oss", _GPT_OSS_LAYER),
    "gptneox": Arch(
        "GPTNeoXForCausalLM",
        "gpt_neox",
        {
            "attn_norm": "input_layernorm",
            "attn_qkv": "attention.query_key_value",
            "attn_output": "attention.dense",
            "ffn_norm": "post_attention_layernorm",
            "ffn_up": "mlp.dense_h_to_4h",
            "ffn_down": "mlp.dense_4h_to_h",
        },
        {
            "token_embd": "gpt_neox.embed_in",
            "output_norm": "gpt_neox.final_layer_norm",
            "output": "embed_out",
        },
        "gpt_neox.layers",
    ),
}
SUPPORTED_ARCHS = tuple(ARCHS)
# Architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel and subclasses).
PERMUTED_QK = ("llama", "smollm3", "granite", "granitemoe", "arcee")
# LongRoPE's factors (Phi-3): config, not weights.
ROPE_FACTORS = {
    "rope_factors_long.weight": "long_factor",
    "rope_factors_short.weight": "short_factor",
}
# Llama 3.1's RoPE scaling as llama.cpp's converter stores it: each rotated pair's frequency
# divisor (1 for the fast dims, the factor for the slow ones, a smooth ramp between).
ROPE_FREQS = "rope_freqs.weight"


def meta_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: Any) -> float:
    """GGUF stores float32; keep its shortest repr (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def require_meta(reader: gguf.GGUFReader, key: str) -> Any:
    value = meta_value(reader, key)
    if value is None:
        raise CheckpointError(f"GGUF metadata is missing required key {key!r}")
    return value


def arch_spec(reader: gguf.GGUFReader) -> tuple[str, Arch]:
    arch = require_meta(reader, "general.architecture")
    if arch not in ARCHS:
        raise CheckpointError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    return arch, ARCHS[arch]


def model_tensors(reader: gguf.GGUFReader) -> list[Any]:
    """The tensors that are weights (not LongRoPE's factors or Llama 3.1's divisors)."""
    return [t for t in reader.tensors if t.name not in ROPE_FACTORS and t.name != ROPE_FREQS]


def hf_name(spec: Arch, name: str) -> str:
    base, _, kind = name.rpartition(".")
    if kind in ("weight", "bias"):
        if base in spec.globals:
            return f"{spec.globals[base]}.{kind}"
        parts = base.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in spec.layers:
            return f"{spec.layer_prefix}.{int(parts[1])}.{spec.layers[parts[2]]}.{kind}"
    # e.g. an unknown per-model tensor: silently dropping it would change the model.
    raise CheckpointError(f"unsupported GGUF tensor {name!r}")


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    scaling_type = meta_value(reader, f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    rope_scaling = {
        "rope_type": scaling_type,
        "factor": _f32(require_meta(reader, f"{arch}.rope.scaling.factor")),
    }
    orig_ctx = meta_value(reader, f"{arch}.rope.scaling.original_context_length")
    if orig_ctx is not None:
        rope_scaling["original_max_position_embeddings"] = int(orig_ctx)
    return rope_scaling


def read_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The HF config.json of the GGUF's architecture, from its metadata."""
    # Imported here: that module builds on this one's helpers.
    from aotgen.checkpoint.gguf_arch_gpt_oss import gpt_oss_config
    from aotgen.checkpoint.gguf_arch_layernorm import LAYERNORM_ARCHS, layernorm_config

    arch, spec = arch_spec(reader)
    config = _common_config(reader, arch, spec)
    divisors = _frequency_divisors(reader, config)
    own_rope = ("gptneox", "lfm2", "lfm2moe", "gpt-oss", *LAYERNORM_ARCHS)
    if divisors and (arch in own_rope or _rope_scaling(reader, arch)):
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
    config.update(
        rms_norm_eps=_f32(require_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch) or divisors,
    )
    if arch in ("phi3", "smollm3", "granite", "granitemoe", "arcee"):
        config.update(_llama_variant(reader, arch, config["head_dim"]))
    if arch == "glm4":
        rot = int(meta_value(reader, f"{arch}.rope.dimension_count", config["head_dim"]))
        config.update(
            partial_rotary_factor=rot / config["head_dim"],
            attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        )
    if meta_value(reader, f"{arch}.expert_count"):
        config.update(_experts(reader, arch))
    if arch == "olmo2" and (window := meta_value(reader, f"{arch}.attention.sliding_window")):
        # OLMo 3 (llama.cpp writes it as olmo2): one flag per layer, true where sliding.
        pattern = require_meta(reader, f"{arch}.attention.sliding_window_pattern")
        config.update(
            architectures=["Olmo3ForCausalLM"],
            model_type="olmo3",
            sliding_window=int(window),
            layer_types=_layer_types(reader, arch, pattern, config["num_hidden_layers"]),
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
    divisors = [_f32(x) for x in np.asarray(t.data, np.float32).reshape(-1).tolist()]
    return {
        "rope_type": "longrope",
        "short_factor": divisors,
        "long_factor": divisors,
        "original_max_position_embeddings": config["max_position_embeddings"],
        "attention_factor": 1.0,
    }


def _common_config(reader: gguf.GGUFReader, arch: str, spec: Arch) -> dict[str, Any]:
    """What every architecture's config holds. `num_key_value_heads` is the largest of a
    per-block list (LFM2: 0 on convolution layers), kept as `kv_heads_per_layer`. gpt-oss's
    MLP width is its experts' (llama.cpp reads no feed_forward_length for it)."""
    hidden = int(require_meta(reader, f"{arch}.embedding_length"))
    ff_key = "expert_feed_forward_length" if arch == "gpt-oss" else "feed_forward_length"
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
        "num_hidden_layers": int(require_meta(reader, f"{arch}.block_count")),
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
        "layer_norm_eps": _f32(require_meta(reader, f"{arch}.attention.layer_norm_epsilon")),
        "rotary_pct": rot / head_dim,
        "rotary_emb_base": _f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "use_parallel_residual": bool(meta_value(reader, f"{arch}.use_parallel_residual", True)),
        "hidden_act": "gelu",
        "attention_bias": any(t.name.endswith("attn_qkv.bias") for t in reader.tensors),
    }


def _has_tensor(reader: gguf.GGUFReader, suffix: str) -> bool:
    return any(t.name.endswith(f".{suffix}") for t in reader.tensors)


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
        norm_eps=_f32(require_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta_value(reader, f"{arch}.rope.freq_base", 1e6)),
    )
    if arch == "lfm2":  # feed_forward_length is the width LFM2 derives: no adjusting again
        config["block_auto_adjust_ff_dim"] = False
    else:
        config.update(_lfm2_experts(reader, arch))
    return config


def _layer_types(reader: gguf.GGUFReader, arch: str, pattern: Any, n_layer: int) -> list[str]:
    """Sliding or full attention per layer from a sliding-window pattern: one flag per layer
    (true where sliding), or a period (every period-th layer full; 0: every layer sliding, as
    llama.cpp's set_swa_pattern reads it)."""
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise CheckpointError(
                f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                f"{n_layer} blocks"
            )
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        sliding = [period == 0 or (i + 1) % period != 0 for i in range(n_layer)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def swa_period(reader: gguf.GGUFReader, arch: str) -> int:
    """llama.cpp's window period for Cohere2 and EXAONE 4: the pattern key read as a number
    only (a per-layer list, which its converter writes for EXAONE 4, leaves the default 4)."""
    pattern = meta_value(reader, f"{arch}.attention.sliding_window_pattern")
    return int(pattern) if isinstance(pattern, int) and pattern > 0 else 4


def _exaone4_windows(reader: gguf.GGUFReader, arch: str, n_layer: int) -> dict[str, Any]:
    """llama.cpp windows EXAONE 4 at 64 layers only (the 32B): three layers in four (or the
    period stored), the window stored or 4096, only those layers rotated. At any other depth
    it attends to the whole context and rotates every layer, whatever window is stored."""
    if n_layer != 64:
        return {"sliding_window": None, "layer_types": ["full_attention"] * n_layer}
    return {
        "sliding_window": int(meta_value(reader, f"{arch}.attention.sliding_window", 4096)),
        "layer_types": _layer_types(reader, arch, swa_period(reader, arch), n_layer),
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
        "layer_types": _layer_types(reader, arch, pattern, n_layer),
        "query_pre_attn_scalar": scale_dim if n_layer == largest else config["head_dim"],
    }
    if arch == "gemma3":
        gemma["rope_local_base_freq"] = _f32(meta_value(reader, f"{arch}.rope.freq_base_swa", 1e4))
        return gemma
    for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        gemma[key] = _f32(meta_value(reader, f"{arch}.{key}", default))  # llama.cpp's
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
        "routed_scaling_factor": _f32(scale) if scale else 1.0,
        "use_expert_bias": any(t.name.endswith("exp_probs_b.bias") for t in reader.tensors),
    }


def _experts(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """A mixture of experts' config keys. llama.cpp renormalises the chosen experts' weights
    for Mixtral (a `llama` GGUF with experts), Qwen3-MoE and Granite MoE whatever the original
    config said,
    never for Qwen2-MoE and OLMoE, and runs every block as MoE."""
    out: dict[str, Any] = {
        "num_experts": int(require_meta(reader, f"{arch}.expert_count")),
        "num_experts_per_tok": int(require_meta(reader, f"{arch}.expert_used_count")),
        "norm_topk_prob": arch in ("llama", "qwen3moe", "granitemoe"),
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
        rot = int(meta_value(reader, f"{arch}.rope.dimension_count", head_dim))
        if rot != head_dim:
            raise CheckpointError(
                f"GGUF {arch}.rope.dimension_count is {rot}: llama.cpp's Arcee rotates whole "
                f"heads ({head_dim})"
            )
        return {"hidden_act": "relu2"}
    if arch in ("granite", "granitemoe"):
        keys = {
            "attention.scale": "attention_multiplier",
            "embedding_scale": "embedding_multiplier",
            "residual_scale": "residual_multiplier",
            "logit_scale": "logits_scaling",
        }
        found = {hf: meta_value(reader, f"{arch}.{key}") for key, hf in keys.items()}
        return {hf: _f32(value) for hf, value in found.items() if value is not None}
    out: dict[str, Any] = {}  # phi3
    rot = int(meta_value(reader, f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        out["partial_rotary_factor"] = rot / head_dim
    window = int(meta_value(reader, f"{arch}.attention.sliding_window", 0) or 0)
    out["sliding_window"] = window or None  # 0: none (Phi-4)
    factors = {
        key: [_f32(x) for x in t.data.tolist()]
        for t in reader.tensors
        if (key := ROPE_FACTORS.get(t.name)) is not None
    }
    if factors:
        if len(factors) != 2:
            raise CheckpointError("GGUF has one of rope_factors_long / rope_factors_short only")
        original = require_meta(reader, f"{arch}.rope.scaling.original_context_length")
        out["original_max_position_embeddings"] = int(original)
        out["rope_scaling"] = {"rope_type": "longrope", **factors}
        gain = meta_value(reader, f"{arch}.rope.scaling.attn_factor")
        if gain is not None:
            out["rope_scaling"]["attention_factor"] = _f32(gain)
    return out
