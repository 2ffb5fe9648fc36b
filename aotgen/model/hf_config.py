"""Reading an HF `config.json` of a supported architecture into `ModelConfig`'s fields.

Both config.json dialects are read: transformers 4.x (`rope_theta`, `rope_scaling`,
`rotary_pct`, `rope_local_base_freq`) and 5.x (`rope_parameters`). Any key the model would
otherwise silently ignore is refused with a one-line error naming it.
"""

from __future__ import annotations

from typing import Any

from aotgen.model.config import (
    ACTIVATIONS,
    APERTUS,
    COHERE,
    COHERE2,
    DEEPSEEK_MOE,
    DEEPSEEK_V2,
    DOTS1,
    ERNIE4_5_MOE,
    EXAONE_MOE,
    GEMMAS,
    GLM4_MOE,
    GPT_OSS,
    GRANITE_SHARED_MLP,
    GRANITE_SWA,
    GRANITES,
    HUNYUAN_MOE,
    HUNYUANS,
    LATENT_ATTENTION,
    LATER_GEMMAS,
    LAYERNORM_LAYOUT,
    LFM2,
    MELLUM,
    MOE_ARCHITECTURES,
    NEMOTRON,
    OLMO,
    OLMO_HYBRID,
    PHI,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_NEXT,
    SOLAR_OPEN,
    STABLELM,
    STARCODER2,
    SUPPORTED_ARCHITECTURES,
    WINDOW_SWITCHED,
)
from aotgen.model.hf_latent import latent_fields, with_defaults
from aotgen.model.hf_rope import query_gain_fields, read_rope, rotary_factor


def hf_fields(hf: dict) -> dict[str, Any]:
    """`ModelConfig`'s fields for an HF `config.json` dict; refuses what the model cannot
    represent."""
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for key in (
        "rope_theta",
        "rms_norm_eps",
        "layer_norm_eps",
        "norm_epsilon",
        "norm_eps",
        "rope_local_base_freq",
    ):
        _positive(hf, key)
    for key in SIZES:
        _positive(hf, key, whole=True)
    if arch in (QWEN3_5_MOE, SOLAR_OPEN):  # every MLP sparse: no dense width of its own
        hf = {"intermediate_size": hf.get("moe_intermediate_size"), **hf}
    if arch in LATENT_ATTENTION:
        hf = with_defaults(hf, arch)
    heads = hf["num_attention_heads"]
    theta, scaling, local = read_rope(hf, arch)
    common: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf.get("shared_intermediate_size") or hf["intermediate_size"]
        if arch in GRANITE_SHARED_MLP
        else hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=hf.get(
            "tie_word_embeddings", arch in (*GEMMAS, STARCODER2, COHERE, COHERE2)
        ),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        architecture=arch,
    )
    if scaling and "rope_type" not in scaling and "type" in scaling:  # 4.x's older key
        scaling = {"rope_type": scaling["type"], **scaling}
        common["rope_scaling"] = scaling
    kind = (scaling or {}).get("rope_type")
    if kind in ("longrope", "yarn"):
        original = scaling.get("original_max_position_embeddings")
        original = original or hf.get("original_max_position_embeddings")
        if not original:
            raise ValueError(f"config.json: {kind} needs original_max_position_embeddings")
        common["rope_scaling"] = {**scaling, "original_max_position_embeddings": original}
    family = _gpt_neox if arch == "GPTNeoXForCausalLM" else _llama_layout
    family = _lfm2 if arch in LFM2 else family
    family = _qwen3_5 if arch in QWEN3_5 else family
    family = _layernorm_layout if arch in LAYERNORM_LAYOUT else family
    return {**common, **family(hf, arch, common, local)}


# The sizes every family reads: a count, where present (a config may leave some to defaults).
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def _positive(hf: dict, key: str, whole: bool = False) -> None:
    """`key`, where present, a number > 0 (`whole`: a whole number >= 1)."""
    value = hf.get(key)
    kinds = int if whole else int | float
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, kinds) or value <= 0
    ):
        what = "a whole number >= 1" if whole else "a positive number"
        raise ValueError(f"config.json: {key} must be {what}, got {value!r}")


def _refuse(hf: dict, key: str, allowed: Any, why: str) -> None:
    """A key whose value the model would not honour: a one-line error naming it."""
    value = hf.get(key)
    if value not in (None, allowed):
        raise ValueError(f"config.json: {key}={value!r} is not supported ({why})")


