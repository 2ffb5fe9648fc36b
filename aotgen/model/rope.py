"""RoPE tables: the inverse frequencies of a config, scaled as it asks (linear, Llama 3,
LongRoPE, YaRN, as transformers computes them), and the cos/sin tables the graphs index by
position (Ministral 3's q gain beside them: `query_gain`); `for_context` picks LongRoPE's
factors for a package's context."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # ModelConfig.from_hf checks a config's scaling with rope_inv_freq
    from aotgen.model.config import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, scaled: bool = True) -> Tensor:
    """Inverse RoPE frequencies, scaled as the config asks (linear, Llama 3, LongRoPE, YaRN)."""
    dim = cfg.rotary_dim or cfg.head_dim
    base = cfg.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = (cfg.rope_scaling or {}) if scaled else {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "longrope":
        factors = scaling["long_factor" if cfg.long_context else "short_factor"]
        if len(factors) != len(inv_freq):
            raise ValueError(
                f"config.json: longrope factors have {len(factors)} values, the rotary dims "
                f"{len(inv_freq)} pairs"
            )
        return inv_freq / torch.tensor(factors, dtype=torch.float64)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, dim, base, scaling, cfg)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled_freq = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(is_mid, mid, scaled_freq)
    raise ValueError(
        f"config.json: rope_scaling type {kind!r} is not supported; supported: "
        f"{', '.join(ROPE_TYPES)}"
    )


def _yarn_factor(scaling: dict, cfg: ModelConfig) -> float:
    return (
        scaling.get("factor")
        or cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
    )


def _yarn_inv_freq(
    inv_freq: Tensor, dim: int, base: float, scaling: dict, cfg: ModelConfig
) -> Tensor:
    """YaRN (Qwen2.5 / Qwen3 long context): dims that turn fewer than `beta_slow` times over
    the original context are interpolated by the factor, those turning more than `beta_fast`
    times kept, a linear ramp between (transformers' `_compute_yarn_parameters`)."""
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = (
        correction_dim(scaling.get("beta_fast") or 32),
        correction_dim(scaling.get("beta_slow") or 1),
    )
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / _yarn_factor(scaling, cfg) * ramp + inv_freq * (1 - ramp)


def rope_tables(
    cfg: ModelConfig, length: int, theta: float | None = None, scaled: bool = True
) -> tuple[Tensor, Tensor]:
    """cos/sin tables `[length, rotary_dim]` in HF's rotate-half layout."""
    positions = torch.arange(length, dtype=torch.float64)
    freqs = torch.outer(positions, rope_inv_freq(cfg, theta, scaled))
    emb = torch.cat([freqs, freqs], dim=-1)
    gain = _rope_gain(cfg) if scaled else 1.0
    return (emb.cos() * gain).float(), (emb.sin() * gain).float()


def query_gain(cfg: ModelConfig, length: int) -> Tensor | None:
    """Ministral 3's scale of q per position `[length, 1]` (transformers'
    `get_llama_4_attn_scale`), or None where the family has none."""
    if not cfg.query_gain_beta:
        return None
    periods = torch.arange(length, dtype=torch.float64) // cfg.query_gain_period
    return (1 + cfg.query_gain_beta * torch.log1p(periods)).float().unsqueeze(-1)


def _rope_gain(cfg: ModelConfig) -> float:
    """LongRoPE's and YaRN's attention factor on cos and sin (1 for other scalings), as
    transformers derives it: given, else from the context's growth over the original."""
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    if kind == "longrope":
        factor = scaling.get("factor") or cfg.max_position_embeddings / original
        return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = _yarn_factor(scaling, cfg)
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def for_context(cfg: ModelConfig, max_seq_len: int) -> ModelConfig:
    """The config of a package serving `max_seq_len` tokens: LongRoPE takes its long factors
    when that passes the original context (llama.cpp's rule: one set for every position, so
    the keys in the cache all rotate alike), else its short ones."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return cfg
    return replace(cfg, long_context=max_seq_len > scaling["original_max_position_embeddings"])
