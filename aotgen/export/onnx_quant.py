"""Quantized weights in the ONNX graphs: the quantize pass's schemes as ONNX Runtime's
`com.microsoft::MatMulNBits`, so ORT reads int8 / int4 weights instead of float ones.

The ONNX export runs on the model's modules, not on the passed graphs (the pass's kernels
and the packed linears are AOTInductor-only), so for the export each linear and embedding
the recipe quantizes is swapped for a module holding its MatMulNBits tensors, quantized by
the same functions and scale dtype as the pass: the same integers and scales, the same
dequantized weights. The linear calls `aotgen_onnx::matmul_nbits`, a custom op whose ONNX
translation is one MatMulNBits node.

- int8 per-channel (symmetric, w = q * s): bits 8, codes stored as q + 128 (MatMulNBits'
  default zero point), the channel's scale repeated over its blocks.
- int4 group-wise (w = (q - 8) * s + z, z a float): bits 4 with the default zero point 8,
  plus `z`'s share, sum over each group of x times z: one small MatMul ([T, K/g] x [K/g, N]).
  MatMulNBits takes float zero points too, but ORT 1.32 runs them through a slow
  dequantizing path (docs/onnx.md).
- int8 embedding: Gather on the same uint8 tensor as a tied lm_head (stored once), minus
  128, times the row's scale.

With the default `activations: bfloat16`, MatMulNBits runs at `accuracy_level` 4
(activations quantized to int8 in blocks, ORT's fast CPU path); with `float32`, at 0 (float
math, as the package's float32 kernels). GPTQ (its codes exist only inside the pass) and
`activations: int8` (the block kernels' layouts) keep float weights in the ONNX graphs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from onnx.defs import OpSchema
from onnxscript import values
from torch import Tensor, nn

from aotgen.passes.quantize_numerics import quantize_int4, quantize_int8
from aotgen.passes.quantize_options import QuantizeOptions, Scheme

# The subset of ORT's contrib schema the translation uses (onnx has no contrib schemas).
_SCHEMA = OpSchema(
    "MatMulNBits",
    "com.microsoft",
    1,
    inputs=[
        OpSchema.FormalParameter(n, t) for n, t in (("A", "T1"), ("B", "T2"), ("scales", "T1"))
    ],
    outputs=[OpSchema.FormalParameter("Y", "T1")],
    type_constraints=[("T1", ["tensor(float)"], ""), ("T2", ["tensor(uint8)"], "")],
    attributes=[
        OpSchema.Attribute(a, OpSchema.AttrType.INT, "")
        for a in ("K", "N", "bits", "block_size", "accuracy_level")
    ],
)
MATMUL_NBITS = values.Op(values.Opset("com.microsoft", 1), "MatMulNBits", _SCHEMA)
# MatMulNBits' accuracy_level per `quantize.activations`: 0 computes in float32 (the
# package's float32 kernels), 4 quantizes activations to int8 blocks (ORT's fast path; the
# AOTInductor kernels round them to bfloat16).
ACCURACY_LEVEL = {"float32": 0, "bfloat16": 4}
INT8_BLOCK = 64  # per-channel int8 as blocks of one scale each (a power of 2, >= 16)


@torch.library.custom_op("aotgen_onnx::matmul_nbits", mutates_args=())
def matmul_nbits(
    x: Tensor, b: Tensor, scales: Tensor, k: int, n: int, bits: int, block_size: int, level: int
) -> Tensor:
    """MatMulNBits' contract (default zero point 2^(bits-1)); eager for checks only."""
    codes = b.to(torch.int16)
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1)
    codes = codes.reshape(n, -1)[:, :k].float() - 2 ** (bits - 1)
    w = codes * scales.repeat_interleave(block_size, dim=1)[:, :k]
    return x @ w.T


@matmul_nbits.register_fake
def _(
    x: Tensor, b: Tensor, scales: Tensor, k: int, n: int, bits: int, block_size: int, level: int
) -> Tensor:
    return x.new_empty(*x.shape[:-1], n)


def _matmul_nbits_onnx(x, b, scales, k: int, n: int, bits: int, block_size: int, level: int):
    return MATMUL_NBITS(
        x, b, scales, K=k, N=n, bits=bits, block_size=block_size, accuracy_level=level
    )


TRANSLATIONS = {torch.ops.aotgen_onnx.matmul_nbits.default: _matmul_nbits_onnx}


def _blocks(x: Tensor, block: int) -> Tensor:
    """[..., K] -> [..., ceil(K / block), block], zero-padded."""
    pad = -x.shape[-1] % block
    return nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, block)


class QuantLinear(nn.Module):
    """A linear as MatMulNBits (+ the int4 zeros' term, + bias)."""

    def __init__(
        self, linear: nn.Linear, b: Tensor, scales: Tensor, zeros: Tensor | None, *args: int
    ):
        super().__init__()
        self.n, self.k = linear.weight.shape
        self.bits, self.block, self.level = args
        self.register_buffer("b", b)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)  # [K / g, N]: int4's float zero per group, or None
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        args = (self.k, self.n, self.bits, self.block, self.level)
        y = matmul_nbits(x, self.b, self.scales, *args)
        if self.zeros is not None:
            y = y + _blocks(x, self.block).sum(-1) @ self.zeros
        return y if self.bias is None else y + self.bias