def _llama_layout(hf: dict, arch: str, common: dict, local: float | None) -> dict[str, Any]:
    """Llama, Mistral, Qwen2, Qwen3 and Gemma 3: one module layout, a few switches."""
    default_act = "xielu" if arch == APERTUS else "silu"  # transformers' where none is named
    act = hf.get("hidden_activation") or hf.get("hidden_act") or default_act
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act={act!r} is not supported; {ACTIVATIONS}")
    if act == "xielu" and arch != APERTUS:
        raise ValueError(f"config.json: hidden_act='xielu' is Apertus's, not {arch}'s")
    _refuse(hf, "mlp_bias", False, "MLP biases")
    _refuse(hf, "use_bias", False, "biases on every linear")  # ERNIE 4.5
    if arch in GEMMAS:
        _refuse(hf, "use_bidirectional_attention", False, "causal attention only")
    eps = 1e-5 if arch == OLMO else hf.get("rms_norm_eps", 1e-6)  # OLMo 1's LayerNorms: fixed
    out: dict[str, Any] = {"hidden_act": act, "rms_norm_eps": eps}
    rotary = rotary_factor(hf)
    # Phi-4-mini rotates 3/4 of each head, GLM-4 and GLM-4.5 half
    if arch in ("Phi3ForCausalLM", "Glm4ForCausalLM", GLM4_MOE) and rotary != 1.0:
        out["rotary_dim"] = int(common["head_dim"] * rotary)
        if out["rotary_dim"] % 2 or not out["rotary_dim"]:
            raise ValueError(f"config.json: partial_rotary_factor={rotary}: an odd or empty dim")
    elif rotary != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor={rotary} is not supported on {arch}")
    layers = common["num_hidden_layers"]
    out.update(_smollm3(hf, layers) if arch == "SmolLM3ForCausalLM" else {})
    out.update(_granite(hf, arch, layers) if arch in GRANITES else {})
    dense_granite = arch == "GraniteMoeHybridForCausalLM" and not hf.get("num_local_experts")
    if arch in (*DEEPSEEK_MOE, DEEPSEEK_V2):
        out.update(_deepseek_moe(hf, arch, layers, act))
    elif arch == ERNIE4_5_MOE:
        out.update(_ernie_moe(hf, layers, act))
    elif arch == HUNYUAN_MOE:
        out.update(_hunyuan_moe(hf, layers, act))
    elif arch in MOE_ARCHITECTURES and not dense_granite:
        out.update(_moe(hf, arch, layers, act))
    out.update(_attention(hf, arch))
    if arch in LATENT_ATTENTION:
        out.update(latent_fields(hf, arch, common["rope_scaling"]))
    out.update(_windows(hf, arch, layers, local))
    out.update(query_gain_fields(hf, arch))
    return out


def _attention(hf: dict, arch: str) -> dict[str, Any]:
    """Biases on q, k, v and the norms around attention, per family."""
    out: dict[str, Any] = {}
    if arch == "Qwen2ForCausalLM":
        out["attention_bias"] = True  # Qwen2 always has q/k/v biases
    elif arch == "Qwen2MoeForCausalLM":
        out["attention_bias"] = bool(hf.get("qkv_bias", True))
    elif arch == "Glm4ForCausalLM":
        out["attention_bias"] = bool(hf.get("attention_bias", True))
    elif arch in DEEPSEEK_MOE or arch in LATENT_ATTENTION:  # biased or not (GLM-4.5: biased)
        out["attention_bias"] = bool(hf.get("attention_bias", False))
    elif arch == GPT_OSS:  # q, k, v and o biased; a sink logit per head
        bias = bool(hf.get("attention_bias", True))
        out.update(attention_bias=bias, attention_out_bias=bias, attention_sinks=True)
    elif arch == "SeedOssForCausalLM":  # q, k, v biased by default, o by its own switch
        out["attention_bias"] = bool(hf.get("attention_bias", True))
        out["attention_out_bias"] = bool(hf.get("attention_out_bias", False))
    elif arch == "HeliumForCausalLM":  # q, k and v biased or not, o never
        out["attention_bias"] = bool(hf.get("attention_bias", False))
    else:
        _refuse(hf, "attention_bias", False, f"attention biases on {arch}")
    if arch in WINDOW_SWITCHED:
        _refuse(hf, "use_sliding_window", False, f"sliding-window attention on {arch}")
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", APERTUS, DOTS1, MELLUM):
        out["qk_norm"] = True
    if arch == GLM4_MOE:
        out["qk_norm"] = bool(hf.get("use_qk_norm", False))
    if arch in ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "FlexOlmoForCausalLM"):
        out.update(qk_norm=True, qk_norm_across_heads=True, norm_after=True)
    if arch == "Exaone4ForCausalLM":  # OLMo 2's norms after each block, q/k norms per head
        out.update(qk_norm=True, norm_after=True)
    if arch == EXAONE_MOE:  # EXAONE 4's attention, the norms before each block
        out["qk_norm"] = True
    if arch in HUNYUANS:  # per-head q/k norms, on the rotated q and k
        _refuse(hf, "use_cla", False, "KV caches shared across layers")
        qk_norm = bool(hf.get("use_qk_norm", True))
        out.update(qk_norm=qk_norm, qk_norm_after_rope=qk_norm)
    if arch == "OlmoeForCausalLM":  # OLMo 2's q/k norms, the norms before each block
        out.update(qk_norm=True, qk_norm_across_heads=True)
    if arch in (OLMO, "OlmoeForCausalLM") and hf.get("clip_qkv") is not None:
        _positive(hf, "clip_qkv")
        out["clip_qkv"] = float(hf["clip_qkv"])
    return out


