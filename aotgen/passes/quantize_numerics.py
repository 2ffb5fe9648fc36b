"""Quantized weights as plain tensors: quantize, dequantize, pack, and the kernels' shapes.

Kernels (CPU):
- int8: `aten._weight_int8pack_mm(x[M, K], w_int8[N, K], scales[N])`, w ≈ w_int8 * scale.
- int4: the kernel of `aten._weight_int4pack_mm_for_cpu(x, packed, groupsize, scales_zeros)`
  with w ≈ (q - 8) * scale + zero per group of `groupsize` inputs, q in 0..15, packed by
  `aten._convert_weight_to_int4pack_for_cpu`, scales_zeros [K / groupsize, N, 2]. The graph
  calls it as `quantized.int4mm_packed_weight_cpu` (see `register_int4_lowering`).
Both are 10-30x slower with float32 activations than with bfloat16 ones (measured on a
2-vCPU AVX-512 AMD EPYC), and take scales in the activation dtype. Scales are rounded to
that dtype *before* the weights are quantized against them, so the kernel sees exactly
the scales the integers were chosen for.

CUDA (a recipe with `device: cuda`; `_weight_int8pack_mm`, `_weight_int4pack_mm` with
tinygemm packing): written to the ops' contracts and probed on the GPU at build time
(`kernel_problem`); tests/test_cuda.py checks them where a GPU is present (docs/cuda.md).

Nothing here knows about graphs: the graph pass (passes/quantize.py) and the tests call
these on single weights.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import Tensor

aten = torch.ops.aten

CUDA_INNER_K_TILES = 8


# ---- quantize / dequantize -------------------------------------------------------------------
def quantize_int8(w: Tensor, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric: w[n] ≈ q[n] * scale[n], q int8 [N, K], scale [N]."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(scale_dtype)
    q = (w / scale.float()[:, None]).round().clamp(-128, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """The weight `quantize_int8` stands for, in float32 (error bounds, GPTQ checks)."""
    return q.float() * scale.float()[:, None]


def quantize_int4(
    w: Tensor,
    groupsize: int,
    scale_dtype: torch.dtype,
    search: bool = True,
    importance: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Group-wise asymmetric: w ≈ (q - 8) * scale + zero per `groupsize` inputs, q in 0..15.

    Starts from each group's min/max; with `search`, also tries clipped ranges and refines
    each by alternating rounding with a least-squares fit of (scale, zero), keeping per
    group whichever has the lowest squared error (min/max is a candidate: never worse).
    Searching cuts the g64 weight error ~14 % on SmolLM2 (whose weights were 4-bit
    already); it costs ~1 s per layer there, min/max alone ~0.05 s.
    `importance` [K] weights each input column's error (llama.cpp's imatrix; GPTQ passes
    the mean squared input of each column), so the 16 levels go where inputs are large.
    Returns q int32 [N, K] and scales_zeros [K / groupsize, N, 2] (the kernels' layout).
    """
    n, k = w.shape
    wg = w.detach().float().reshape(n, k // groupsize, groupsize)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    if importance is None:
        importance = torch.ones(k, device=w.device)
    imp = importance.detach().float().clamp(min=0)
    imp = (imp + 1e-12).reshape(1, k // groupsize, groupsize)

    def fit(scale: Tensor, zero: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = scale.clamp(min=1e-12).to(scale_dtype).float()
        z = zero.to(scale_dtype).float()
        q = ((wg - z[..., None]) / s[..., None] + 8).round().clamp(0, 15)
        err = (imp * ((q - 8) * s[..., None] + z[..., None] - wg).pow(2)).sum(dim=-1)
        return q, s, z, err

    def weighted_mean(x: Tensor) -> Tensor:
        return (imp * x).sum(dim=-1) / imp.sum(dim=-1)

    best = fit((hi - lo) / 15, lo + 8 * (hi - lo) / 15)  # q = 0 lands on the group minimum
    for shrink in (1.0, 0.9) if search else ():
        mid, half = (lo + hi) / 2, (hi - lo) / 2 * shrink
        cand = fit(half / 7.5, mid - half + 8 * half / 7.5)
        for _ in range(2):
            c = cand[0] - 8
            c_mean, w_mean = weighted_mean(c), weighted_mean(wg)
            var = weighted_mean((c - c_mean[..., None]).pow(2))
            cov = weighted_mean((c - c_mean[..., None]) * (wg - w_mean[..., None]))
            scale = torch.where(var > 0, cov / var.clamp(min=1e-12), cand[1])
            cand = fit(scale, w_mean - scale * c_mean)
        better = cand[3] < best[3]
        best = tuple(
            torch.where(better[..., None] if c.dim() == 3 else better, c, b)
            for c, b in zip(cand, best, strict=True)
        )
    q, scale, zero, _ = best
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return q.to(torch.int32).reshape(n, k), scales_zeros.to(scale_dtype)


def dequantize_int4(q: Tensor, scales_zeros: Tensor, groupsize: int) -> Tensor:
    """The weight `quantize_int4` stands for, in float32 (error bounds, GPTQ checks)."""
    n, k = q.shape
    sz = scales_zeros.float().transpose(0, 1)  # [N, K/g, 2]
    qg = q.float().reshape(n, k // groupsize, groupsize)
    return ((qg - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)


# ---- the kernels' layouts and shapes ---------------------------------------------------------
def pack_int4(q: Tensor, device: str) -> Tensor:
    """The kernel's weight layout. CPU: uint8 [N, K/2]. CUDA: tinygemm tiles (gpt-fast's
    packing, two codes per byte, high nibble first)."""
    if device == "cpu":
        return aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
    q8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
    return aten._convert_weight_to_int4pack(q8, CUDA_INNER_K_TILES)


def unpack_int4_cpu(packed: Tensor, groupsize: int) -> Tensor:
    """`pack_int4(q, "cpu")` -> q int32 [N, K]. ATen's CPU layout is blocked; rather than mirror
    it, its own kernel reads the codes back: identity rows times (q - 8) * 1 + 8, exact in
    bfloat16 (one code per output, 0..15)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    ones = torch.stack([torch.ones(k // groupsize, n), torch.full((k // groupsize, n), 8.0)], -1)
    ones = ones.to(torch.bfloat16)
    codes = []
    for start in range(0, k, 512):  # 512 identity rows a call, whatever the model's size
        rows = torch.arange(start, min(start + 512, k))
        eye = torch.zeros(len(rows), k, dtype=torch.bfloat16)
        eye[torch.arange(len(rows)), rows] = 1
        codes.append(aten._weight_int4pack_mm_for_cpu(eye, packed, groupsize, ones))
    return torch.cat(codes).T.round().to(torch.int32).contiguous()


def int4_in_features(n: int, k: int, groupsize: int, device: str) -> tuple[int, str | None]:
    """The in_features the int4 kernel takes for an [N, K] weight, or why it cannot take it.

    K is zero-padded up to a multiple of the group size (and on CUDA of tinygemm's K tile,
    128): the pass pads the activation with zeros to match, so the padded columns add
    nothing. SmolLM2's hidden size 576 becomes 640 for g128 or on CUDA.
    """
    rows, kernel = (16, "the CPU int4 packing") if device == "cpu" else (8, "CUDA tinygemm")
    if n % rows:
        return k, f"{kernel} needs out_features % {rows} == 0, got {n}"
    multiple = groupsize if device == "cpu" else max(groupsize, CUDA_INNER_K_TILES * 16)
    return -(-k // multiple) * multiple, None


def int8_in_features(k: int, device: str) -> int:
    """The in_features the int8 kernel takes: on CPU a multiple of 8, since ATen's AVX2
    `_weight_int8pack_mm` reads past rows of other lengths (wrong results or a crash,
    torch 2.13). Padded like int4's."""
    return -(-k // 8) * 8 if device == "cpu" else k


def pad_in_features(
    w: Tensor, hessian: Tensor | None, in_features: int
) -> tuple[Tensor, Tensor | None]:
    """`w` with zero columns up to `in_features`, and GPTQ's input Hessian with an identity
    block for them (inputs that are always zero; the identity keeps it invertible)."""
    pad = in_features - w.shape[-1]
    if not pad:
        return w, hessian
    w = torch.nn.functional.pad(w.detach(), (0, pad))
    if hessian is not None:
        padded = torch.eye(in_features, dtype=hessian.dtype, device=hessian.device)
        padded[:-pad, :-pad] = hessian
        hessian = padded
    return w, hessian


# ---- the kernels on this platform -------------------------------------------------------------
@cache
def kernel_problem(kind: str, device: str, act: str) -> str | None:
    """Run the kernel once on a tiny weight on `device`: None if it works, else the error."""
    dtype = getattr(torch, act)
    w = torch.randn(64, 128)  # K = 128: one CUDA tinygemm tile
    x = torch.randn(2, 128, dtype=dtype, device=device)
    try:
        if kind == "int8":
            q, s = quantize_int8(w, dtype)
            aten._weight_int8pack_mm(x, q.to(device), s.to(device))
        else:
            q, sz = quantize_int4(w, 32, dtype)
            if device == "cpu":
                g = torch.tensor([32])
                torch.ops.quantized.int4mm_packed_weight_cpu(x, pack_int4(q, "cpu"), g, sz)
            else:
                aten._weight_int4pack_mm(x, pack_int4(q, device), 32, sz.to(device))
    except (RuntimeError, NotImplementedError) as e:
        return str(e).splitlines()[0]
    return None


@cache
def register_int4_lowering() -> None:
    """Lower `quantized.int4mm_packed_weight_cpu` to the extern kernel Inductor itself uses
    for `aten._weight_int4pack_mm_for_cpu` (C shim `aoti_torch_cpu__weight_int4pack_mm_cpu_tensor`).

    Inductor's own lowering of the aten op makes the group size an anonymous constant
    (`constantN`) that a package with weights outside the .so has no value for; without a
    lowering, this op would go through AOTI's slow proxy executor. Inductor internals:
    torch is pinned, and tests/test_quantize.py compiles an int4 graph to catch a change.
    Only the non-autotuned kernel: max_autotune's C++ int4 micro-GEMM is not used.
    """
    from torch._inductor import ir
    from torch._inductor.lowering import register_lowering
    from torch._inductor.mkldnn_ir import WeightInt4PackMatmul

    op = torch.ops.quantized.int4mm_packed_weight_cpu

    @register_lowering(op, type_promotion_kind=None)
    def _lower(x: Any, w: Any, groupsize: Any, scales_zeros: Any) -> Any:
        args = [
            ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(t))
            for t in (x, w, groupsize, scales_zeros)
        ]
        return ir.TensorBox.create(WeightInt4PackMatmul.create(*args))
