"""Linears on GGUF blocks with integer dot products: llama.cpp's CPU numerics.

The same packed blocks as `gguf_blocks` (`pack`), a second way to multiply them: each
activation row is quantized to int8 per block of 32 inputs (`block_dot.quantize_activations`),
and every weight group's dot product with it is an integer one. On AVX-512 VNNI a 64-byte unit
of codes is one `dpbusd` per 4 inputs for 16 outputs, where the exact path (`gguf_linear`)
decodes each code to float32 and spends a fused multiply-add per input and output. The
activations' rounding is the price (about 0.5% of the output's scale): for drafts, and for
packages that accept it, as llama.cpp does.

`reference_dot` defines the numerics and is the ops' eager implementation; AOTInductor links
`gguf_dot.cpp` into each graph's `.so` as their C shims (export/shims.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from aotgen.kernels import block_dot as bd
from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import packed as pk

PANEL = gb.PANEL
SOURCE = Path(__file__).with_name("gguf_dot.cpp")


def max_acc(lanes: int) -> int:
    """Accumulator vectors a tile may hold (gguf_dot.cpp `kMaxAcc`): int32 and float32 ones."""
    return 12 if lanes == 16 else 6


def group_scales(groups: Tensor, supers: Tensor | None, q: gb.QType) -> tuple[Tensor, Tensor]:
    """Per output and group, float32 [16 P, K / G]: the scale s and offset o of
    w = s * (code - zero) + o, as gguf_blocks.cpp `Panel::scale` computes them."""
    p, ng = groups.shape[0], groups.shape[1]
    g = groups.permute(0, 3, 1, 2).reshape(p * PANEL, ng, q.n_groups).float()
    s, o = g[..., 0], g[..., 1] if q.n_groups == 2 else torch.zeros_like(g[..., 0])
    if supers is not None:
        sup = supers.permute(0, 3, 1, 2).reshape(p * PANEL, -1, q.n_supers).float()
        sup = sup.repeat_interleave(gb.SUPER // q.group, dim=1)
        s = s * sup[..., 0]
        if q.n_groups == 2:
            o = sup[..., 1] * o
    return s, o


def reference_dot(
    x: Tensor, codes: Tensor, groups: Tensor, supers: Tensor | None, qtype: int
) -> Tensor:
    """x [M, K] float32 against the packed blocks -> float32 [M, 16 P], in integer numerics:
    xq, dx = x quantized per block of 32 (`block_dot.quantize_activations`); per weight group
    g (inside block b), I = sum xq * code and Xq = sum xq over g, and
    out = sum_g dx[b] * (s[g] * I + (o[g] - s[g] * zero) * Xq)."""
    q = gb.BY_INDEX[qtype]
    xq, dx, _ = bd.quantize_activations(x)
    m, k = x.shape
    c = gb.unpack_codes(codes, q).float()
    n, per = c.shape[0], q.group
    xg = xq.reshape(m, k // per, per)
    # Integer sums in float32: every partial sum is an integer below 32 * 127 * 255 < 2^24, so
    # each is exact whatever the order (the kernel's int32 sums, bit for bit).
    ints = torch.einsum("mgj,ngj->mng", xg, c.reshape(n, k // per, per))
    xsum = xg.sum(-1)
    s, o = group_scales(groups, supers, q)
    dxg = dx.repeat_interleave(bd.BLOCK // per, dim=1)
    terms = s * ints + (o - s * q.zero) * xsum[:, None, :]
    return (dxg[:, None, :] * terms).sum(-1)


# ---- ops ---------------------------------------------------------------------------------------
@torch.library.custom_op("aotgen::gguf_dot", mutates_args=())
def gguf_dot(
    x: Tensor, codes: Tensor, groups: Tensor, qtype: int, rows: int, panels: int
) -> Tensor:
    """x [M, K] float32 @ W^T -> [M, 16 P] in integer numerics, W a legacy type's blocks."""
    return reference_dot(x, codes, groups, None, qtype)


@torch.library.custom_op("aotgen::gguf_dot_k", mutates_args=())
def gguf_dot_k(
    x: Tensor, codes: Tensor, groups: Tensor, supers: Tensor, qtype: int, rows: int, panels: int
) -> Tensor:
    """x [M, K] float32 @ W^T -> [M, 16 P] in integer numerics, W a k-quant's blocks."""
    return reference_dot(x, codes, groups, supers, qtype)


@gguf_dot.register_fake
def _(x: Tensor, codes: Tensor, groups: Tensor, qtype: int, rows: int, panels: int) -> Tensor:
    return x.new_empty(x.shape[0], codes.shape[0] * PANEL)


@gguf_dot_k.register_fake
def _(
    x: Tensor, codes: Tensor, groups: Tensor, supers: Tensor, qtype: int, rows: int, panels: int
) -> Tensor:
    return x.new_empty(x.shape[0], codes.shape[0] * PANEL)


OPS = (torch.ops.aotgen.gguf_dot.default, torch.ops.aotgen.gguf_dot_k.default)


# ---- the kernel as a plain shared library: tests and the build's autotune ---------------------
def library(arch_flags: tuple[str, ...] = ("-march=native",)) -> ctypes.CDLL | None:
    return pk.library(arch_flags, SOURCE, "AOTGEN_GGUF_DOT_STANDALONE")


def run_library(
    lib: ctypes.CDLL,
    x: Tensor,
    packed: tuple[Tensor, Tensor, Tensor | None],
    qtype: gb.QType,
    rows: int,
    panels: int,
    out: Tensor | None = None,
) -> Tensor:
    """The C++ kernel on CPU tensors: x float32 [M, K] with unit column stride (rows may be
    strided), the packed tensors contiguous."""
    assert x.dtype == torch.float32 and x.stride(1) == 1
    codes, groups, supers = packed
    (m, k), n = x.shape, codes.shape[0] * PANEL
    out = torch.empty(m, n) if out is None else out
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.aotgen_gguf_dot(
        ctypes.c_int(qtype.index), ptr(x.data_ptr()), i64(x.stride(0)), i64(m), i64(k),
        ptr(codes.data_ptr()), ptr(groups.data_ptr()),
        ptr(supers.data_ptr() if supers is not None else 0), i64(n), ptr(out.data_ptr()),
        ctypes.c_int(rows), ctypes.c_int(panels),
    )  # fmt: skip
    return out