def _windows(hf: dict, arch: str, layers: int, local: float | None) -> dict[str, Any]:
    """Which layers attend through a sliding window, and how wide it is."""
    out: dict[str, Any] = {}
    if arch in (
        "MistralForCausalLM",
        "Ministral3ForCausalLM",
        "MixtralForCausalLM",
        "Phi3ForCausalLM",
        STARCODER2,
    ) and hf.get("sliding_window"):
        out["sliding_window"] = hf["sliding_window"]
        out["layer_types"] = ("sliding_attention",) * layers
    elif arch in ("MinistralForCausalLM", DOTS1) and hf.get("sliding_window"):  # layer_types
        types = hf.get("layer_types") or ["sliding_attention"] * layers
        out.update(sliding_window=hf["sliding_window"], layer_types=tuple(types))
    elif arch in LATER_GEMMAS:
        out.update(_gemma(hf, arch, layers, local))
    elif arch in ("Exaone4ForCausalLM", EXAONE_MOE, COHERE2) and hf.get("sliding_window", 4096):
        out.update(_local_layers_rotate(hf, layers))
    elif arch == GPT_OSS and hf.get("sliding_window", 128):  # sliding and full layers alternate
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ]
        out.update(sliding_window=hf.get("sliding_window", 128), layer_types=tuple(types))
    elif arch == MELLUM and hf.get("sliding_window"):  # sliding layers of their own base
        types = hf.get("layer_types") or ["full_attention"] * layers
        out.update(sliding_window=hf["sliding_window"], layer_types=tuple(types))
        if local is not None:
            out["rope_local_theta"] = float(local)
    elif arch == GRANITE_SWA:
        out.update(_granite_swa(hf, layers))
    elif arch == "Olmo3ForCausalLM":  # three sliding-window layers in four
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)
        ]
        out.update(sliding_window=hf.get("sliding_window", 4096), layer_types=tuple(types))
        if local is not None:  # per layer type: the sliding layers' base, never scaled
            out["rope_local_theta"] = float(local)
    elif hf.get("sliding_window") is not None and not (
        arch in WINDOW_SWITCHED and not hf.get("use_sliding_window")
    ):
        raise ValueError(f"config.json: sliding_window is not supported on {arch}")
    if arch not in LATER_GEMMAS:
        _refuse(hf, "final_logit_softcapping", None, f"not part of {arch}")
        _refuse(hf, "attn_logit_softcapping", None, f"not part of {arch}")
    types = out.get("layer_types") or hf.get("layer_types") or ()
    types = () if arch == "GraniteMoeHybridForCausalLM" else types  # all global: _granite
    if any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"config.json: layer_types {sorted(set(types))} are not supported")
    if "layer_types" not in out and "sliding_attention" in types:
        raise ValueError(f"config.json: layer_types with sliding_attention on {arch}")
    if out.get("layer_types") is not None and len(out["layer_types"]) != layers:
        raise ValueError("config.json: layer_types must name every one of num_hidden_layers")
    return out


