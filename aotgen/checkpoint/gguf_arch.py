"""What a GGUF's `general.architecture` means in Hugging Face terms: its tensors' names (its
config.json keys: gguf_config.py; the shapes they imply are checked in gguf_check.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from aotgen.checkpoint.gguf_arch_deepseek2 import DEEPSEEK2_LAYER, DEEPSEEK2_PARAMS
from aotgen.checkpoint.gguf_arch_grouped_moe import (
    DOTS1_LAYER,
    EXAONE_MOE_PARAMS,
    GROUPED_MOE_LAYER,
    GROUPED_MOE_PARAMS,
)
from aotgen.checkpoint.gguf_arch_qwen35 import QWEN3NEXT_LAYER, QWEN35_LAYER, QWEN35_PARAMS
from aotgen.checkpoint.gguf_arch_softmax_moe import (
    ERNIE45_MOE_LAYER,
    ERNIE45_MOE_PARAMS,
    HUNYUAN_MOE_LAYER,
    MELLUM_LAYER,
)
from aotgen.checkpoint.gguf_meta import meta_value, require_meta
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
_SEED_OSS_LAYER = {  # the MLP's norm named as a norm after attention
    **{k: v for k, v in _LLAMA_LAYER.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
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
    # A block's tensors named whole (no `.weight` / `.bias` of the module's): GGUF → HF.
    params: dict[str, str] = field(default_factory=dict)


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
    "seed_oss": Arch("SeedOssForCausalLM", "seed_oss", _SEED_OSS_LAYER),  # NEOX: as HF has them
    # Ministral 3 (LlamaModel's converter: q/k permuted); MistralForCausalLM without its
    # attention temperature
    "mistral3": Arch("Ministral3ForCausalLM", "ministral3", _LLAMA_LAYER),
    # its norms' own names, q/k as HF has them (undo_permute off); xIELU's parameters are
    # metadata (xielu_tensors)
    "apertus": Arch(
        "ApertusForCausalLM",
        "apertus",
        {
            **_UP_DOWN_LAYER,
            **_QK_NORM,
            "attn_norm": "attention_layernorm",
            "ffn_norm": "feedforward_layernorm",
        },
    ),
    # q/k norms (after RoPE) under Hunyuan's names; NEOX RoPE: q/k as HF has them
    "hunyuan-dense": Arch(
        "HunYuanDenseV1ForCausalLM",
        "hunyuan_v1_dense",
        {
            **_LLAMA_LAYER,
            "attn_q_norm": "self_attn.query_layernorm",
            "attn_k_norm": "self_attn.key_layernorm",
        },
    ),
    # linear attention beside gated attention (gguf_arch_qwen35.py); q/k as HF has them
    "qwen35": Arch("Qwen3_5ForCausalLM", "qwen3_5_text", QWEN35_LAYER, params=QWEN35_PARAMS),
    "qwen35moe": Arch(
        "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe_text",
        {**QWEN35_LAYER, **_MOE_LAYER},
        params=QWEN35_PARAMS,
    ),
    "qwen3next": Arch(
        "Qwen3NextForCausalLM",
        "qwen3_next",
        {**QWEN3NEXT_LAYER, **_MOE_LAYER},
        params=QWEN35_PARAMS,
    ),
    # latent attention (gguf_arch_deepseek2.py): DeepSeek-V3's, V2's or Youtu's by its
    # routing; q/k as HF has them (NORM RoPE, adjacent pairs, no permutation)
    "deepseek2": Arch(
        "DeepseekV3ForCausalLM", "deepseek_v3", DEEPSEEK2_LAYER, params=DEEPSEEK2_PARAMS
    ),
    "minicpm3": Arch("MiniCPM3ForCausalLM", "minicpm3", DEEPSEEK2_LAYER),  # NEOX: as HF has them
    # DeepSeek-V3's routing behind ordinary attention (gguf_arch_grouped_moe.py); NEOX: q/k
    # as HF has them
    "glm4moe": Arch("Glm4MoeForCausalLM", "glm4_moe", GROUPED_MOE_LAYER, params=GROUPED_MOE_PARAMS),
    "dots1": Arch("Dots1ForCausalLM", "dots1", DOTS1_LAYER, params=GROUPED_MOE_PARAMS),
    "exaone-moe": Arch("ExaoneMoeForCausalLM", "exaone_moe", DOTS1_LAYER, params=EXAONE_MOE_PARAMS),
    # a softmax router fixed by llama.cpp (gguf_arch_softmax_moe.py); ERNIE's q/k as HF has
    # them (NORM RoPE), Hunyuan's too (NEOX)
    "ernie4_5-moe": Arch(
        "Ernie4_5_MoeForCausalLM", "ernie4_5_moe", ERNIE45_MOE_LAYER, params=ERNIE45_MOE_PARAMS
    ),
    "hunyuan-moe": Arch("HunYuanMoEV1ForCausalLM", "hunyuan_v1_moe", HUNYUAN_MOE_LAYER),
    "mellum": Arch("MellumForCausalLM", "mellum", MELLUM_LAYER),
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
PERMUTED_QK = ("llama", "smollm3", "granite", "granitemoe", "arcee", "mistral3")
# LongRoPE's factors (Phi-3): config, not weights.
ROPE_FACTORS = {
    "rope_factors_long.weight": "long_factor",
    "rope_factors_short.weight": "short_factor",
}
# Llama 3.1's RoPE scaling as llama.cpp's converter stores it: each rotated pair's frequency
# divisor (1 for the fast dims, the factor for the slow ones, a smooth ramp between).
ROPE_FREQS = "rope_freqs.weight"


def arch_spec(reader: gguf.GGUFReader) -> tuple[str, Arch]:
    arch = require_meta(reader, "general.architecture")
    if arch not in ARCHS:
        raise CheckpointError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    return arch, ARCHS[arch]


# Apertus's xIELU parameters, one value per block in the metadata (llama.cpp applies the
# softplus itself, so they are the checkpoint's): key -> (HF name, shape).
XIELU_KEYS = {
    gguf.Keys.xIELU.ALPHA_P: ("alpha_p", (1,)),
    gguf.Keys.xIELU.ALPHA_N: ("alpha_n", (1,)),
    gguf.Keys.xIELU.BETA: ("beta", ()),
    gguf.Keys.xIELU.EPS: ("eps", ()),
}


def xielu_tensors(reader: gguf.GGUFReader, n_layer: int) -> dict[str, np.ndarray]:
    """`model.layers.I.mlp.act_fn.*` from the `xielu.*` metadata arrays."""
    out = {}
    for key, (name, shape) in XIELU_KEYS.items():
        values = require_meta(reader, key)
        if not isinstance(values, list) or len(values) != n_layer:
            raise CheckpointError(f"GGUF {key} must list a value for each of the {n_layer} blocks")
        for i, v in enumerate(values):
            out[f"model.layers.{i}.mlp.act_fn.{name}"] = np.full(shape, v, np.float32)
    return out


def model_tensors(reader: gguf.GGUFReader) -> list[Any]:
    """The tensors that are weights (not LongRoPE's factors or Llama 3.1's divisors), of the
    blocks the model runs: not a multi-token-prediction head's (the last
    `nextn_predict_layers` blocks)."""
    arch = require_meta(reader, "general.architecture")
    mtp = int(meta_value(reader, f"{arch}.nextn_predict_layers", 0))
    first_mtp = int(meta_value(reader, f"{arch}.block_count", 0)) - mtp if mtp else None

    def runs(name: str) -> bool:
        parts = name.split(".", 2)
        return not (
            first_mtp is not None
            and parts[0] == "blk"
            and len(parts) > 1
            and int(parts[1]) >= first_mtp
        )

    return [
        t
        for t in reader.tensors
        if t.name not in ROPE_FACTORS and t.name != ROPE_FREQS and runs(t.name)
    ]


def hf_name(spec: Arch, name: str) -> str:
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in spec.params:
        return f"{spec.layer_prefix}.{int(parts[1])}.{spec.params[parts[2]]}"
    base, _, kind = name.rpartition(".")
    if kind in ("weight", "bias"):
        if base in spec.globals:
            return f"{spec.globals[base]}.{kind}"
        parts = base.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in spec.layers:
            return f"{spec.layer_prefix}.{int(parts[1])}.{spec.layers[parts[2]]}.{kind}"
    # e.g. an unknown per-model tensor: silently dropping it would change the model.
    raise CheckpointError(f"unsupported GGUF tensor {name!r}")
