"""The language model inside a vision-language checkpoint (Gemma 3 4B and up, Mistral Small
3.x, Ministral 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL (-MoE), Qwen3.5 and Qwen3.5-MoE): its `text_config`
(Qwen2-VL's and Qwen2.5-VL's: the top-level keys, in transformers 4.x's checkpoints) read as the
text family's own config, and its tensors under the text family's names; the vision tower and
projector are left out, so the package takes text only. The Qwen VL models' multimodal RoPE
gives text the same position on all its axes, which is plain RoPE."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

# The vision-language architectures, and the text architecture of each `text_config`
# model_type they hold.
TEXT_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
    "Mistral3ForConditionalGeneration": {
        "mistral": "MistralForCausalLM",
        "ministral3": "Ministral3ForCausalLM",
    },
    "Qwen2VLForConditionalGeneration": {"qwen2_vl_text": "Qwen2ForCausalLM"},
    "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": "Qwen2ForCausalLM"},
    "Qwen3VLForConditionalGeneration": {"qwen3_vl_text": "Qwen3ForCausalLM"},
    "Qwen3VLMoeForConditionalGeneration": {"qwen3_vl_moe_text": "Qwen3MoeForCausalLM"},
    "Qwen3_5ForConditionalGeneration": {"qwen3_5_text": "Qwen3_5ForCausalLM"},
    "Qwen3_5MoeForConditionalGeneration": {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"},
}
# transformers' defaults of each text config class, for the keys the model reads besides RoPE's
# (hf_config.py's defaults are the families' own, in either dialect): a `text_config` written by
# transformers 4.x keeps only the values that differ from them.
TEXT_DEFAULTS: dict[str, dict] = {
    "gemma3_text": dict(
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        sliding_window=4096,
        query_pre_attn_scalar=256,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_act="silu",
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        sliding_window=4096,
    ),
}
TEXT_DEFAULTS["ministral3"] = dict(
    TEXT_DEFAULTS["mistral"],
    vocab_size=131072,
    num_hidden_layers=34,
    head_dim=128,
    max_position_embeddings=262144,
    rms_norm_eps=1e-5,
    sliding_window=None,
    rope_parameters={  # the family exists in transformers 5.x only: one dialect
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 16.0,
        "original_max_position_embeddings": 16384,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
)
TEXT_DEFAULTS["qwen2_vl_text"] = dict(
    vocab_size=152064,
    hidden_size=8192,
    intermediate_size=29568,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
)
TEXT_DEFAULTS["qwen2_5_vl_text"] = TEXT_DEFAULTS["qwen2_vl_text"]
TEXT_DEFAULTS["qwen3_vl_text"] = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_theta=5e5,
)
TEXT_DEFAULTS["qwen3_vl_moe_text"] = {
    **TEXT_DEFAULTS["qwen3_vl_text"],
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "moe_intermediate_size": 1408,
    "num_local_experts": 60,
    "num_experts_per_tok": 4,
}
# transformers 4.x's Qwen2-VL and Qwen2.5-VL configs: no `text_config`, the language model's
# keys at the top level, beside `vision_config`.
FLAT_TEXT_KINDS = {"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text"}
TEXT_DEFAULTS["qwen3_5_text"] = dict(  # 5.x only: one dialect
    vocab_size=248320,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
TEXT_DEFAULTS["qwen3_5_moe_text"] = {
    **{k: v for k, v in TEXT_DEFAULTS["qwen3_5_text"].items() if k != "intermediate_size"},
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 256,
    "num_experts_per_tok": 8,
}
# Where the language model's tensors lie, in the layout saved by transformers 4.x and the
# one 5.x builds in memory (and some checkpoints ship), → the text family's names.
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.visual.",  # Qwen3-VL's, Qwen3.5's
    "visual.",  # Qwen2-VL's, Qwen2.5-VL's
)


def is_multimodal(config: dict) -> bool:
    return (config.get("architectures") or [None])[0] in TEXT_ARCHITECTURES


def text_config(config: dict, tensor_names: Iterable[str]) -> dict:
    """The language model's config: `text_config` under its text architecture, over its
    class's defaults, with the checkpoint's quantization scheme. The head is tied exactly when
    the checkpoint holds none, as transformers loads it."""
    arch = config["architectures"][0]
    text = dict(config.get("text_config") or {})
    if not text and config.get("model_type") in FLAT_TEXT_KINDS:
        text = {k: v for k, v in config.items() if k not in ("vision_config", "architectures")}
        text["model_type"] = FLAT_TEXT_KINDS[config["model_type"]]
    kind = text.get("model_type")
    text_arch = TEXT_ARCHITECTURES[arch].get(kind)
    if text_arch is None:
        raise ValueError(
            f"config.json: {arch}'s text_config model_type {kind!r} is not supported; "
            f"supported: {', '.join(TEXT_ARCHITECTURES[arch])}"
        )
    text = {**TEXT_DEFAULTS[kind], **text}
    if arch == "Gemma3ForConditionalGeneration":  # its head is not softcapped (transformers')
        text["final_logit_softcapping"] = None
    if kind == "qwen3_vl_moe_text":  # its router always renormalises the top k
        text["norm_topk_prob"] = True
    if "quantization_config" in config:  # the scheme covers the whole checkpoint
        text["quantization_config"] = config["quantization_config"]
    text["architectures"] = [text_arch]
    text["tie_word_embeddings"] = not any(text_name(n) == "lm_head.weight" for n in tensor_names)
    return text


def text_tensor(text: dict, name: str, tensor: Tensor) -> Tensor:
    """A language-model tensor as its text family holds it (`text`: the text config):
    Qwen3-VL-MoE's released checkpoints store each layer's stacked experts transposed
    (`gate_up_proj [E, d, 2f]`, `down_proj [E, f, d]`), transformers 5's saves as it holds
    them; as transformers does, those not in the held shape are transposed."""
    if text.get("model_type") != "qwen3_vl_moe_text":
        return tensor
    d, f = text["hidden_size"], text["moe_intermediate_size"]
    held = {"mlp.experts.gate_up_proj": (2 * f, d), "mlp.experts.down_proj": (d, f)}
    for leaf, shape in held.items():
        if name.endswith(leaf) and tuple(tensor.shape[1:]) != shape:
            return tensor.transpose(1, 2).contiguous()
    return tensor


def text_name(name: str) -> str | None:
    """A tensor's name in the text family's layout; None for the vision tower's and the
    projector's. Other names are kept as they are, so that the model names any it cannot
    place."""
    if name.startswith(VISION_PREFIXES):
        return None
    for prefix, text in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return text + name.removeprefix(prefix)
    return name
