"""Checkpoints quantized by GPTQ, AWQ, llm-compressor, bitsandbytes, to FP8 or MXFP4 (a
`quantization_config` in config.json: `quant_method` gptq, awq, compressed-tensors,
bitsandbytes (checkpoint/bnb.py), fp8 or mxfp4 (gpt-oss's experts, checkpoint/mxfp4.py)).

Their linears hold integer codes packed into int32 words (or int8), with a scale and a zero
point per group of inputs: w = (q - z) * s. The build reads them as float32 weights, and, where
the codes fit a GGUF block type, also as blocks, so that `quantize: {gguf: keep}` runs the
checkpoint's own codes with the block kernels (passes/gguf_keep.py):

- symmetric 4-bit (z = 8) as Q4_0 and symmetric 8-bit (z = 128) as Q8_0: exact, since every
  32-input block lies in one group and keeps that group's scale as a float16;
- asymmetric 4-bit (AWQ, GPTQ `sym: false`) as Q4_1, whose offset -z * s is a float16: the
  product of a 4-bit integer and a float16 scale rounds to it, by at most 2^-11 of itself (under
  1 % of one quantization step). The float weights are read from those same blocks, so a
  package with or without `gguf: keep` computes one model.

Act-order codes (GPTQ `desc_act`: groups of inputs taken in the order of their activations'
size, `g_idx`) become blocks of the inputs sorted by group; the kept linear gathers its
activations in that order first (passes/pack.py), as ExLlama's kernels do. A linear whose codes
fit no block (8-bit asymmetric, groups not a multiple of 32 inputs, scales a float16 does not
hold) is read as float32 exactly, (q - z) * s, and stays float under `gguf: keep`.
Activation quantization a checkpoint asks for (W8A8) is not applied: the package multiplies
float activations into the weights.

FP8 weights (`quant_method: fp8`, as in Qwen3's and DeepSeek's FP8 releases, and
compressed-tensors `float-quantized`) are float8 values times a scale per tensor, channel,
group or block of weight_block_size; they are read as float32, exactly. No GGUF block holds
them; `quantize: {linear: int8}` quantizes them again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch
from torch import Tensor

from aotgen.checkpoint import bnb, mxfp4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of each nibble in an AWQ (GEMM) word
# a quantized linear's tensors, by method; the first marks one (MARKERS where several may)
LEAVES = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": (
        "weight_scale",
        "weight_packed",
        "weight",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
        "input_scale",  # static activation scales: activations stay float here
        "input_zero_point",
    ),
    "fp8": ("weight_scale_inv", "weight_scale", "weight", "input_scale"),
}
# the leaves that mark a linear as quantized, where not LEAVES' first
MARKERS = {"compressed-tensors": ("weight_scale",), "fp8": ("weight_scale_inv", "weight_scale")}
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
READS = (
    "aotgen reads GPTQ (4/8-bit), AWQ (4-bit, GEMM), FP8, MXFP4, bitsandbytes (NF4, FP4, "
    "LLM.int8) and "
    f"compressed-tensors integer and FP8 ({', '.join(CT_FORMATS)}) checkpoints; use the float "
    "checkpoint"
)


class QuantConfigError(ValueError):
    """A `quantization_config` aotgen cannot read, with what it reads instead."""


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint's codes are packed (config.json `quantization_config`);
    compressed-tensors' bits and groups are read off each linear's tensors."""

    method: str  # gptq | awq | compressed-tensors
    bits: int = 0
    groupsize: int = 0  # inputs per group; 0: a whole row
    zero_offset: int = 0  # added to a stored zero point: GPTQ's original format stores z - 1
    block: tuple[int, int] | None = None  # FP8 scales by block of [outputs, inputs]

    def describe(self) -> str:
        if self.method == "compressed-tensors":
            return "compressed-tensors"
        if self.method == "bitsandbytes":
            return f"bitsandbytes {self.bits}-bit"
        if self.method == "mxfp4":
            return "MXFP4 experts"
        if self.method == "fp8":
            return "FP8" + (f", blocks of {self.block[0]}x{self.block[1]}" if self.block else "")
        groups = f"groups of {self.groupsize}" if self.groupsize else "one group a row"
        return f"{self.method.upper()} {self.bits}-bit, {groups}"


