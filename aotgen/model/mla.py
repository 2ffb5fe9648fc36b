"""Multi-head latent attention (DeepSeek-V2 / V3, GLM-4.7-Flash, Youtu-LLM, MiniCPM3): the
layers' attention for `cfg.latent_attention`.

Each position's keys and values come from one latent row: `kv_a_proj_with_mqa` gives
`kv_lora_rank` latent dims (normalised by `kv_a_layernorm`) and `rotary_dim` dims of a key
that every head shares, rotated by RoPE. `kv_b_proj` expands the latent into each head's
`qk_nope_head_dim` key dims and `v_head_dim` value dims. A head's score is its unrotated part
against the expanded key plus its rotated part against the shared key.

The cache keeps only the latent row and the shared key: `kv_lora_rank + rotary_dim` values a
position and layer (576 for DeepSeek-V3, against 32,768 for its 128 heads' keys and values),
as the layer's keys cache of one KV head; its values cache is empty (width 0), so every
runtime moves and copies rows by position as for any layer. Two ways to attend over it:

- Absorbed (decode, verify, tree and batched graphs on CPU, and prefill over a bfloat16 or
  int8 cache): `kv_b_proj`'s key rows are folded into q, `q_nope @ W_k` (per head, [nope] ->
  [rank]), so each head's query is a `rank + rotary_dim` row scored against the cached rows
  as they are, one KV head for every query head (kernels/attention.py's kernel, the cache
  read in place, the rows themselves as the values); the weighted latent is expanded by the
  value rows after. A step reads the cache once, not an expanded copy of it.
- Expanded (prefill over a cache of the model's dtype, and graphs the kernel does not run:
  CUDA, ONNX): the attended span's latents are expanded into every head's keys and values
  and attended with SDPA, as transformers does; for a chunk of many rows this costs fewer
  multiply-adds than the absorbed form (`rank + rotary_dim` dims a score and a value,
  against `qk_nope + rotary_dim` and `v_head_dim`).

`kv_b_proj` (`LatentExpansion`) is read per head, not called as a linear, so the graph
quantization pass does not see it; a quantized package swaps it for int8 rows before export
(passes/quantize_latent.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aotgen.kernels import attention
from aotgen.kernels.cache_rows import decode_rows
from aotgen.model.config import ModelConfig
from aotgen.model.layers import CacheIndex, RMSNorm, apply_rope, write_cache


class LatentExpansion(nn.Module):
    """`kv_b_proj`: the latent's expansion into each head's key dims, then its value dims
    (`weight` [heads * (nope + v_dim), rank], the checkpoint's layout)."""

    def __init__(self, rank: int, heads: int, nope: int, v_dim: int):
        super().__init__()
        self.heads, self.nope, self.v_dim = heads, nope, v_dim
        self.weight = nn.Parameter(torch.empty(heads * (nope + v_dim), rank))

    def forward(self, latent: Tensor) -> Tensor:
        """Latent rows [n, rank] expanded: [n, heads * (nope + v_dim)]."""
        return latent @ self.weight.t()

    def fold_keys(self, q_nope: Tensor) -> Tensor:
        """Each head's unrotated query [b, heads, t, nope] through its key rows: [.., rank]."""
        return q_nope @ self._per_head()[:, : self.nope]

    def expand_values(self, y: Tensor) -> Tensor:
        """Each head's weighted latent [b, heads, t, rank] into its values: [.., v_dim]."""
        return y @ self._per_head()[:, self.nope :].transpose(1, 2)

    def _per_head(self) -> Tensor:
        return self.weight.view(self.heads, self.nope + self.v_dim, -1)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        self.rank, self.rope = cfg.kv_lora_rank, cfg.rotary_dim
        self.nope, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.scale = cfg.attention_multiplier
        q_out = heads * (self.nope + self.rope)
        bias = cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(d, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = LatentExpansion(self.rank, heads, self.nope, self.v_dim)
        self.o_proj = nn.Linear(heads * self.v_dim, d, bias=cfg.attention_out_bias)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        write_at: CacheIndex,
        mask: Tensor,
        cache: Tensor,
        no_values: Tensor,
        span: slice,
    ) -> Tensor:
        b, t, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, -1, self.nope + self.rope).transpose(1, 2)  # [b, heads, t, nope + rope]
        q_nope, q_rot = q.split([self.nope, self.rope], -1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], -1)
        k_rot = apply_rope(k_rot.unsqueeze(1), cos, sin)  # [b, 1, t, rope]: every head's
        row = torch.cat([self.kv_a_layernorm(latent).unsqueeze(1), k_rot], -1)
        write_cache(cache, row, write_at)
        q_rot = apply_rope(q_rot, cos, sin)
        slots = write_at[0][:, 0] if isinstance(write_at, tuple) else None  # a batch's rows
        # [b, heads, t, rank + rope]
        queries = torch.cat([self.kv_b_proj.fold_keys(q_nope), q_rot], -1)
        folded = queries.reshape(b, 1, -1, self.rank + self.rope)
        fixed_width = isinstance(t, int) and not torch.onnx.is_in_onnx_export()
        # A narrower cache's prefill too: its span decoded for expanding has a data-dependent
        # length, and a matmul over that does not compile (Inductor's mm lowering guards it).
        narrow = cache.dtype != q.dtype and not torch.onnx.is_in_onnx_export()
        if (fixed_width or narrow) and attention.applies(folded, cache):
            y = self._absorbed(folded, cache, mask, slots)
            y = y.view(b, -1, t, self.rank + self.rope)[..., : self.rank]
            y = self.kv_b_proj.expand_values(y)
        else:
            rows = cache[:, :, span] if slots is None else cache[slots, :, span]
            y = self._expanded(q_nope, q_rot, rows, mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    def _absorbed(
        self, folded: Tensor, cache: Tensor, mask: Tensor, slots: Tensor | None
    ) -> Tensor:
        """The folded queries `[b, 1, heads * t, rank + rope]` against the cached rows, which
        are their own values (the kernel takes float32 q)."""
        scaled = folded.float() * self.scale
        if slots is None:
            y = torch.ops.aotgen.attend_cache(scaled, cache, cache, mask)
        else:
            y = torch.ops.aotgen.attend_cache_slots(scaled, cache, cache, mask, slots)
        return y.to(folded.dtype)

    def _expanded(self, q_nope: Tensor, q_rot: Tensor, rows: Tensor, mask: Tensor) -> Tensor:
        """Every head's keys and values from the cached rows `[b, 1, n, rank + rope]`, and
        SDPA over them: `[b, heads, t, v_head_dim]`."""
        b, heads = q_nope.shape[:2]
        latent, k_rot = decode_rows(rows, q_nope.dtype).split([self.rank, self.rope], -1)
        kv = self.kv_b_proj(latent.reshape(-1, self.rank))
        kv = kv.view(b, -1, heads, self.nope + self.v_dim).transpose(1, 2)
        keys = torch.cat([kv[..., : self.nope], k_rot.expand(-1, heads, -1, -1)], -1)
        values = kv[..., self.nope :]
        q = torch.cat([q_nope, q_rot], -1)
        mask = mask.unsqueeze(1) if mask.dim() == 3 else mask  # a batch's [B, T, n]
        # One width for q, k and v (zeros added to the narrower): SDPA's fused CPU kernel
        # takes no other, and its math form, as batched matmuls over a data-dependent number
        # of keys, does not compile.
        width = max(q.shape[-1], self.v_dim)
        q, keys, values = (F.pad(x, (0, width - x.shape[-1])) for x in (q, keys, values))
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        return y[..., : self.v_dim]


def rotate_half_rows(cfg: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The rotated rows of q (each head's last `rotary_dim`) and of the shared key (the last
    `rotary_dim` of `kv_a_proj_with_mqa`) of a checkpoint that rotates adjacent pairs, put
    evens then odds: the model's rotate-half RoPE turns the same pairs by the same angles."""
    if not cfg.interleaved_rope:
        return weights
    rope, head = cfg.rotary_dim, cfg.qk_nope_head_dim + cfg.rotary_dim
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    out = dict(weights)
    for name, t in weights.items():
        stem = name.rpartition(".")[0]
        if stem.endswith(("self_attn.q_proj", "self_attn.q_b_proj")):
            order = torch.arange(t.shape[0]).view(-1, head)
            order[:, -rope:] = order[:, -rope:][:, pairs]
            out[name] = t[order.flatten()]
        elif stem.endswith("self_attn.kv_a_proj_with_mqa"):
            order = torch.arange(t.shape[0])
            order[-rope:] = order[-rope:][pairs]
            out[name] = t[order]
    return out
