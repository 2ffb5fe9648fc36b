"""`Lfm2ForCausalLM` (Liquid AI's LFM2): most layers are gated short convolutions, the rest
GQA attention with per-head q/k norms; every layer has a SwiGLU MLP; norms before each block.

A convolution layer mixes each position with the `conv_kernel - 1` before it:
`out_proj(C * conv(B * x))`, with B, C, x the three thirds of `in_proj` and `conv` depthwise
over positions. What it remembers of the past is B·x at those positions, so its "state" is
kept like keys and values: written in place at each row's cache slot, read back by position
(layers.py `CausalLM._conv_history`). Speculative rows that are rejected, prefix reuse, batch
slots and token trees then need nothing of their own, as for attention. The layer's two cache
tensors (`[1, 1, cache_len, hidden / 2]`) hold the first and second half of B·x's channels.

LFM2-MoE (`Lfm2MoeForCausalLM`): the MLPs after the first `num_dense_layers` are sparse
(moe.py), experts picked by sigmoid score plus a per-expert bias.

Module names follow the HF checkpoint (`model.layers.0.conv.in_proj`, `feed_forward.w1`,
`model.embedding_norm` for the final norm) so weights load without a name map.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aotgen.kernels.cache_rows import decode_rows, encode_rows
from aotgen.model.config import ModelConfig
from aotgen.model.layers import (
    CacheIndex,
    CausalLM,
    RMSNorm,
    apply_rope,
    cached_attention,
)
from aotgen.model.moe import SparseMoE


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        d, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(heads * self.head_dim, d, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        b, t, _ = x.shape
        q = self.q_layernorm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = self.k_layernorm(self.k_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cached_attention(q, k, v, write_at, mask, k_cache, v_cache, span, self.scale)
        return self.out_proj(y)


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, kernel, bias = cfg.hidden_size, cfg.conv_kernel, cfg.conv_bias
        self.in_proj = nn.Linear(d, 3 * d, bias=bias)
        # transformers' depthwise Conv1d: weight [d, 1, kernel]; only its parameters are used.
        self.conv = nn.Conv1d(d, d, kernel, groups=d, bias=bias, padding=kernel - 1)
        self.out_proj = nn.Linear(d, d, bias=bias)

    def forward(self, x, cos, sin, write_at, history, k_cache, v_cache, span) -> Tensor:
        """`history` (layers.py `CausalLM._conv_history`): where each row's earlier positions are in
        the cache, lag 1 first, and which of them exist (none before position 0)."""
        d = x.shape[-1]
        gate_b, gate_c, h = self.in_proj(x).chunk(3, dim=-1)
        bx = gate_b * h  # [b, t, d]
        half = d // 2
        write_cache(k_cache, write_at, bx[..., :half])
        write_cache(v_cache, write_at, bx[..., half:])
        at, exists = history
        weight = self.conv.weight[:, 0].to(x.dtype)  # [d, kernel]; the last tap is the row itself
        kernel = weight.shape[1]
        out = bx * weight[:, kernel - 1]
        for lag in range(1, kernel):
            past = torch.cat(
                [
                    read_cache(k_cache, write_at, at[lag - 1], x.dtype),
                    read_cache(v_cache, write_at, at[lag - 1], x.dtype),
                ],
                dim=-1,
            )
            there = exists[lag - 1].unsqueeze(-1).to(x.dtype)
            out = out + past * weight[:, kernel - 1 - lag] * there
        if self.conv.bias is not None:
            out = out + self.conv.bias.to(x.dtype)
        return self.out_proj(gate_c * out)


def write_cache(cache: Tensor, write_at: CacheIndex, rows: Tensor) -> None:
    """`rows [b, t, c]` into a `[slots, 1, cache_len, c]` cache at `write_at`."""
    if isinstance(write_at, tuple):
        slots, positions = write_at
        cache[slots, :, positions] = encode_rows(rows.unsqueeze(2), cache.dtype)
    else:
        cache.index_copy_(2, write_at, encode_rows(rows.unsqueeze(1), cache.dtype))


def read_cache(
    cache: Tensor, write_at: CacheIndex, positions: Tensor, dtype: torch.dtype
) -> Tensor:
    """The cache's rows at `positions` (`[t]`, or `[B, T]` in the slots of `write_at`) as
    `dtype` values."""
    if isinstance(write_at, tuple):
        rows = cache[write_at[0], :, positions][:, :, 0]
    else:
        rows = cache[:, 0].index_select(1, positions)
    return decode_rows(rows, dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        if cfg.is_conv(index):
            self.conv = ShortConv(cfg)
        else:
            self.self_attn = Attention(cfg)
        d, eps, f = cfg.hidden_size, cfg.rms_norm_eps, cfg.intermediate_size
        self.operator_norm = RMSNorm(d, eps)
        self.ffn_norm = RMSNorm(d, eps)
        self.feed_forward = SparseMoE(cfg) if cfg.is_moe(index) else MLP(d, f)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        op = self.conv if hasattr(self, "conv") else self.self_attn
        h = x + op(self.operator_norm(x), cos, sin, write_at, mask, k_cache, v_cache, span)
        return h + self.feed_forward(self.ffn_norm(h))


class MLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Lfm2Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Lfm2ForCausalLM(CausalLM):
    """`Lfm2ForCausalLM` with external, position-overwrite caches (keys and values, and the
    convolutions' inputs)."""

    EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"

    def __init__(self, cfg: ModelConfig, cache_len: int):
        super().__init__(cfg, cache_len)
        self.model = Lfm2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_buffers()

    def logits(self, x: Tensor) -> Tensor:
        return self.lm_head(self.model.embedding_norm(x))