@dataclass
class QuantizedRead:
    """What a quantized checkpoint reads as: every tensor in float32 (packed linears
    dequantized), and the blocks of the linears whose codes fit a block type."""

    weights: dict[str, Tensor]
    blocks: dict[str, tuple[str, np.ndarray]]
    linears: int  # packed linears
    # the blocks' inputs in the weight's input order, where not the identity (act-order)
    orders: dict[str, np.ndarray] = field(default_factory=dict)

    def note(self, s: Scheme) -> str:
        kinds = Counter(qtype for qtype, _ in self.blocks.values())
        fit = ", ".join(f"{t} x{n}" for t, n in sorted(kinds.items()))
        if self.orders:
            fit += f"; {len(self.orders)} in act-order, their inputs permuted in the graph"
        kept = f"their codes as GGUF blocks: {fit} (`quantize: {{gguf: keep}}` runs them)"
        return f"checkpoint {s.describe()}: {self.linears} quantized linears read as float32; " + (
            kept if self.blocks else "no GGUF block type holds their codes"
        )


def scheme(config: dict) -> Scheme | None:
    """The checkpoint's scheme, None for a float checkpoint; a clear error for any other."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantConfigError(f"quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return Scheme("fp8", 8, block=_block(qc.get("weight_block_size"), "weight_block_size"))
    if method == "mxfp4":
        return Scheme("mxfp4", 4)
    if method == "bitsandbytes":
        if not (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
            raise QuantConfigError(f"bitsandbytes config loads neither 4 nor 8 bits: {READS}")
        return Scheme("bitsandbytes", 4 if qc.get("load_in_4bit") else 8)
    if method == "gptq":
        bits, group = qc.get("bits"), qc.get("group_size", -1)
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantConfigError(f"GPTQ checkpoint_format {fmt!r} is not read: {READS}")
        offset = 1 if fmt == "gptq" else 0
    elif method == "awq":
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("zero_point", True) is not True:
            raise QuantConfigError(
                f"AWQ version {version!r} (zero_point {qc.get('zero_point', True)}) is not "
                f"read: {READS}"
            )
        offset = 0
    else:
        raise QuantConfigError(f"checkpoint quantized with {method or '?'!r}: {READS}")
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise QuantConfigError(f"{method.upper()} with {bits} bits is not read: {READS}")
    if not isinstance(group, int) or group == 0 or group < -1:
        raise QuantConfigError(f"{method.upper()} group_size {group!r} is not valid")
    return Scheme(method, bits, 0 if group == -1 else group, offset)


def _block(size: object, what: str) -> tuple[int, int] | None:
    if size is None:
        return None
    pair = isinstance(size, list) and len(size) == 2
    if not (pair and all(isinstance(v, int) and v > 0 for v in size)):
        raise QuantConfigError(f"{what} {size!r} is not [outputs, inputs]")
    return size[0], size[1]


def _compressed_tensors(qc: dict) -> Scheme:
    """Integer weights of 4 or 8 bits, or 8-bit float ones, in every config group; a KV-cache
    scheme is refused."""
    groups = qc.get("config_groups") or {}
    block = None
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        fmt = (group or {}).get("format") or qc.get("format")
        kind = weights.get("type")
        if fmt not in CT_FORMATS or kind not in ("int", "float"):
            raise QuantConfigError(
                f"compressed-tensors group {name}: format {fmt!r}, weights of type {kind!r}: "
                f"{READS}"
            )
        if weights.get("num_bits") not in ((4, 8) if kind == "int" else (8,)):
            raise QuantConfigError(
                f"compressed-tensors group {name}: {weights.get('num_bits')}-bit {kind} "
                f"weights: {READS}"
            )
        if weights.get("strategy") == "block":
            block = _block(weights.get("block_structure"), f"group {name} block_structure")
    if qc.get("kv_cache_scheme"):
        raise QuantConfigError(
            "compressed-tensors kv_cache_scheme is not read (the package keeps its own KV "
            "cache: `kv_cache_dtype` in the recipe); use a checkpoint without it"
        )
    return Scheme("compressed-tensors", block=block)


@dataclass
class PackedLinear:
    """One linear's codes [N, K] (0 .. 2^bits - 1), zero points and scales [N, groups], and
    the group of each input [K]."""

    bits: int
    codes: Tensor
    zeros: Tensor
    scales: Tensor
    groups: Tensor

    def dequantize(self) -> Tensor:
        g = self.groups
        return (self.codes - self.zeros[:, g]).float() * self.scales[:, g]


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


def _gptq_awq(parts: dict[str, Tensor], s: Scheme) -> PackedLinear:
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
    return PackedLinear(s.bits, codes, zeros, scales, groups)


def _compressed(parts: dict[str, Tensor]) -> PackedLinear:
    """pack-quantized: codes + 2^(bits - 1) packed along the inputs (zero points along the
    outputs); int-quantized: signed int8 codes. Bits and groups follow from the shapes."""
    if "weight_packed" in parts:
        n, k = (int(v) for v in parts["weight_shape"])
        bits = 32 * parts["weight_packed"].shape[1] // max(k, 1)
        if bits not in (4, 8):
            raise QuantConfigError(f"weight_packed holds {bits}-bit codes: {READS}")
        codes = _unpack(parts["weight_packed"], bits, dim=1)[:, :k]
        zp = parts.get("weight_zero_point")
        zeros = None if zp is None else _unpack(zp.int(), bits, dim=0)[:n]
    else:
        bits, codes = 8, parts["weight"].int() + 128
        zp = parts.get("weight_zero_point")
        zeros = None if zp is None else zp.int() + 128
    n, k = codes.shape
    scale = parts["weight_scale"].float()  # [N, G] by group, [N, 1] by channel, [1] by tensor
    scales = scale.reshape(-1, scale.shape[-1] if scale.dim() == 2 else 1).expand(n, -1)
    if zeros is None:
        zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int32)
    zeros = zeros.reshape(-1, scales.shape[1]).expand(n, -1)
    size, rest = divmod(k, scales.shape[1])
    if rest:
        raise ValueError(f"{k} inputs in {scales.shape[1]} groups")
    groups = parts["weight_g_idx"].long() if "weight_g_idx" in parts else torch.arange(k) // size
    return PackedLinear(bits, codes, zeros, scales, groups)


def scaled_float(parts: dict[str, Tensor], block: tuple[int, int] | None) -> Tensor:
    """float8 weights [N, K] times their scales: one, one per output, per group of inputs
    ([N, G]) or per block ([ceil(N / rows), ceil(K / cols)], the last block cut short)."""
    w = parts["weight"].float()
    n, k = w.shape
    scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
    if not scale.is_floating_point():
        raise ValueError(f"{scale.dtype} scales (E8M0 exponents stored as integers) are not read")
    scale = scale.float().reshape(-1, 1) if scale.dim() < 2 else scale.float()
    g_rows, g_cols = scale.shape
    if block and (g_rows, g_cols) == (-(-n // block[0]), -(-k // block[1])):
        rows, cols = block
    elif n % g_rows == 0 and k % g_cols == 0:
        rows, cols = n // g_rows, k // g_cols
    else:
        raise ValueError(f"scales {tuple(scale.shape)} for a [{n}, {k}] weight")
    scale = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return w * scale


def unpack_linear(parts: dict[str, Tensor], s: Scheme, name: str) -> PackedLinear:
    """A linear's packed tensors (LEAVES) -> its codes, zero points, scales and groups."""
    try:
        p = _compressed(parts) if s.method == "compressed-tensors" else _gptq_awq(parts, s)
        n, k = p.codes.shape
        consistent = (
            p.zeros.shape == p.scales.shape == (n, p.scales.shape[1])
            and p.groups.shape == (k,)
            and 0 <= int(p.groups.min()) <= int(p.groups.max()) < p.scales.shape[1]
        )
    except (RuntimeError, ValueError, KeyError) as e:
        if isinstance(e, QuantConfigError):
            raise QuantConfigError(f"{name}: {e}") from None
        consistent = False
    if not consistent:
        shapes = ", ".join(f"{leaf} {tuple(t.shape)}" for leaf, t in parts.items())
        raise QuantConfigError(
            f"{name}: packed tensors of inconsistent shapes ({shapes}); the checkpoint is damaged"
        )
    return PackedLinear(p.bits, p.codes.contiguous(), p.zeros.contiguous(), p.scales, p.groups)