def _granite_swa(hf: dict, layers: int) -> dict[str, Any]:
    """Granite SWA: three sliding layers in four by default (the first of each four full),
    a sink logit per head, and `layer_rope_theta`, a RoPE base per layer (0: no RoPE), read as
    one base for the full layers and one for the sliding ones."""
    types = hf.get("layer_types") or [
        "full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)
    ]
    out: dict[str, Any] = {
        "sliding_window": hf.get("sliding_window", 128),
        "layer_types": tuple(types),
        "attention_sinks": True,
    }
    thetas = hf.get("layer_rope_theta")
    if thetas is None:
        return out
    if len(thetas) != layers:
        raise ValueError("config.json: layer_rope_theta must name every one of num_hidden_layers")
    full, sliding = (
        {t for t, k in zip(thetas, types, strict=True) if t and k == kind}
        for kind in ("full_attention", "sliding_attention")
    )
    if len(full) > 1 or len(sliding) > 1:
        raise ValueError(
            "config.json: layer_rope_theta with more than one base among the full or the "
            "sliding layers is not supported"
        )
    full, sliding = (next(iter(bases), None) for bases in (full, sliding))
    if full is not None and sliding is not None and full != sliding:
        if (hf.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise ValueError(
                "config.json: layer_rope_theta with two bases and RoPE scaling is not supported"
            )
        out["rope_local_theta"] = float(sliding)
    return {
        **out,
        "rope_theta": float(full or sliding or 10000.0),
        "rope_layers": tuple(bool(t) for t in thetas),
    }


def _local_layers_rotate(hf: dict, layers: int) -> dict[str, Any]:
    """EXAONE 4's and Cohere2's sliding and global layers (`layer_types`, or a pattern: a
    period, three sliding layers in four by default, or EXAONE's "L"/"G" letters repeated
    with the last layer global); only the sliding layers rotate."""
    pattern = hf.get("sliding_window_pattern", 4)
    types = hf.get("layer_types")
    if not types and isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        local = [pattern[i % len(pattern)] == "L" and i < layers - 1 for i in range(layers)]
        types = ["sliding_attention" if s else "full_attention" for s in local]
    elif not types and isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    elif not types:
        raise ValueError(f"config.json: sliding_window_pattern={pattern!r} is not supported")
    return {
        "sliding_window": hf.get("sliding_window", 4096),
        "layer_types": tuple(types),
        "rope_layers": tuple(t == "sliding_attention" for t in types),
    }


def _gemma(hf: dict, arch: str, layers: int, local: float | None) -> dict[str, Any]:
    """Gemma 2 and 3: sliding and global layers (Gemma 2 alternates them, Gemma 3 has one
    global in six, with its own RoPE base), softcapped logits; Gemma 2 caps the attention
    scores too, Gemma 3 normalises q and k instead."""
    gemma3 = arch == "Gemma3ForCausalLM"
    if gemma3:
        _refuse(hf, "attn_logit_softcapping", None, "transformers' Gemma 3 does not apply it")
    types = hf.get("layer_types")
    if types is None:
        pattern = 2
        if gemma3:
            pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    return dict(
        qk_norm=gemma3,
        sliding_window=hf.get("sliding_window", 4096),
        layer_types=tuple(types),
        rope_local_theta=float(local or 10000.0) if gemma3 else None,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        attn_logit_softcapping=None if gemma3 else hf.get("attn_logit_softcapping"),
    )


def _moe(hf: dict, arch: str, layers: int, act: str) -> dict[str, Any]:
    """Experts, top-k and the sparse layers: Qwen-MoE's `decoder_sparse_step` and
    `mlp_only_layers` (dense MLPs there), every layer elsewhere."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    top_k = hf.get("num_experts_per_tok") or 0
    if not 1 <= top_k <= experts:
        raise ValueError(
            f"config.json: num_experts_per_tok={top_k} must be from 1 to the number of "
            f"experts ({experts})"
        )
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r}: the experts are SwiGLU (silu) only")
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or ())
    qwen = arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", QWEN3_NEXT)
    shared = {
        "Qwen2MoeForCausalLM": hf.get("shared_expert_intermediate_size"),
        QWEN3_5_MOE: hf.get("shared_expert_intermediate_size"),
        QWEN3_NEXT: hf.get("shared_expert_intermediate_size"),
        "GraniteMoeSharedForCausalLM": hf.get("shared_intermediate_size"),
        "GraniteMoeHybridForCausalLM": hf.get("shared_intermediate_size"),
    }.get(arch)
    gpt_oss = {}
    if arch == GPT_OSS:  # biased router and experts, the experts' clamped SwiGLU
        for key in ("swiglu_limit", "swiglu_alpha"):
            _positive(hf, key)
        gpt_oss = dict(
            router_bias=True,
            expert_biases=True,
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        )
    return gpt_oss | dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
        # Mixtral renormalises; Granite's and gpt-oss's softmax over the top-k logits is the same
        norm_topk_prob=arch in ("MixtralForCausalLM", GPT_OSS, QWEN3_5_MOE)
        or arch in GRANITES
        or bool(hf.get("norm_topk_prob", arch == QWEN3_NEXT)),  # Qwen3-Next's default: True
        shared_expert_intermediate_size=shared or 0,
        shared_expert_gated=arch in ("Qwen2MoeForCausalLM", QWEN3_5_MOE, QWEN3_NEXT),
        moe_layers=_mlp_layer_types(hf, layers)
        or tuple(not qwen or (i not in dense and (i + 1) % step == 0) for i in range(layers)),
    )


def _mlp_layer_types(hf: dict, layers: int) -> tuple[bool, ...]:
    """Which layers are sparse by `mlp_layer_types` ("dense" / "sparse" a layer: K-EXAONE,
    Mellum); () where the config has none."""
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        return ()
    if len(kinds) != layers or any(k not in ("dense", "sparse") for k in kinds):
        raise ValueError("config.json: mlp_layer_types must name dense or sparse for every layer")
    return tuple(kind == "sparse" for kind in kinds)


def _deepseek_moe(hf: dict, arch: str, layers: int, act: str) -> dict[str, Any]:
    """DeepSeek-V3's mixture of experts (its own, GLM-4.7-Flash, GLM-4.5, dots.llm1, Solar
    Open, K-EXAONE): `n_routed_experts` (K-EXAONE: `num_experts`) picked by sigmoid score plus
    `e_score_correction_bias` within the `topk_group` best of `n_group` groups, weighted by the
    score (renormalised where `norm_topk_prob`) times `routed_scaling_factor`;
    `n_shared_experts` (`num_shared_experts`) experts' width in one ungated shared MLP on every
    token; the first `first_k_dense_replace` layers dense, or those `mlp_layer_types` names.
    DeepSeek-V2's picks by softmax probability, within the best groups by their best one
    under `topk_method: group_limited_greedy`, and weighs by the probabilities as they are."""
    v2 = arch == DEEPSEEK_V2
    _refuse(hf, "scoring_func", "softmax" if v2 else "sigmoid", "routing")
    method = hf.get("topk_method", "greedy" if v2 else "noaux_tc")
    if method not in (("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)):
        raise ValueError(f"config.json: topk_method={method!r} is not supported on {arch}")
    if v2:  # what transformers' DeepSeek-V2 runs
        _refuse(hf, "norm_topk_prob", False, "DeepSeek-V2 weighs by the probabilities as they are")
        _refuse(hf, "moe_layer_freq", 1, "every layer after the dense ones sparse")
    _positive(hf, "routed_scaling_factor")
    experts = hf.get("n_routed_experts") or hf.get("num_experts") or 0
    out = _moe({**hf, "num_experts": experts}, arch, layers, act)
    groups, top_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if method == "greedy":
        groups = top_groups = 1
    if experts % groups or not 1 <= top_groups <= groups or (groups > 1 and experts < 2 * groups):
        raise ValueError(
            f"config.json: n_group={groups}, topk_group={top_groups} with {experts} experts: "
            "the groups must split the experts evenly, two or more each, and topk_group must "
            "be from 1 to n_group"
        )
    if out["num_experts_per_tok"] > top_groups * experts // groups:
        raise ValueError(
            f"config.json: num_experts_per_tok={out['num_experts_per_tok']} is more than the "
            f"{top_groups} kept groups hold ({top_groups * experts // groups})"
        )
    dense = hf.get("first_k_dense_replace", 1 if arch in (GLM4_MOE, EXAONE_MOE) else 0)
    shared = hf.get("n_shared_experts", hf.get("num_shared_experts")) or 0
    return {
        **out,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", arch == GLM4_MOE)),
        "router_sigmoid": not v2,
        "expert_bias": not v2,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "router_groups": groups,
        "router_top_groups": top_groups,
        "router_group_rank": 1 if v2 else 2,
        "shared_expert_intermediate_size": out["moe_intermediate_size"] * shared,
        "moe_layers": _mlp_layer_types(hf, layers) or tuple(i >= dense for i in range(layers)),
    }


def _ernie_moe(hf: dict, layers: int, act: str) -> dict[str, Any]:
    """ERNIE 4.5's mixture of experts: `moe_k` of `moe_num_experts` picked by softmax
    probability plus `e_score_correction_bias`, weighted by the probabilities renormalised
    (their sum at least `moe_norm_min`); `moe_num_shared_experts` experts' width in one
    ungated shared MLP; sparse from `moe_layer_start_index` to `moe_layer_end_index` (-1: the
    last), every `moe_layer_interval`-th layer."""
    hf = {**hf, "num_experts": hf.get("moe_num_experts", 64)}
    out = _moe({**hf, "num_experts_per_tok": hf.get("moe_k", 6)}, ERNIE4_5_MOE, layers, act)
    start, end = hf.get("moe_layer_start_index", 1), hf.get("moe_layer_end_index", -1)
    end = layers - 1 if end == -1 else end
    interval = hf.get("moe_layer_interval", 1)
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(f"config.json: moe_layer_interval must be 1 or more, got {interval!r}")
    norm_min = hf.get("moe_norm_min", 1e-12)
    if not isinstance(norm_min, int | float) or norm_min < 0:
        raise ValueError(f"config.json: moe_norm_min must be 0 or more, got {norm_min!r}")
    return {
        **out,
        "norm_topk_prob": True,
        "expert_bias": True,
        "router_norm_min": float(norm_min),
        "shared_expert_intermediate_size": out["moe_intermediate_size"]
        * (hf.get("moe_num_shared_experts", 2) or 0),
        "moe_layers": tuple((i + 1) % interval == 0 and start <= i <= end for i in range(layers)),
    }


def _hunyuan_moe(hf: dict, layers: int, act: str) -> dict[str, Any]:
    """Hunyuan's mixture of experts: `moe_topk` of `num_experts` experts of
    `intermediate_size` picked by softmax, renormalised, and one ungated shared MLP of the same
    width, on every layer. Per-layer lists are read where every layer's entry is the same."""
    same: dict[str, Any] = {}
    for key in ("num_experts", "moe_topk", "moe_intermediate_size", "num_shared_expert"):
        value = hf.get(key)
        values = set(value) if isinstance(value, list) else {value}
        if len(values) > 1:
            raise ValueError(f"config.json: {key} differs between layers, which is not supported")
        same[key] = values.pop()
    width = hf["intermediate_size"]
    shared = same["num_shared_expert"]
    if same["moe_intermediate_size"] not in (None, width) or shared not in (None, 1):
        raise ValueError(
            "config.json: Hunyuan's experts and shared MLP are intermediate_size wide, one "
            "shared MLP (moe_intermediate_size and num_shared_expert say otherwise)"
        )
    hf = {**hf, "num_experts": same["num_experts"], "num_experts_per_tok": same["moe_topk"]}
    return {
        **_moe(hf, HUNYUAN_MOE, layers, act),
        "norm_topk_prob": True,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width,
    }


