"""The experts of a mixture-of-experts layer: each token through the k experts its router
chose, weighted.

`moe_experts` is a `torch.library` custom op whose eager implementation (transformers' loop
over the routed experts) defines it; CPU graphs call it, and AOTInductor links
`moe.cpp` into each graph's `.so` as its C shim (export/shims.py): each routed expert runs once
per step, over the tokens routed to it. `moe_experts_int8` is the same on int8 experts with
per-row scales (kernels/moe_gguf.py: on a GGUF file's blocks), and `moe_experts_panels` on
float32, bfloat16 or int8 experts in packed.cpp's panels of 16 outputs
(passes/pack_experts.py).
`run_experts` picks the kernel or a fixed-shape formulation (`experts_without_kernel`) by the
graph's rows, device and dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from aotgen.kernels import packed

SOURCE = Path(__file__).with_name("moe.cpp")


def swiglu(gate: Tensor, up: Tensor, limit: float = 0.0, alpha: float = 1.702) -> Tensor:
    """The experts' activation. `limit` 0: SwiGLU, silu(gate) * up. `limit` > 0: gpt-oss's
    clamped SwiGLU, gate clamped above and up to +-limit, then (up + 1) * gate *
    sigmoid(alpha * gate), in transformers' order of operations (GptOssExperts)."""
    if limit <= 0:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@torch.library.custom_op("aotgen::moe_experts", mutates_args=())
def moe_experts(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up: Tensor,
    down: Tensor,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    limit: float = 0.0,
    alpha: float = 1.702,
) -> Tensor:
    """x [T, d]; weights / ids [T, k]: each token's routing weights and experts; gate_up
    [E, 2f, d] (gate rows, then up); down [E, d, f]; optional biases gate_up_bias [E, 2f]
    (gate, then up) and down_bias [E, d], added after each matmul; `limit` / `alpha`: the
    activation (`swiglu`). Returns [T, d]."""

    def project(rows: Tensor, e: int, first: bool) -> Tensor:
        return F.linear(rows, gate_up[e] if first else down[e])

    return routed(x, weights, ids, project, gate_up_bias, down_bias, limit, alpha)


def routed(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    project: Callable[[Tensor, int, bool], Tensor],
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
    limit: float,
    alpha: float,
) -> Tensor:
    """transformers' loop over the routed experts: each expert's rows through `project(rows,
    e, first)` (its gate_up projection when `first`, else its down one), biased, activated,
    and added to its rows' outputs weighted. The ops' eager definitions."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = project(x[token], e, True)
        h = h if gate_up_bias is None else h + gate_up_bias[e].to(h.dtype)
        f = h.shape[1] // 2
        y = project(swiglu(h[:, :f], h[:, f:], limit, alpha), e, False)
        y = y if down_bias is None else y + down_bias[e].to(y.dtype)
        out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


@torch.library.custom_op("aotgen::moe_experts_int8", mutates_args=())
def moe_experts_int8(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up: Tensor,
    gate_up_scale: Tensor,
    down: Tensor,
    down_scale: Tensor,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    limit: float = 0.0,
    alpha: float = 1.702,
) -> Tensor:
    """`moe_experts` on int8 experts, each row scaled: gate_up_scale [E, 2f], down_scale
    [E, d] (weight-only, per output channel); the biases stay float."""
    gate_up = (gate_up * gate_up_scale[..., None]).to(x.dtype)
    down = (down * down_scale[..., None]).to(x.dtype)
    return moe_experts(x, weights, ids, gate_up, down, gate_up_bias, down_bias, limit, alpha)


def unpack_experts(panels: Tensor) -> Tensor:
    """[E, N / 16, K, 16] panels -> [E, N, K] rows (kernels/packed.py `pack`, per expert)."""
    return torch.stack([packed.unpack(p) for p in panels])


@torch.library.custom_op("aotgen::moe_experts_panels", mutates_args=())
def moe_experts_panels(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up: Tensor,
    gate_up_scale: Tensor | None,
    down: Tensor,
    down_scale: Tensor | None,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    limit: float = 0.0,
    alpha: float = 1.702,
) -> Tensor:
    """`moe_experts` (float32, bfloat16) or `moe_experts_int8` (with the scales) on experts in
    panels: gate_up [E, 2f / 16, d, 16], down [E, d / 16, f, 16]. The kernel multiplies in
    float32 whatever the weights (bfloat16 ones widened exactly)."""
    gate_up, down = unpack_experts(gate_up), unpack_experts(down)
    act = (gate_up_bias, down_bias, limit, alpha)
    if gate_up_scale is None or down_scale is None:
        return moe_experts(x, weights, ids, gate_up, down, *act)
    return moe_experts_int8(x, weights, ids, gate_up, gate_up_scale, down, down_scale, *act)


def output_like_x(x: Tensor, *args: object, **kwargs: object) -> Tensor:
    """The ops' shapes for tracing: a new contiguous tensor like `x`."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


