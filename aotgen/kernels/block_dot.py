"""Linears with int4 / int8 weights and int8 activations, in blocks of 32 inputs.

llama.cpp's CPU formats (Q4_1 / Q8_0 weights against Q8_1 activations): each row of the
activation is quantized per block of 32 as the op runs (scale = max|x| / 127), and every
block's dot product is an integer one. On AVX2 that is 32 multiply-adds in two instructions
(`maddubs`, `madd`), where a float32 weight needs 4 vector FMAs and an int8 weight read as
float a conversion each. Lossy in the activations, so it is for drafts, whose guesses the
target verifies, and for packages that accept the approximation (docs/quantization.md).

The ops are `torch.library` custom ops, so they export and have an eager reference (below);
AOTInductor links `block_dot.cpp` into each graph's `.so` as their C shims (export/shims.py),
so a package needs neither this module nor any extra library at run time.

The same numbers are GGUF Q4_1 / Q8_0 blocks (`as_gguf`): on CPU with `compile.packed_linears`
the pack pass (passes/pack.py) moves these ops onto `gguf_dot`'s 16-output panels, whose
register tiles multiply each weight unit into several rows (verify, batched drafts) and use
VNNI where the CPU has it; the build's autotune keeps `block_dot.cpp` only for a weight it
measured faster at every row count the model's graphs run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import packed as pk

BLOCK = 32
MAX_IN_FEATURES = 32768  # the C++ kernel keeps per-row scale tables on the stack
SOURCE = Path(__file__).with_name("block_dot.cpp")


def in_features(k: int, bits: int) -> int:
    """The in_features the kernel takes: a multiple of 64 (int4: blocks come in pairs, one
    per nibble) or 32 (int8). The quantize pass zero-pads weight and activation to it."""
    multiple = 2 * BLOCK if bits == 4 else BLOCK
    return -(-k // multiple) * multiple


# ---- weights ---------------------------------------------------------------------------------
ROWS = 4  # rows per group, their 32-byte chunks interleaved (block_dot.cpp, "Layouts")


def interleave(t: Tensor, chunk: int) -> Tensor:
    """Row-major [N, C] -> the kernel's layout (same shape): in each group of 4 rows, chunk 0
    of rows 0..3, then chunk 1, ...; the N % 4 last rows stay row-major. Weights move in
    chunks of 32 bytes, scales one by one."""
    n, c = t.shape
    g = n // ROWS * ROWS
    head = t[:g].reshape(g // ROWS, ROWS, c // chunk, chunk).transpose(1, 2).reshape(g, c)
    return torch.cat([head, t[g:]]).contiguous()


def deinterleave(t: Tensor, chunk: int) -> Tensor:
    n, c = t.shape
    g = n // ROWS * ROWS
    head = t[:g].reshape(g // ROWS, c // chunk, ROWS, chunk).transpose(1, 2).reshape(g, c)
    return torch.cat([head, t[g:]])


def quantize_int4(w: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (packed uint8 [N, K/2] interleaved, scales fp16 [N, 2, K/32]: d, m), with
    w ≈ q * d + m per block, q in 0..15 (min/max: a Q4_1 GGUF's weights come back exactly)."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = ((blocks - m.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    pairs = q.reshape(n, k // 64, 2, BLOCK)  # byte j of pair p: block 2p's j | block 2p+1's j
    packed = (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(n, k // 2)
    scales = torch.stack([d, m], dim=1).reshape(n, -1)
    return interleave(packed, 32), interleave(scales, 1).reshape(n, 2, -1)


def unpack_int4(packed: Tensor) -> Tensor:
    """packed uint8 [N, K/2] -> the codes, uint8 [N, K]."""
    n = packed.shape[0]
    pairs = deinterleave(packed, 32).reshape(n, -1, 1, BLOCK)
    return torch.cat([pairs & 0xF, pairs >> 4], dim=2).reshape(n, -1)


def row_scales(scales: Tensor) -> Tensor:
    """The kernel's scales ([N, 2, nb] int4, [N, nb] int8), row-major and float32."""
    n = scales.shape[0]
    return deinterleave(scales.reshape(n, -1), 1).reshape(scales.shape).float()


