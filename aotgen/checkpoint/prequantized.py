"""Checkpoints quantized by GPTQ or AWQ (a `quantization_config` in config.json).

Their linears hold integer codes packed into int32 words, with a float16 scale and a zero point
per group of inputs: w = (q - z) * s. The build reads them as float32 weights, and, where the
codes fit a GGUF block type, also as blocks, so that `quantize: {gguf: keep}` runs the
checkpoint's own codes with the block kernels (passes/gguf_keep.py):

- symmetric 4-bit (z = 8) as Q4_0 and symmetric 8-bit (z = 128) as Q8_0: exact, since every
  32-input block lies in one group and keeps that group's float16 scale;
- asymmetric 4-bit (AWQ, GPTQ `sym: false`) as Q4_1, whose offset -z * s is a float16: the
  product of a 4-bit integer and a float16 scale rounds to it, by at most 2^-11 of itself (under
  1 % of one quantization step). The float weights are read from those same blocks, so a
  package with or without `gguf: keep` computes one model.

A linear whose codes fit no block (8-bit asymmetric, GPTQ's act-order, groups not a multiple
of 32 inputs) is read as float32 exactly, (q - z) * s, and stays float under `gguf: keep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import Tensor

PACKED = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of each nibble in an AWQ (GEMM) word


class QuantConfigError(ValueError):
    """A `quantization_config` aotgen cannot read, with what it reads instead."""


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint's codes are packed (config.json `quantization_config`)."""

    method: str  # gptq | awq
    bits: int
    groupsize: int  # inputs per group; 0: a whole row
    zero_offset: int  # added to a stored zero point: GPTQ's original format stores z - 1

    @property
    def per_word(self) -> int:
        return 32 // self.bits


def scheme(config: dict) -> Scheme | None:
    """The checkpoint's scheme, None for a float checkpoint; a clear error for any other."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    read = "aotgen reads GPTQ (4/8-bit) and AWQ (4-bit, GEMM) checkpoints; use the float one"
    if method == "gptq":
        bits, group = qc.get("bits"), qc.get("group_size", -1)
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantConfigError(f"GPTQ checkpoint_format {fmt!r} is not read: {read}")
        offset = 1 if fmt == "gptq" else 0
    elif method == "awq":
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("zero_point", True) is not True:
            raise QuantConfigError(
                f"AWQ version {version!r} (zero_point {qc.get('zero_point', True)}) is not "
                f"read: {read}"
            )
        offset = 0
    else:
        raise QuantConfigError(f"checkpoint quantized with {method or '?'!r}: {read}")
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise QuantConfigError(f"{method.upper()} with {bits} bits is not read: {read}")
    if not isinstance(group, int) or group == 0 or group < -1:
        raise QuantConfigError(f"{method.upper()} group_size {group!r} is not valid")
    return Scheme(method, bits, 0 if group == -1 else group, offset)


@dataclass
class PackedLinear:
    """One linear's codes [N, K] (0 .. 2^bits - 1), zero points and scales [N, groups], and
    the group of each input [K]."""

    codes: Tensor
    zeros: Tensor
    scales: Tensor
    groups: Tensor

    def dequantize(self) -> Tensor:
        g = self.groups
        return (self.codes - self.zeros[:, g]).float() * self.scales[:, g]

    def contiguous_groups(self) -> int:
        """The group size when groups are runs of consecutive inputs (no act-order), else 0."""
        k, n_groups = self.codes.shape[1], self.scales.shape[1]
        size = k // n_groups
        ok = k % n_groups == 0 and torch.equal(self.groups, torch.arange(k) // size)
        return size if ok else 0


def _unpack(words: Tensor, bits: int, dim: int) -> Tensor:
    """int32 words -> their codes, low bits first, spread along `dim` (0: rows, 1: columns)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        codes = (words[:, None, :] >> shifts[None, :, None]) & mask
        return codes.reshape(-1, words.shape[1])
    codes = (words[:, :, None] >> shifts[None, None, :]) & mask
    return codes.reshape(words.shape[0], -1)


def _awq_columns(codes: Tensor) -> Tensor:
    """AWQ's GEMM packing puts column AWQ_ORDER[i] of each 8 in nibble i: undo it."""
    order = torch.tensor(AWQ_ORDER)
    out = torch.empty_like(codes)
    out.view(codes.shape[0], -1, 8)[:, :, order] = codes.view(codes.shape[0], -1, 8)
    return out


