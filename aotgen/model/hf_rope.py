"""The RoPE keys of an HF `config.json` in either dialect (4.x `rope_theta` / `rope_scaling`,
5.x `rope_parameters`): the base and scaling of the global layers, the sliding layers' base,
the rotated share of each head, and Ministral 3's growth of q with the position."""

from __future__ import annotations

from typing import Any

from aotgen.model.config import APERTUS, GPT_OSS, HUNYUANS, LFM2

# gpt-oss's RoPE where its config names none: YaRN from a 4,096-position original context.
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


# Apertus's RoPE where its config names none (transformers' default): Llama 3's scaling.
APERTUS_ROPE = {
    "rope_theta": 12000000.0,
    "scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
}


def read_rope(hf: dict, arch: str) -> tuple[float, dict | None, float | None]:
    """(base, scaling of the global layers, base of the sliding layers) from either dialect."""
    params = hf.get("rope_parameters")
    local = hf.get("rope_local_base_freq")
    if isinstance(params, dict) and "full_attention" in params:  # 5.x, per layer type
        local = (params.get("sliding_attention") or {}).get("rope_theta", local)
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", hf.get("rope_theta"))
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}
        scaling.pop("partial_rotary_factor", None)
        scaling.pop("llama_4_scaling_beta", None)  # not RoPE's: query_gain_fields reads it
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = {"rope_type": kind, **scaling} if kind != "default" else None
    else:
        theta, scaling = hf.get("rope_theta"), hf.get("rope_scaling")
        if scaling:
            scaling = dict(scaling)
            _text_positions(scaling)
        theta = hf.get("rotary_emb_base", theta)  # GPT-NeoX 4.x
    if arch in HUNYUANS:
        theta, scaling = _ntk_alpha(theta or 10000.0, scaling, hf)
    if theta is None:
        theta = 1e6 if arch in ("Gemma3ForCausalLM", *LFM2) else 10000.0
        theta = 150000.0 if arch == GPT_OSS else theta
    if arch == GPT_OSS and "rope_parameters" not in hf and "rope_scaling" not in hf:
        scaling = GPT_OSS_YARN  # transformers' default for the family
    if arch == APERTUS and "rope_parameters" not in hf and "rope_scaling" not in hf:
        theta, scaling = APERTUS_ROPE["rope_theta"], APERTUS_ROPE["scaling"]
    if isinstance(hf.get("rope_parameters"), dict) and "sliding_attention" in hf["rope_parameters"]:
        kind = (hf["rope_parameters"]["sliding_attention"] or {}).get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"config.json: rope_parameters.sliding_attention {kind!r} scaling")
    if arch == "Gemma3ForCausalLM" and local is None:
        local = 10000.0
    return float(theta), scaling or None, local


def _text_positions(scaling: dict) -> None:
    """The Qwen VL models' multimodal RoPE (`mrope_section`, interleaved or not) without its
    keys: text has the same position on every axis, where it is plain RoPE."""
    if scaling.pop("mrope_section", None) is not None:
        scaling.pop("mrope_interleaved", None)
        if scaling.get("type") == "mrope":  # Qwen2-VL's name in transformers 4.x
            scaling["type"] = "default"
        if scaling.get("rope_type") == "mrope":
            scaling["rope_type"] = "default"


def _ntk_alpha(theta: float, scaling: dict | None, hf: dict) -> tuple[float, dict | None]:
    """Hunyuan's "dynamic" RoPE with a fixed `alpha`: a static stretch of the base,
    theta * alpha ** (d / (d - 2)), as transformers computes it; no scaling after."""
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "dynamic" or not scaling.get("alpha"):
        return theta, scaling or None
    dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return theta * float(scaling["alpha"]) ** (dim / (dim - 2)), None


def query_gain_fields(hf: dict, arch: str) -> dict[str, Any]:
    """Ministral 3's growth of q with the position (Llama 4's attention temperature), from its
    `rope_parameters`: `llama_4_scaling_beta` over periods of the original context."""
    params = hf.get("rope_parameters") or {}
    beta = params.get("llama_4_scaling_beta")
    if arch != "Ministral3ForCausalLM":
        if beta is not None:
            raise ValueError(f"config.json: llama_4_scaling_beta is not part of {arch}")
        return {}
    period = params.get("original_max_position_embeddings")
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not period:
        raise ValueError(
            "config.json: Ministral 3 needs rope_parameters.llama_4_scaling_beta and "
            "original_max_position_embeddings"
        )
    return {"query_gain_beta": float(beta), "query_gain_period": int(period)}


def rotary_factor(hf: dict) -> float:
    params = hf.get("rope_parameters")
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return float(factor or hf.get("rotary_pct") or hf.get("partial_rotary_factor") or 1.0)
