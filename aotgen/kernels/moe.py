"""The experts of a mixture-of-experts layer: each token through the k experts its router
chose, weighted.

`moe_experts` is a `torch.library` custom op whose eager implementation (transformers' loop
over the routed experts) defines it; CPU float32 graphs call it, and AOTInductor links
`moe.cpp` into each graph's `.so` as its C shim (export/shims.py): each routed expert runs once
per step, over the tokens routed to it. Graphs the kernel does not serve (GPU, bfloat16, ONNX,
autograd) compute the same sum with fixed-shape tensor ops (`experts_without_kernel`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

SOURCE = Path(__file__).with_name("moe.cpp")


@torch.library.custom_op("aotgen::moe_experts", mutates_args=())
def moe_experts(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """x [T, d]; weights / ids [T, k]: each token's routing weights and experts; gate_up
    [E, 2f, d] (gate rows, then up); down [E, d, f]. Returns [T, d]."""
    out = torch.zeros_like(x)
    f = down.shape[2]
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = F.linear(x[token], gate_up[e])
        y = F.linear(F.silu(h[:, :f]) * h[:, f:], down[e])
        out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


@moe_experts.register_fake
def _(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


OPS = (torch.ops.aotgen.moe_experts.default,)


def applies(x: Tensor) -> bool:
    """Whether the kernel runs these experts: float32 on CPU, no gradient wanted."""
    return not x.is_cuda and x.dtype == torch.float32 and not x.requires_grad


def experts_without_kernel(
    x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, gather: bool
) -> Tensor:
    """The same sum with fixed shapes. `gather` (when the T·k routed weight matrices are fewer
    than the E experts: a decode step): each token's k experts' weights are gathered;
    otherwise every expert runs on every token and the router's weights, zero off each
    token's k experts, pick the sum."""
    f = down.shape[2]
    if gather:
        h = torch.einsum("td,tkfd->tkf", x, gate_up[ids])
        y = torch.einsum("tkf,tkdf->tkd", F.silu(h[..., :f]) * h[..., f:], down[ids])
        return (y * weights[..., None].to(y.dtype)).sum(1)
    route = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    route = route.scatter(1, ids, weights.to(x.dtype))
    h = torch.einsum("td,efd->tef", x, gate_up)
    y = torch.einsum("tef,edf->ted", F.silu(h[..., :f]) * h[..., f:], down)
    return (y * route[..., None]).sum(1)