def dequantize_int4(packed: Tensor, scales: Tensor) -> Tensor:
    n = packed.shape[0]
    q = unpack_int4(packed).float().reshape(n, -1, BLOCK)
    d, m = row_scales(scales).unbind(1)
    return (q * d[..., None] + m[..., None]).reshape(n, -1)


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (int8 [N, K] interleaved, in -127..127; scales fp16 [N, K/32]), w ≈ q * d.
    -128 is left out: the kernel takes |q| as an unsigned byte."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1) / 127).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return interleave(q.reshape(n, k), 32), interleave(d, 1)


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    n = q.shape[0]
    codes = deinterleave(q, 32).float().reshape(n, -1, BLOCK)
    return (codes * row_scales(scales)[..., None]).reshape(n, -1)


def as_gguf(bits: int, weight: Tensor, scales: Tensor) -> gb.Decoded:
    """The kernel's weight and scales as GGUF blocks (row-major, for `gguf_blocks.pack`), the
    same numbers: int4 is Q4_1 (w = q * d + m), int8 is Q8_0 (stored as q + 128)."""
    n = weight.shape[0]
    if bits == 4:
        codes = unpack_int4(weight)
        groups = row_scales(scales).permute(0, 2, 1)  # [N, nb, (d, m)]
        qtype = gb.QTYPES["Q4_1"]
    else:
        codes = (deinterleave(weight, 32).to(torch.int16) + 128).to(torch.uint8)
        groups = row_scales(scales)[..., None]  # [N, nb, 1]
        qtype = gb.QTYPES["Q8_0"]
    # float16 -> float32 -> float16 is exact
    return gb.Decoded(qtype, codes.reshape(n, -1).numpy(), groups.half().contiguous().numpy())


# ---- activations and the reference linear ----------------------------------------------------
def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[M, K] float32 -> (codes [M, K/32, 32] as float, dx [M, K/32], sx = dx * sum(codes)):
    the kernel's arithmetic (scale max|x| / 127, multiply by its inverse, round to even)."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    dx = blocks.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    q = (blocks * inv[..., None]).round()
    return q, dx, dx * q.sum(-1)


def reference_linear(bits: int, x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """What the kernel computes, in float32 torch ops (integer block sums are exact)."""
    q, dx, sx = quantize_activations(x)
    n = weight.shape[0]
    if bits == 4:
        codes = unpack_int4(weight).float().reshape(n, -1, BLOCK)
        d, m = row_scales(scales).unbind(1)
    else:
        codes = deinterleave(weight, 32).float().reshape(n, -1, BLOCK)
        d, m = row_scales(scales), None
    sums = torch.einsum("mbj,nbj->mnb", q, codes)
    out = (sums * (dx[:, None, :] * d[None])).sum(-1)
    if m is not None:
        out = out + sx @ m.T
    return out


@torch.library.custom_op("aotgen::int4_block_linear", mutates_args=())
def int4_block_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x [M, K] float32 @ (int4 weight [N, K/2] packed, scales [N, 2, K/32])^T -> [M, N]."""
    return reference_linear(4, x, weight, scales)


@torch.library.custom_op("aotgen::int8_block_linear", mutates_args=())
def int8_block_linear(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x [M, K] float32 @ (int8 weight [N, K], scales [N, K/32])^T -> [M, N]."""
    return reference_linear(8, x, weight, scales)


@int4_block_linear.register_fake
@int8_block_linear.register_fake
def _(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


OP_FOR = {  # weight scheme -> the op that runs it
    "int4": torch.ops.aotgen.int4_block_linear.default,
    "int8": torch.ops.aotgen.int8_block_linear.default,
}


OPS = tuple(OP_FOR.values())


# ---- the kernel as a plain shared library: tests and the build's autotune ---------------------
def library(arch_flags: tuple[str, ...] = ("-march=native",)) -> ctypes.CDLL | None:
    return pk.library(arch_flags, SOURCE, "AOTGEN_BLOCK_DOT_STANDALONE")


def run_library(
    lib: ctypes.CDLL,
    bits: int,
    x: Tensor,
    weight: Tensor,
    scales: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """The C++ kernel on contiguous CPU tensors (x float32 [M, K])."""
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n) if out is None else out
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.aotgen_block_linear(
        ctypes.c_int(bits), ptr(x.data_ptr()), i64(m), i64(k), ptr(weight.data_ptr()),
        ptr(scales.data_ptr()), i64(n), ptr(out.data_ptr()),
    )  # fmt: skip
    return out