moe_experts.register_fake(output_like_x)
moe_experts_int8.register_fake(output_like_x)
moe_experts_panels.register_fake(output_like_x)

OPS = (
    torch.ops.aotgen.moe_experts.default,
    torch.ops.aotgen.moe_experts_int8.default,
    torch.ops.aotgen.moe_experts_panels.default,
)


def applies(x: Tensor) -> bool:
    """Whether the kernel can run these rows: float32 or bfloat16 on CPU, no gradient wanted,
    not an ONNX export."""
    return (
        not x.is_cuda
        and x.dtype in (torch.float32, torch.bfloat16)
        and not x.requires_grad
        and not torch.onnx.is_in_onnx_export()
    )


def run_experts(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up: Tensor,
    down: Tensor,
    scales: tuple[Tensor, Tensor] | None = None,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    limit: float = 0.0,
    alpha: float = 1.702,
) -> Tensor:
    """x [T, d] through each row's routed experts; `scales`: int8 experts' row scales;
    `gate_up_bias` [E, 2f] / `down_bias` [E, d]: the experts' biases (gpt-oss);
    `limit` / `alpha`: the activation (`swiglu`).

    Fewer routed weight matrices than experts (decode, verify): each row's experts are
    gathered, which Inductor fuses into the multiply-sums (faster than the kernel there,
    docs/moe.md). More (prefill, large batches): the kernel on CPU (float32, bfloat16),
    elsewhere every expert on every row (ONNX, GPU, autograd)."""
    t = x.shape[0]
    few = isinstance(t, int) and t * ids.shape[1] < gate_up.shape[0]
    act = (gate_up_bias, down_bias, limit, alpha)
    if not few and applies(x):
        if scales is None:
            return torch.ops.aotgen.moe_experts(x, weights, ids, gate_up, down, *act)
        return torch.ops.aotgen.moe_experts_int8(
            x, weights, ids, gate_up, scales[0], down, scales[1], *act
        )
    return experts_without_kernel(x, weights, ids, gate_up, down, few, scales, *act)


def experts_without_kernel(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up: Tensor,
    down: Tensor,
    gather: bool,
    scales: tuple[Tensor, Tensor] | None = None,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    limit: float = 0.0,
    alpha: float = 1.702,
) -> Tensor:
    """The same sum with fixed shapes. `gather`: each row's k experts' weights (and biases)
    are gathered; otherwise every expert runs on every row and the router's weights, zero off
    each row's k experts, pick the sum."""
    f = down.shape[2]
    if gather:
        h = torch.einsum("td,tkfd->tkf", x, gate_up[ids].to(x.dtype))
        h = h if scales is None else h * scales[0][ids].to(x.dtype)
        h = h if gate_up_bias is None else h + gate_up_bias[ids].to(x.dtype)
        act = swiglu(h[..., :f], h[..., f:], limit, alpha)
        y = torch.einsum("tkf,tkdf->tkd", act, down[ids].to(x.dtype))
        y = y if scales is None else y * scales[1][ids].to(x.dtype)
        y = y if down_bias is None else y + down_bias[ids].to(x.dtype)
        return (y * weights[..., None].to(y.dtype)).sum(1)
    route = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    route = route.scatter(1, ids, weights.to(x.dtype))
    h = torch.einsum("td,efd->tef", x, gate_up.to(x.dtype))
    h = h if scales is None else h * scales[0].to(x.dtype)
    h = h if gate_up_bias is None else h + gate_up_bias.to(x.dtype)
    y = torch.einsum("tef,edf->ted", swiglu(h[..., :f], h[..., f:], limit, alpha), down.to(x.dtype))
    y = y if scales is None else y * scales[1].to(x.dtype)
    y = y if down_bias is None else y + down_bias.to(x.dtype)
    return (y * route[..., None]).sum(1)