def unpack_linear(parts: dict[str, Tensor], s: Scheme, name: str) -> PackedLinear:
    """A linear's packed tensors (PACKED) -> its codes, zero points, scales and groups."""
    scales = parts["scales"].float().t().contiguous()  # [N, G]
    n = scales.shape[0]
    if s.method == "gptq":
        codes = _unpack(parts["qweight"], s.bits, dim=0).t()  # packed along the inputs
        zeros = _unpack(parts["qzeros"], s.bits, dim=1)[:, :n].t() + s.zero_offset
    else:
        codes = _awq_columns(_unpack(parts["qweight"], s.bits, dim=1)).t()
        zeros = _awq_columns(_unpack(parts["qzeros"], s.bits, dim=1)).t()
    k = codes.shape[1]
    if "g_idx" in parts:
        groups = parts["g_idx"].long()
    else:
        groups = torch.arange(k) // (s.groupsize or k)
    if zeros.shape != scales.shape or groups.shape != (k,) or int(groups.max()) >= scales.shape[1]:
        raise QuantConfigError(
            f"{name}: packed tensors of inconsistent shapes (codes {tuple(codes.shape)}, zeros "
            f"{tuple(zeros.shape)}, scales {tuple(scales.shape)}); the checkpoint is damaged"
        )
    return PackedLinear(codes.contiguous(), zeros.contiguous(), scales, groups)


def as_blocks(p: PackedLinear, bits: int) -> tuple[str, np.ndarray] | None:
    """The linear's codes as GGUF blocks (type, uint8 [N, bytes]), or None where they fit none."""
    size = p.contiguous_groups()
    if not size or size % 32:
        return None
    n, k = p.codes.shape
    codes = p.codes.reshape(n, k // 32, 32)
    scale = p.scales.repeat_interleave(size // 32, dim=1).half()  # [N, K/32]
    if not torch.equal(scale.float(), p.scales.repeat_interleave(size // 32, dim=1)):
        return None  # scales a float16 does not hold (bfloat16 ones out of its range)
    zero = p.zeros.repeat_interleave(size // 32, dim=1)
    d = scale.numpy().view(np.uint8).reshape(n, k // 32, 2)
    if bits == 8:
        if not bool((zero == 128).all()):
            return None
        qs = (codes - 128).to(torch.int8).numpy().view(np.uint8)
        return "Q8_0", np.concatenate([d, qs], axis=2).reshape(n, -1)
    nibbles = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8).numpy()
    if bool((zero == 8).all()):
        return "Q4_0", np.concatenate([d, nibbles], axis=2).reshape(n, -1)
    m = (-(zero.float() * scale.float())).half().numpy().view(np.uint8).reshape(n, k // 32, 2)
    return "Q4_1", np.concatenate([d, m, nibbles], axis=2).reshape(n, -1)


def read_quantized(
    tensors: dict[str, Tensor], s: Scheme
) -> tuple[dict[str, Tensor], dict[str, tuple[str, np.ndarray]]]:
    """The checkpoint's tensors with every packed linear as a float32 `.weight`, and the
    blocks of those whose codes fit a block type (keyed by the weight's name)."""
    weights: dict[str, Tensor] = {}
    prefixes = {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".qweight")}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if not (prefix in prefixes and leaf in PACKED):
            weights[name] = t.float()
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    for prefix in sorted(prefixes):
        names = {leaf: f"{prefix}.{leaf}" for leaf in PACKED}
        parts = {leaf: tensors[name] for leaf, name in names.items() if name in tensors}
        missing = {"qweight", "qzeros", "scales"} - parts.keys()
        if missing:
            raise QuantConfigError(
                f"{prefix}: packed linear without {', '.join(sorted(missing))}; the checkpoint "
                "is damaged"
            )
        packed = unpack_linear(parts, s, prefix)
        kept = as_blocks(packed, s.bits)
        if kept is None:
            weights[f"{prefix}.weight"] = packed.dequantize()
            continue
        qtype, raw = kept
        blocks[f"{prefix}.weight"] = kept
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        weights[f"{prefix}.weight"] = torch.from_numpy(values.reshape(packed.codes.shape).copy())
    return weights, blocks