def _smollm3(hf: dict, layers: int) -> dict[str, Any]:
    """SmolLM3: every `no_rope_layer_interval`-th layer attends without RoPE (NoPE)."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError("config.json: no_rope_layers must name every one of num_hidden_layers")
    return {"rope_layers": tuple(bool(f) for f in flags)}


def _granite(hf: dict, arch: str, layers: int) -> dict[str, Any]:
    """Granite's multipliers; Granite 4.0 (the hybrid config) with attention layers only, with
    RoPE or none (`position_embedding_type`)."""
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    for key in keys:
        _positive(hf, key)
    out: dict[str, Any] = {key: float(hf[key]) for key in keys if key in hf}
    if arch == "GraniteMoeHybridForCausalLM":
        types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"]
        if any(t not in ("attention", "full_attention") for t in types):
            raise ValueError(
                "config.json: Granite 4.0's Mamba layers (layer_types other than attention) "
                "are not supported; its attention-only models (granite-4.0-micro) are"
            )
        position = hf.get("position_embedding_type")
        if position not in (None, "rope"):
            raise ValueError(f"config.json: position_embedding_type={position!r} is not supported")
        if position is None:  # no positions at all
            out["rope_layers"] = (False,) * layers
    return out


def _lfm2(hf: dict, arch: str, common: dict, local: float | None) -> dict[str, Any]:
    """LFM2: gated short convolutions and attention layers (q/k norms), SwiGLU MLPs whose
    width is derived from `block_ff_dim` as transformers derives it, a tied head by default.
    LFM2-MoE: the MLPs after `num_dense_layers` are sparse, routed by sigmoid score."""
    layers = common["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "full_attention" if i in (hf.get("full_attn_idxs") or range(layers)) else "conv"
        for i in range(layers)
    ]
    if len(types) != layers or any(t not in ("conv", "full_attention") for t in types):
        raise ValueError(
            "config.json: LFM2's layer_types must name conv or full_attention for every layer"
        )
    kernel = hf.get("conv_L_cache", 3)
    if not isinstance(kernel, int) or kernel < 1:
        raise ValueError(f"config.json: conv_L_cache must be a positive integer, got {kernel!r}")
    if common["hidden_size"] % 2:
        raise ValueError("config.json: LFM2's hidden_size must be even")
    width = hf.get("block_ff_dim") or hf["intermediate_size"]
    moe = arch == "Lfm2MoeForCausalLM"
    if not moe and hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            step = hf.get("block_multiple_of", 256)
            width = step * -(-int(multiplier * width) // step)
    experts = _lfm2_moe(hf, layers) if moe else {}
    return {
        **experts,
        "intermediate_size": width,
        "rms_norm_eps": hf.get("norm_eps", 1e-5),
        "tie_word_embeddings": hf.get("tie_embedding", hf.get("tie_word_embeddings", True)),
        "qk_norm": True,
        "layer_types": tuple(types),
        "conv_kernel": kernel,
        "conv_bias": bool(hf.get("conv_bias", False)),
    }


def _qwen3_5(hf: dict, arch: str, common: dict, local: float | None) -> dict[str, Any]:
    """Qwen3.5: gated-delta-rule linear attention (`linear_attention` layers) beside full
    attention with per-head q/k norms, partial RoPE and a sigmoid gate on its output; every
    norm scales by (1 + w). Qwen3.5-MoE: sparse MLPs on every layer, the top-k renormalised,
    a shared expert behind a sigmoid gate. Qwen3-Next: Qwen3.5-MoE with Qwen2-MoE's dense
    layers."""
    layers = common["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0
        else "linear_attention"
        for i in range(layers)
    ]  # fmt: skip
    if len(types) != layers or any(t not in ("linear_attention", "full_attention") for t in types):
        raise ValueError(
            "config.json: Qwen3.5's layer_types must name linear_attention or full_attention "
            "for every layer"
        )
    _refuse(hf, "attention_bias", False, "biases on q/k/v/o")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act={act!r} is not supported on Qwen3.5 (silu)")
    olmo = arch == OLMO_HYBRID  # its defaults: as many key and value heads as attention heads
    key_heads = hf.get("linear_num_key_heads") or (common["num_attention_heads"] if olmo else 16)
    key_dim = hf.get("linear_key_head_dim") or (
        int(0.75 * common["hidden_size"] / key_heads) if olmo else 128
    )
    fields = {
        "linear_key_heads": key_heads,
        "linear_value_heads": hf.get("linear_num_value_heads") or (key_heads if olmo else 32),
        "linear_key_dim": key_dim,
        "linear_value_dim": hf.get("linear_value_head_dim") or (2 * key_dim if olmo else 128),
        "linear_conv_kernel": hf.get("linear_conv_kernel_dim", 4),
    }
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    if fields["linear_value_heads"] % fields["linear_key_heads"]:
        raise ValueError(
            "config.json: linear_num_value_heads must be a multiple of linear_num_key_heads"
        )
    if olmo:
        return {**fields, **_olmo_hybrid(hf, fields, types), "hidden_act": act}
    params = hf.get("rope_parameters") or {}  # transformers' default rotates a quarter
    rotary = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(common["head_dim"] * rotary)
    if rotary_dim % 2 or not rotary_dim:
        raise ValueError(f"config.json: partial_rotary_factor={rotary}: an odd or empty dim")
    experts = _moe(hf, arch, layers, act) if arch in (QWEN3_5_MOE, QWEN3_NEXT) else {}
    return {
        **fields,
        **experts,
        "hidden_act": act,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "linear_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "qk_norm": True,
        "rotary_dim": rotary_dim,
        "layer_types": tuple(types),
        "attention_output_gate": True,
    }


def _olmo_hybrid(hf: dict, fields: dict[str, int], types: list[str]) -> dict[str, Any]:
    """OLMo Hybrid: OLMo 3's attention layers (q/k norms across heads, each block's norm after
    it, the whole head rotated, or no RoPE where the config names no base) beside the
    linear-attention layers, whose beta is doubled where `linear_allow_neg_eigval`; plain
    RMSNorms, the rule's output norm at eps 1e-5."""
    if fields["linear_value_heads"] != fields["linear_key_heads"]:
        raise ValueError(
            "config.json: OLMo Hybrid's linear_num_value_heads must equal linear_num_key_heads"
        )
    params = hf.get("rope_parameters") or {}
    nope = params.get("rope_theta", hf.get("rope_theta")) is None
    return {
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "linear_norm_eps": 1e-5,  # transformers' (FLA's gated norm default)
        "linear_beta_scale": 2.0 if hf.get("linear_allow_neg_eigval", True) else 1.0,
        "qk_norm": True,
        "qk_norm_across_heads": True,
        "norm_after": True,
        "layer_types": tuple(types),
        "rope_layers": (False,) * len(types) if nope else None,
    }