def _read_float(parts: dict[str, Tensor], block: tuple[int, int] | None, name: str) -> Tensor:
    if parts["weight"].element_size() != 1 or parts["weight"].dim() != 2:
        raise QuantConfigError(
            f"{name}: {parts['weight'].dtype} weights with scales: 8-bit float ones are read"
        )
    try:
        return scaled_float(parts, block)
    except (RuntimeError, ValueError) as e:
        raise QuantConfigError(f"{name}: {e}; the checkpoint is damaged") from None


def as_blocks(p: PackedLinear) -> tuple[str, np.ndarray, Tensor] | None:
    """The linear's codes as GGUF blocks (type, uint8 [N, bytes]) of its inputs taken in
    `order`, or None where they fit none. The order sorts the inputs by group: the identity
    for groups of consecutive inputs, a permutation for act-order ones (GPTQ `desc_act`),
    whose blocks then need the activations in that order too."""
    n, k = p.codes.shape
    if k % 32:
        return None
    order = torch.argsort(p.groups, stable=True)
    by_block = p.groups[order].view(-1, 32)
    if not bool((by_block == by_block[:, :1]).all()):
        return None  # a block of 32 inputs across two groups
    group = by_block[:, 0]
    codes = p.codes[:, order].reshape(n, k // 32, 32)
    exact = p.scales[:, group]  # [N, K/32]
    scale = exact.half()
    if not torch.equal(scale.float(), exact):
        return None  # scales a float16 does not hold (bfloat16 ones out of its range)
    zero = p.zeros[:, group]
    d = scale.numpy().view(np.uint8).reshape(n, k // 32, 2)
    if p.bits == 8:
        if not bool((zero == 128).all()):
            return None
        qs = (codes - 128).to(torch.int8).numpy().view(np.uint8)
        return "Q8_0", np.concatenate([d, qs], axis=2).reshape(n, -1), order
    nibbles = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8).numpy()
    if bool((zero == 8).all()):
        return "Q4_0", np.concatenate([d, nibbles], axis=2).reshape(n, -1), order
    m = (-(zero.float() * exact)).half().numpy().view(np.uint8).reshape(n, k // 32, 2)
    return "Q4_1", np.concatenate([d, m, nibbles], axis=2).reshape(n, -1), order


def read_quantized(tensors: dict[str, Tensor], s: Scheme) -> QuantizedRead:
    """The checkpoint's tensors with every packed linear as a float32 `.weight`, and the
    blocks of those whose codes fit a block type (keyed by the weight's name)."""
    if s.method in ("bitsandbytes", "mxfp4"):
        try:
            weights, linears = (bnb if s.method == "bitsandbytes" else mxfp4).read(tensors)
        except ValueError as e:
            raise QuantConfigError(f"{e}; the checkpoint is damaged") from None
        return QuantizedRead(weights, {}, linears)
    leaves = LEAVES[s.method]
    markers = MARKERS.get(s.method, leaves[:1])
    prefixes = {name.rpartition(".")[0] for name in tensors if name.rpartition(".")[2] in markers}
    weights: dict[str, Tensor] = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if not (prefix in prefixes and leaf in leaves):
            weights[name] = t.float()
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    orders: dict[str, np.ndarray] = {}
    for prefix in sorted(prefixes):
        names = {leaf: f"{prefix}.{leaf}" for leaf in leaves}
        parts = {leaf: tensors[name] for leaf, name in names.items() if name in tensors}
        if parts.get("weight") is not None and parts["weight"].is_floating_point():
            weights[f"{prefix}.weight"] = _read_float(parts, s.block, prefix)
            continue
        packed = unpack_linear(parts, s, prefix)
        kept = as_blocks(packed)
        if kept is None:
            weights[f"{prefix}.weight"] = packed.dequantize()
            continue
        qtype, raw, order = kept
        name = f"{prefix}.weight"
        blocks[name] = qtype, raw
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        weight = torch.empty(packed.codes.shape)
        weight[:, order] = torch.from_numpy(values.reshape(packed.codes.shape))
        weights[name] = weight
        if not torch.equal(order, torch.arange(len(order))):
            orders[name] = order.numpy()
    return QuantizedRead(weights, blocks, len(prefixes), orders)
