"""A mixture of experts' float32, int8 and bfloat16 experts in packed panels, for CPU graphs
with packed linears (`compile.packed_linears`).

The graph pass (pack.py) repacks linears; the experts are stacked tensors the MoE op reads, so
they are swapped here, on the module, for the AOTInductor export only (ONNX and the eager model
keep the rows). Each expert's projections go into packed.cpp's panels of 16 outputs, and every
graph runs `moe_experts_panels`, decode included: the panels' register tiles read each weight
vector once for all of an expert's rows and widen int8 codes in registers, where the rows'
kernel converts each routed int8 expert to float32 for a BLAS call, and decode gathers each
row's experts (docs/moe.md). bfloat16 experts go on panels where the build measured the CPU's
bfloat16 matmul slower than the panels (passes/pack.py `bf16_rows_faster`): without AVX512-BF16
ATen multiplies bfloat16 matrices with dot products (docs/moe.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from aotgen.kernels import moe
from aotgen.kernels import packed as pk
from aotgen.model.moe import Experts
from aotgen.passes.quantize_experts import Int8Experts


def _panels(stacked: Tensor) -> Tensor:
    """[E, N, K] -> [E, N / 16, K, 16]: each expert as `packed.pack` lays out a linear."""
    return torch.stack([pk.pack(w) for w in stacked.detach()])


# Whether the CPU's bfloat16 matmul beat the panels on an [n, k] weight (PackLinears').
RowsFaster = Callable[[int, int], bool]


def packable(experts: nn.Module, bf16_rows_faster: RowsFaster) -> bool:
    """float32 `Experts` or `Int8Experts` on CPU whose projections are whole panels, and
    bfloat16 ones where neither projection ran faster in rows."""
    if not isinstance(experts, Experts | Int8Experts):
        return False
    gate_up, down = experts.gate_up_proj, experts.down_proj
    dtypes = (torch.float32, torch.int8, torch.bfloat16)
    if gate_up.device.type != "cpu" or gate_up.dtype not in dtypes:
        return False
    if gate_up.shape[1] % pk.PANEL or down.shape[1] % pk.PANEL:
        return False
    shapes = (gate_up.shape[1:], down.shape[1:])
    return gate_up.dtype != torch.bfloat16 or not any(bf16_rows_faster(*s) for s in shapes)


class PanelExperts(nn.Module):
    """`Experts` / `Int8Experts` with each projection in panels (int8: the row scales as they
    are); the biases and the activation carried over."""

    def __init__(self, experts: Experts | Int8Experts):
        super().__init__()
        self.register_buffer("gate_up_proj", _panels(experts.gate_up_proj))
        self.register_buffer("down_proj", _panels(experts.down_proj))
        for name in ("gate_up_scale", "down_scale", "gate_up_proj_bias", "down_proj_bias"):
            value = getattr(experts, name, None)  # None: not in the state dict
            self.register_buffer(name, None if value is None else value.detach())
        self.limit, self.alpha = experts.limit, experts.alpha

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        return moe.moe_experts_panels(
            x, weights, ids,
            self.gate_up_proj, self.gate_up_scale, self.down_proj, self.down_scale,
            self.gate_up_proj_bias, self.down_proj_bias, self.limit, self.alpha,
        )  # fmt: skip


@contextmanager
def experts_on_panels(model: nn.Module, bf16_rows_faster: RowsFaster) -> Iterator[int]:
    """Every packable experts module of `model` swapped for its `PanelExperts` while the block
    runs (yields how many), then put back: export every graph inside one block, so that they
    read the same panels and the package stores them once."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if packable(child, bf16_rows_faster):
                setattr(module, name, PanelExperts(child))
                swapped.append((module, name, child))
    try:
        yield len(swapped)
    finally:
        for module, name, child in swapped:
            setattr(module, name, child)