def _lfm2_moe(hf: dict, layers: int) -> dict[str, Any]:
    out = _moe(hf, "Lfm2MoeForCausalLM", layers, "silu")
    dense = hf.get("num_dense_layers", 2)
    _positive(hf, "routed_scaling_factor")
    return {
        **out,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "moe_layers": tuple(i >= dense for i in range(layers)),
        "router_sigmoid": True,
        "expert_bias": bool(hf.get("use_expert_bias", True)),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
    }


def _gpt_neox(hf: dict, arch: str, common: dict, local: float | None) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act={act!r} is not supported; {ACTIVATIONS}")
    has_factor = "rotary_pct" in hf or "partial_rotary_factor" in (hf.get("rope_parameters") or {})
    factor = rotary_factor(hf) if has_factor else 0.25  # transformers' default
    rotary_dim = int(common["head_dim"] * factor)
    if rotary_dim % 2 or rotary_dim == 0:
        raise ValueError(f"config.json: rotary_pct={factor} gives an odd or empty rotary dim")
    if common["hidden_size"] % common["num_attention_heads"]:
        raise ValueError("config.json: hidden_size must be a multiple of num_attention_heads")
    return {
        "hidden_act": act,
        "rms_norm_eps": hf.get("layer_norm_eps", 1e-5),
        "attention_bias": hf.get("attention_bias", True),
        "rotary_dim": rotary_dim,
        "use_parallel_residual": hf.get("use_parallel_residual", True),
    }


