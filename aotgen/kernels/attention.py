"""Attention of a few query rows over the filled prefix of a KV cache, on CPU.

Decode, verify, token-tree and batched graphs attend 1-32 query rows per KV head to a prefix
of hundreds to thousands of keys: a few million multiply-adds a layer. SDPA's CPU kernel
spent 44 us a layer on SmolLM2's 5-row verify at 205 keys, in dispatch, blocking and MKL
calls sized for many rows, and a batch first gathered every sequence's prefix out of its
cache slot. `attention.cpp` reads the caches in place and streams each head's keys and
values once per tile of rows (layout and threading: its header).

`attend_cache` (one sequence) and `attend_cache_slots` (a batch) are `torch.library` custom
ops whose eager implementation (SDPA on the prefix) defines them; AOTInductor links
`attention.cpp` into each graph's `.so` as their C shims (export/shims.py), nothing extra at
run time.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from aotgen.kernels import packed
from aotgen.kernels.cache_rows import decode_rows, row_width

SOURCE = Path(__file__).with_name("attention.cpp")
DIM_MULTIPLE = 16  # head_dim must fill whole vectors on every ISA the kernel has
# What the kernel reads, in the order of its standalone entry's `cache_kind`.
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)


@torch.library.custom_op("aotgen::attend_cache", mutates_args=())
def attend_cache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    mask: Tensor,
    cap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """q [1, H, R, D] (scaled; row r = g * T + i) attends to the first N = mask.shape[1]
    positions of k_cache / v_cache [1, H, L, D], row r seeing key j iff mask[r % T, j]; with
    cap > 0 (Gemma 2) the scores are softcapped first; with sinks (gpt-oss), float32
    [H * group], one logit per query head, row r of KV head h being query head
    h * group + r // T (group = R // T), each softmax has one more key, of score sinks[head]
    and value zero."""
    return _reference(q, k_cache, v_cache, mask[None], None, cap, sinks)


@torch.library.custom_op("aotgen::attend_cache_slots", mutates_args=())
def attend_cache_slots(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    mask: Tensor,
    slots: Tensor,
    cap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """A batch: q [B, H, R, D], sequence b reading cache slot slots[b] of k_cache / v_cache
    [S, H, L, D] under mask [B, T, N]."""
    return _reference(q, k_cache, v_cache, mask, slots, cap, sinks)


def _reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    mask: Tensor,
    slots: Tensor | None,
    cap: float,
    sinks: Tensor | None = None,
) -> Tensor:
    """SDPA on the prefix (of each sequence's slot) in q's dtype, the mask repeated over the
    folded heads; softcapped scores, or sinks (not softcapped, seen by every row:
    `softmax_with_sinks`), as matmuls."""
    _, h, r, _ = q.shape
    _, t, n = mask.shape
    keys, values = (decode_rows(c[:, :, :n], q.dtype) for c in (k_cache, v_cache))
    if slots is not None:
        keys, values = keys[slots], values[slots]
    full = mask.repeat(1, r // t, 1).unsqueeze(1)
    if not cap and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=full, scale=1.0)
    scores = q @ keys.transpose(-1, -2)
    if cap:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~full, float("-inf"))
    column = None if sinks is None else row_sinks(sinks, h, t)
    return softmax_with_sinks(scores, column) @ values


def softmax_with_sinks(scores: Tensor, sinks: Tensor | None) -> Tensor:
    """Softmax over the last dim; with `sinks` (each row's sink logit, `[..., 1]` against
    scores `[..., n]`), gpt-oss's: the sink joins the denominator as a key whose value is zero,
    so the probabilities sum to less than one."""
    if sinks is None:
        return scores.softmax(-1)
    sinks = sinks.to(scores.dtype)
    top = torch.maximum(scores.amax(-1, keepdim=True), sinks)
    e = (scores - top).exp()
    return e / (e.sum(-1, keepdim=True) + (sinks - top).exp())


def row_sinks(sinks: Tensor, kv_heads: int, t: int) -> Tensor:
    """Per-query-head sink logits `[heads]` as a column for the rows of q folded `[kv_heads,
    group * t]` (row g * t + i is query head kv * group + g): `[kv_heads, group * t, 1]`."""
    column = sinks.view(kv_heads, -1, 1, 1)
    return column.expand(-1, -1, t, 1).reshape(kv_heads, -1, 1)


def _output_like_q(q: Tensor, *args: object, **kwargs: object) -> Tensor:
    """The ops' shapes for tracing: a new contiguous tensor like `q`."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)


attend_cache.register_fake(_output_like_q)
attend_cache_slots.register_fake(_output_like_q)

OPS = (torch.ops.aotgen.attend_cache.default, torch.ops.aotgen.attend_cache_slots.default)


def applies(q: Tensor, k_cache: Tensor) -> bool:
    """Whether a fixed-width CPU graph attends through the kernel: float32 or bfloat16 q (the
    kernel takes it widened to float32), float32, bfloat16 or int8 caches
    (kernels/cache_rows.py), head_dim a multiple of 16, and no gradient wanted (the ops have
    no backward; training a draft runs the model eagerly with autograd)."""
    return (
        not q.is_cuda
        and not q.requires_grad
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype in CACHE_DTYPES
        and k_cache.shape[-1] == row_width(q.shape[-1], k_cache.dtype)
        and q.shape[-1] % DIM_MULTIPLE == 0
    )


# ---- the kernel as a plain shared library: tests --------------------------------------------
def library(arch_flags: tuple[str, ...] = ("-march=native",)) -> ctypes.CDLL | None:
    return packed.library(arch_flags, SOURCE, "AOTGEN_ATTENTION_STANDALONE")


def run_library(
    lib: ctypes.CDLL,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    mask: Tensor,
    slots: Tensor | None = None,
    cap: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """The C++ kernel on contiguous CPU tensors (caches float32, bfloat16 or int8 rows), as
    `attend_cache` (mask [T, N]) or `attend_cache_slots` (mask [B, T, N], slots [B]); sinks
    float32 [H * R // T] or None."""
    b, h, r, d = q.shape
    t, n = mask.shape[-2:]
    out = torch.empty_like(q)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    mask = mask.to(torch.bool).contiguous()
    slot_ptr = ptr(slots.data_ptr() if slots is not None else 0)
    if sinks is not None:
        if r % t or sinks.shape != (h * (r // t),) or sinks.dtype != torch.float32:
            raise ValueError(
                f"sinks {tuple(sinks.shape)} {sinks.dtype}: want float32 [{h} * {r} // {t}]"
            )
        sinks = sinks.contiguous()
    sink_ptr = ptr(sinks.data_ptr() if sinks is not None else 0)
    rc = lib.aotgen_attend_cache(
        ptr(q.data_ptr()), ptr(k_cache.data_ptr()), ptr(v_cache.data_ptr()), ptr(mask.data_ptr()),
        ctypes.c_int(mask.dim() == 2), slot_ptr, i64(b), i64(h), i64(r), i64(t), i64(n),
        i64(k_cache.shape[2]), i64(d), ctypes.c_float(cap),
        ctypes.c_int(CACHE_DTYPES.index(k_cache.dtype)), sink_ptr, ptr(out.data_ptr()),
    )  # fmt: skip
    if rc:
        raise ValueError(f"head_dim {d} is not a whole number of vectors")
    return out