class QuantEmbedding(nn.Module):
    """int8 rows gathered from MatMulNBits' uint8 codes (q + 128), times the row's scale."""

    def __init__(self, b: Tensor, row_scales: Tensor, dim: int):
        super().__init__()
        self.register_buffer("b", b)
        self.register_buffer("row_scales", row_scales)
        self.dim = dim

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.flatten()
        rows = self.b.index_select(0, flat).reshape(*ids.shape, -1)[..., : self.dim]
        scales = self.row_scales.index_select(0, flat).reshape(*ids.shape, 1)
        return (rows.float() - 128) * scales


def onnx_fallback(options: QuantizeOptions) -> str | None:
    """Why the ONNX graphs of a model quantized with `options` keep float weights, if so."""
    if options.method == "gptq":
        return "GPTQ's codes exist only inside the quantize pass"
    if options.activations == "int8":
        return "the int8-activation block kernels' layouts are not mapped to ONNX"
    return None


def _scheme(options: QuantizeOptions, names: tuple[str, ...], linear: bool) -> Scheme | None:
    """The pass's choice for one op (passes/quantize.py `_scheme_for`)."""
    if any(fnmatch.fnmatchcase(n, p) for p in options.skip for n in names):
        return None
    if linear:
        hit = (s for p, s in options.overrides if any(fnmatch.fnmatchcase(n, p) for n in names))
        return next(hit, options.linear)
    return options.embedding


class _Quantizer:
    """MatMulNBits tensors per (weight, scheme), made once: tied weights share them."""

    def __init__(self, options: QuantizeOptions):
        self.scale_dtype = getattr(torch, options.activations)
        self.level = ACCURACY_LEVEL.get(options.activations, 4)
        self.cache: dict[tuple[int, Scheme], tuple[Tensor, ...]] = {}
        self.labels: dict[str, str] = {}  # module path -> "int8 (MatMulNBits 8-bit)" etc.

    def int8(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(codes + 128 as uint8 [N, K/64, 64], block scales [N, K/64], row scales [N])."""
        key = (id(w), Scheme("int8"))
        if key not in self.cache:
            q, s = quantize_int8(w, self.scale_dtype)
            b = _blocks(q.to(torch.int16) + 128, INT8_BLOCK).to(torch.uint8)
            s = s.float()
            self.cache[key] = (b, s[:, None].expand(-1, b.shape[1]).contiguous(), s)
        return self.cache[key]

    def int4(self, w: Tensor, g: int) -> tuple[Tensor, Tensor, Tensor]:
        """(two codes a byte, low nibble first [N, K/g, g/2], scales [N, K/g], zeros [K/g, N])."""
        key = (id(w), Scheme("int4", g))
        if key not in self.cache:
            q, sz = quantize_int4(_blocks(w.detach(), g).flatten(-2), g, self.scale_dtype)
            q = q.reshape(w.shape[0], -1, g // 2, 2).to(torch.uint8)
            b = q[..., 0] | q[..., 1] << 4
            sz = sz.float()  # [K/g, N, 2]
            self.cache[key] = (b, sz[..., 0].T.contiguous(), sz[..., 1].contiguous())
        return self.cache[key]

    def linear(self, name: str, mod: nn.Linear, scheme: Scheme) -> nn.Module:
        if scheme.kind == "int8":
            b, scales, _ = self.int8(mod.weight)
            self.labels[name] = "int8: MatMulNBits bits 8"
            return QuantLinear(mod, b, scales, None, 8, INT8_BLOCK, self.level)
        b, scales, zeros = self.int4(mod.weight, scheme.groupsize)
        self.labels[name] = f"int4-g{scheme.groupsize}: MatMulNBits bits 4 + zeros MatMul"
        return QuantLinear(mod, b, scales, zeros, 4, scheme.groupsize, self.level)

    def embedding(self, name: str, mod: nn.Embedding) -> nn.Module:
        b, _, row_scales = self.int8(mod.weight)
        self.labels[name] = "int8: Gather of the uint8 codes"
        return QuantEmbedding(b, row_scales, mod.embedding_dim)


def _swaps(model: nn.Module, options: QuantizeOptions) -> tuple[dict[str, nn.Module], _Quantizer]:
    quantizer = _Quantizer(options)
    swaps = {}
    for name, mod in model.named_modules():
        linear = isinstance(mod, nn.Linear)
        if not linear and not isinstance(mod, nn.Embedding):
            continue
        scheme = _scheme(options, (name, f"{name}.weight"), linear)
        if scheme is None:
            continue
        if linear:
            swaps[name] = quantizer.linear(name, mod, scheme)
        elif scheme.kind == "int8":
            swaps[name] = quantizer.embedding(name, mod)
    return swaps, quantizer


@contextmanager
def quantized_modules(
    model: nn.Module, options: QuantizeOptions | None
) -> Iterator[dict[str, str]]:
    """`model` with the linears / embeddings `options` quantizes swapped for their
    MatMulNBits forms while the block runs; yields module path -> how it is stored."""
    if options is None or onnx_fallback(options):
        yield {}
        return
    swaps, quantizer = _swaps(model, options)
    originals = {name: model.get_submodule(name) for name in swaps}
    try:
        for name, mod in swaps.items():
            _set(model, name, mod)
        yield quantizer.labels
    finally:
        for name, mod in originals.items():
            _set(model, name, mod)


def _set(model: nn.Module, name: str, mod: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, mod)