def _layernorm_layout(hf: dict, arch: str, common: dict, local: float | None) -> dict[str, Any]:
    """Phi, StableLM, StarCoder2, Cohere, Cohere2 and Nemotron: LayerNorms, biases, the first
    dims of each head rotated."""
    default_act = {PHI: "gelu_new", STARCODER2: "gelu_pytorch_tanh", NEMOTRON: "relu2"}
    act = hf.get("hidden_act", default_act.get(arch, "silu"))
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act={act!r} is not supported; {ACTIVATIONS}")
    has_factor = "partial_rotary_factor" in hf or "partial_rotary_factor" in (
        hf.get("rope_parameters") or {}
    )
    # transformers' defaults where config.json leaves the factor out
    default_rotary = {PHI: 0.5, STABLELM: 0.25, NEMOTRON: 0.5}
    rotary = rotary_factor(hf) if has_factor else default_rotary.get(arch, 1.0)
    rotary_dim = int(common["head_dim"] * rotary) if rotary != 1.0 else None
    if rotary_dim is not None and (rotary_dim % 2 or rotary_dim == 0):
        raise ValueError(f"config.json: partial_rotary_factor={rotary}: an odd or empty dim")
    if (
        arch == STABLELM
        and common["head_dim"] * common["num_attention_heads"] != common["hidden_size"]
    ):
        raise ValueError("config.json: StableLM's hidden_size must be heads x head_dim")
    bias = {
        PHI: (True, True),
        STABLELM: (bool(hf.get("use_qkv_bias", False)), False),
        STARCODER2: (bool(hf.get("use_bias", True)),) * 2,
        COHERE: (bool(hf.get("attention_bias", False)),) * 2,
        COHERE2: (bool(hf.get("attention_bias", False)),) * 2,
        NEMOTRON: (bool(hf.get("attention_bias", False)),) * 2,
    }[arch]
    if arch == NEMOTRON:  # one switch for the output projection's and the MLP's biases here
        _refuse(hf, "mlp_bias", bias[1], "MLP biases apart from attention_bias")
    eps_key = {STARCODER2: "norm_epsilon", NEMOTRON: "norm_eps"}.get(arch, "layer_norm_eps")
    eps = hf.get(eps_key)
    out = {
        "hidden_act": act,
        "rms_norm_eps": eps or 1e-5,
        "rotary_dim": rotary_dim,
        "attention_bias": bias[0],
        "linear_bias": bias[1],
        "qk_norm": bool(hf.get("qk_layernorm", hf.get("use_qk_norm", False))),
        "use_parallel_residual": arch in (PHI, COHERE, COHERE2)
        or bool(hf.get("use_parallel_residual", False)),
    }
    if arch == COHERE2:
        _refuse(hf, "use_qk_norm", False, "not part of Cohere2")
    if arch in (COHERE, COHERE2):
        _positive(hf, "logit_scale")
        out["logits_scaling"] = 1.0 / hf.get("logit_scale", 0.0625)
    return out | _windows(hf, arch, common["num_hidden_layers"], local)
