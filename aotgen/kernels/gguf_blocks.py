"""Linears on a GGUF file's quantization blocks, kept bit-exact (`quantize: {gguf: keep}`).

A GGUF block (Q4_0 ... Q6_K) is codes of 4 to 8 bits plus float16 scales per group of 16 or 32
inputs, and for the k-quants float16 scales per super-block of 256 that multiply 6/8-bit
sub-scales. `decode` reads a tensor's blocks into codes and scales; `pack` lays them out in
panels of 16 outputs for `gguf_blocks.cpp` (layout in its header). Nothing is rounded: every
weight the kernel computes, s * (code - zero) + o, is gguf's dequantized value bit for bit
(`dequantize` here is the reference, and the tests hold it to `gguf.quants.dequantize`).
Storage is the file's bytes; only the k-quants' 6/8-bit sub-scales are widened to float16
(Q4_K 1.14x, Q5_K 1.11x, Q6_K 1.08x their blocks).

The ops are `torch.library` custom ops with an eager reference, so they export; AOTInductor
links `gguf_blocks.cpp` into each graph's `.so` as their C shims (export/shims.py; nothing
extra at run time).
The tile (`rows` x `panels`) is an argument of the op, chosen per shape by the build's autotune.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from aotgen.kernels import packed as pk

PANEL = pk.PANEL
SUPER = 256  # inputs per k-quant super-block
SOURCE = Path(__file__).with_name("gguf_blocks.cpp")


def max_acc(lanes: int) -> int:
    """Accumulator vectors a tile may hold (gguf_blocks.cpp `kMaxAcc`): fewer than packed.cpp's,
    the decoding needs registers of its own."""
    return 24 if lanes == 16 else 12


@dataclass(frozen=True)
class QType:
    """A GGUF block type as the kernel sees it (gguf_blocks.cpp `kTypes`, same order)."""

    index: int
    name: str
    bits: int  # code width
    group: int  # inputs per scale
    zero: int  # code of 0.0 (legacy symmetric types, Q6_K; Q8_0 stores q + 128)
    n_groups: int  # float16 values per group: scale (or sub-scale), and an offset when 2
    n_supers: int  # float16 values per super-block: d, and -dmin when 2 (k-quants only)
    block: int  # inputs per block in the file
    block_bytes: int

    @property
    def unit(self) -> int:
        """Inputs per 64-byte unit of codes in a panel."""
        return 4 if self.bits == 8 else 8

    @property
    def unit_bytes(self) -> int:
        return 64 + {5: 16, 6: 32}.get(self.bits, 0)


QTYPES = {
    q.name: q
    for q in (
        QType(0, "Q4_0", 4, 32, 8, 1, 0, 32, 18),
        QType(1, "Q4_1", 4, 32, 0, 2, 0, 32, 20),
        QType(2, "Q5_0", 5, 32, 16, 1, 0, 32, 22),
        QType(3, "Q5_1", 5, 32, 0, 2, 0, 32, 24),
        QType(4, "Q8_0", 8, 32, 128, 1, 0, 32, 34),
        QType(5, "Q4_K", 4, 32, 0, 2, 2, SUPER, 144),
        QType(6, "Q5_K", 5, 32, 0, 2, 2, SUPER, 176),
        QType(7, "Q6_K", 6, 16, 32, 1, 1, SUPER, 210),
    )
}
BY_INDEX = {q.index: q for q in QTYPES.values()}


@dataclass
class Decoded:
    """One tensor's blocks, row-major: codes [N, K] uint8, group values [N, K/G, n_groups] and
    super-block values [N, K/256, n_supers] (k-quants) as float16."""

    qtype: QType
    codes: np.ndarray
    groups: np.ndarray
    supers: np.ndarray | None = None


# ---- the file's blocks -> codes and scales ----------------------------------------------------
def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes whose low nibbles are `run` codes and high nibbles the next `run`."""
    n = qs.shape[0]
    pairs = qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (pairs & 0x0F).reshape(n, -1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of high bits -> 32 values 0/1."""
    word = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit sub-scales and 8 sub-minimums (gguf's get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _decode_blocks(q: QType, b: np.ndarray) -> tuple[np.ndarray, list, list]:
    """[blocks, block_bytes] -> (codes [blocks, block], group values, super values)."""
    if q.name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(b[:, 0:2])
        at, groups = 2, [d]
        if q.name.endswith("_1"):
            groups, at = [d, _f16(b[:, 2:4])], 4
        codes = _nibbles(b[:, at + 4 * (q.bits == 5) :], 16)
        if q.bits == 5:
            codes = codes | (_bits32(b[:, at : at + 4]) << 4)
        return codes, groups, []
    if q.name == "Q8_0":
        codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, [_f16(b[:, 0:2])], []
    if q.name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        codes = _nibbles(b[:, 16 + 32 * (q.bits == 5) :], 32)
        if q.bits == 5:
            qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes = codes | ((qh & 1).reshape(-1, SUPER) << 4)
        return codes, [sc.astype(np.float16), mn.astype(np.float16)], [d, -dmin]
    # Q6_K: ql [128], qh [64], int8 sub-scales [16], d
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    codes = (ql | ((qh & 3).reshape(n, 8, 32) << 4)).reshape(n, SUPER)
    return codes, [b[:, 192:208].view(np.int8).astype(np.float16)], [_f16(b[:, 208:210])]


def decode(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> Decoded:
    """A tensor's blocks as stored in the file (uint8, [N, K / block * block_bytes]) -> Decoded."""
    q = QTYPES[qtype]
    n, k = shape
    codes, groups, supers = _decode_blocks(q, np.ascontiguousarray(raw).reshape(-1, q.block_bytes))

    def per_row(values: list, per: int) -> np.ndarray:
        return np.stack([v.reshape(n, k // per) for v in values], axis=-1)

    return Decoded(
        q,
        codes.reshape(n, k),
        per_row(groups, q.group),
        per_row(supers, SUPER) if supers else None,
    )


def dequantize(dec: Decoded) -> np.ndarray:
    """float32 [N, K], in gguf.quants' arithmetic: s * (code - zero) + o per group."""
    q = dec.qtype
    n, k = dec.codes.shape
    c = (dec.codes.astype(np.int16) - q.zero).astype(np.float32).reshape(n, k // q.group, q.group)
    g = dec.groups.astype(np.float32)
    if q.n_supers:
        reps = SUPER // q.group
        s = np.repeat(dec.supers.astype(np.float32), reps, axis=1)
        w = (s[..., 0] * g[..., 0])[..., None] * c
        if q.n_groups == 2:
            w = w + (s[..., 1] * g[..., 1])[..., None]
    else:
        w = g[..., 0][..., None] * c
        if q.n_groups == 2:
            w = w + g[..., 1][..., None]
    return w.reshape(n, k)


def random_blocks(q: QType, n: int, k: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """[N, K / block * block_bytes] bytes of type `q`: random codes and sub-scales (any bytes
    are a valid block), float16 scales of either sign in scale / 20 .. scale (random bytes
    there could be NaN or huge). For tests and the autotune."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n * k // q.block, q.block_bytes), dtype=np.uint8)
    count = 2 if q.n_supers == 2 or (q.n_groups == 2 and not q.n_supers) else 1
    size = (b.shape[0], count)
    scales = rng.uniform(scale / 20, scale, size) * rng.choice([-1.0, 1.0], size)
    at = 208 if q.name == "Q6_K" else 0  # where the float16 scales lie in the block
    b[:, at : at + 2 * count] = scales.astype(np.float16).view(np.uint8)
    return b.reshape(n, -1)


# ---- panels ------------------------------------------------------------------------------------
def _panels(t: Tensor) -> Tensor:
    """[N, ...] -> [ceil(N / 16), 16, ...], outputs past N zero."""
    n = t.shape[0]
    out = t.new_zeros(pk.padded_outputs(n), *t.shape[1:])
    out[:n] = t
    return out.reshape(-1, PANEL, *t.shape[1:])


def pack(dec: Decoded) -> tuple[Tensor, Tensor, Tensor | None]:
    """Decoded -> (codes uint8 [P, K / unit, unit_bytes], groups float16 [P, K/G, n_groups, 16],
    supers float16 [P, K/256, n_supers, 16] or None), the kernel's layout."""
    q = dec.qtype
    codes = _panels(torch.from_numpy(dec.codes).to(torch.int32))  # [P, 16, K]
    p, _, k = codes.shape
    if q.bits == 8:
        units = codes.reshape(p, PANEL, k // 4, 4).permute(0, 2, 1, 3)
        stream = units.to(torch.uint8).reshape(p, k // 4, 64)
    else:
        octets = codes.reshape(p, PANEL, k // 8, 8).permute(0, 2, 1, 3)  # [P, K/8, 16, 8]
        low = octets & 0xF
        stream = (low[..., :4] | (low[..., 4:] << 4)).to(torch.uint8).reshape(p, k // 8, 64)
        if q.bits > 4:
            width = q.bits - 4  # high bits per code, lane j's in one byte (5) or uint16 (6)
            shifts = torch.arange(8, dtype=torch.int32) * width
            high = ((octets >> 4) << shifts).sum(-1)  # [P, K/8, 16]
            as_bytes = high.to(torch.uint8) if width == 1 else high.to(torch.int16)
            stream = torch.cat([stream, as_bytes.contiguous().view(torch.uint8)], dim=-1)

    def lay(values: np.ndarray) -> Tensor:  # [N, K/G, n] -> [P, K/G, n, 16]
        return _panels(torch.from_numpy(values)).permute(0, 2, 3, 1).contiguous()

    supers = lay(dec.supers) if dec.supers is not None else None
    return stream.contiguous(), lay(dec.groups), supers


def unpack_codes(codes: Tensor, qtype: QType) -> Tensor:
    """The kernel's code stream -> codes int32 [16 P, K]."""
    p, units, _ = codes.shape
    c = codes.to(torch.int32)
    if qtype.bits == 8:
        return c.reshape(p, units, PANEL, 4).permute(0, 2, 1, 3).reshape(p * PANEL, units * 4)
    low = c[..., :64].reshape(p, units, PANEL, 4)
    octets = torch.cat([low & 0xF, low >> 4], dim=-1)  # [P, K/8, 16, 8]
    if qtype.bits > 4:
        width = qtype.bits - 4
        raw = codes[..., 64:].contiguous()
        high = (raw if width == 1 else raw.view(torch.int16)).to(torch.int32) & 0xFFFF
        shifts = torch.arange(8, dtype=torch.int32) * width
        octets = octets | (((high[..., None] >> shifts) & ((1 << width) - 1)) << 4)
    return octets.permute(0, 2, 1, 3).reshape(p * PANEL, units * 8)


def unpack(codes: Tensor, groups: Tensor, supers: Tensor | None, qtype: QType) -> Decoded:
    """The kernel's layout back to row-major codes and scales (padding rows included)."""

    def rows(values: Tensor) -> np.ndarray:  # [P, K/G, n, 16] -> [16 P, K/G, n]
        p, per, n, _ = values.shape
        return values.permute(0, 3, 1, 2).reshape(p * PANEL, per, n).numpy()

    codes_rows = unpack_codes(codes, qtype).to(torch.uint8).numpy()
    return Decoded(qtype, codes_rows, rows(groups), rows(supers) if supers is not None else None)


def dequantize_packed(codes: Tensor, groups: Tensor, supers: Tensor | None, qtype: QType) -> Tensor:
    """float32 [16 P, K] from the kernel's layout (the ops' eager reference)."""
    return torch.from_numpy(dequantize(unpack(codes, groups, supers, qtype)))


# ---- ops ---------------------------------------------------------------------------------------
@torch.library.custom_op("aotgen::gguf_linear", mutates_args=())
def gguf_linear(
    x: Tensor, codes: Tensor, groups: Tensor, qtype: int, rows: int, panels: int
) -> Tensor:
    """x [M, K] float32 @ W^T -> [M, 16 P], W a legacy type's blocks (Q4_0 ... Q8_0)."""
    return x @ dequantize_packed(codes, groups, None, BY_INDEX[qtype]).T


@torch.library.custom_op("aotgen::gguf_linear_k", mutates_args=())
def gguf_linear_k(
    x: Tensor, codes: Tensor, groups: Tensor, supers: Tensor, qtype: int, rows: int, panels: int
) -> Tensor:
    """x [M, K] float32 @ W^T -> [M, 16 P], W a k-quant's blocks (Q4_K, Q5_K, Q6_K)."""
    return x @ dequantize_packed(codes, groups, supers, BY_INDEX[qtype]).T


@gguf_linear.register_fake
def _(x: Tensor, codes: Tensor, groups: Tensor, qtype: int, rows: int, panels: int) -> Tensor:
    return x.new_empty(x.shape[0], codes.shape[0] * PANEL)


@gguf_linear_k.register_fake
def _(
    x: Tensor, codes: Tensor, groups: Tensor, supers: Tensor, qtype: int, rows: int, panels: int
) -> Tensor:
    return x.new_empty(x.shape[0], codes.shape[0] * PANEL)


@torch.library.custom_op("aotgen::gguf_rows", mutates_args=())
def gguf_rows(
    ids: Tensor, codes: Tensor, groups: Tensor, supers: Tensor | None, qtype: int
) -> Tensor:
    """Rows `ids` (int64 [L]) of W dequantized -> float32 [L, K]: an embedding tied to a head
    on blocks reads its table from the head's panels."""
    hi, lo = ids // PANEL, ids % PANEL
    panels = dequantize_packed(codes[hi], groups[hi], None if supers is None else supers[hi],
                               BY_INDEX[qtype])  # fmt: skip
    return panels.reshape(len(ids), PANEL, -1)[torch.arange(len(ids)), lo]


@gguf_rows.register_fake
def _(ids: Tensor, codes: Tensor, groups: Tensor, supers: Tensor | None, qtype: int) -> Tensor:
    return codes.new_empty(ids.shape[0], codes.shape[1] * BY_INDEX[qtype].unit, dtype=torch.float32)


OPS = (
    torch.ops.aotgen.gguf_linear.default,
    torch.ops.aotgen.gguf_linear_k.default,
    torch.ops.aotgen.gguf_rows.default,
)


# ---- the kernel as a plain shared library: tests and the build's autotune ---------------------
def library(arch_flags: tuple[str, ...] = ("-march=native",)) -> ctypes.CDLL | None:
    return pk.library(arch_flags, SOURCE, "AOTGEN_GGUF_STANDALONE")


def run_library(
    lib: ctypes.CDLL,
    x: Tensor,
    packed: tuple[Tensor, Tensor, Tensor | None],
    qtype: QType,
    rows: int,
    panels: int,
    out: Tensor | None = None,
) -> Tensor:
    """The C++ kernel on contiguous CPU tensors (x float32 [M, K])."""
    codes, groups, supers = packed
    (m, k), n = x.shape, codes.shape[0] * PANEL
    out = torch.empty(m, n) if out is None else out
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.aotgen_gguf_linear(
        ctypes.c_int(qtype.index), ptr(x.data_ptr()), i64(m), i64(k), ptr(codes.data_ptr()),
        ptr(groups.data_ptr()), ptr(supers.data_ptr() if supers is not None else 0), i64(n),
        ptr(out.data_ptr()), ctypes.c_int(rows), ctypes.c_int(panels),
    )  # fmt: skip
    return out
