"""Weight-only int8 of a mixture of experts' experts, per output channel (symmetric, round to
nearest), applied to the model before export.

The graph-level quantization pass (quantize.py) rewrites linears; the experts are stacked
tensors that the MoE op or a gather reads, so they are quantized here, on the module, whenever
a recipe quantizes a MoE model's linears. The routers stay float, as llama.cpp keeps them: a
routing decision that flips on rounding changes which experts run.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aotgen.kernels import moe
from aotgen.model.moe import Experts


def routers(gated_shared_expert: bool, lfm2: bool = False) -> list[str]:
    """quantize.skip globs of the routers (and Qwen2-MoE's shared-expert gate): kept float.
    LFM2-MoE's router is under `feed_forward`."""
    gate = "*.feed_forward.gate" if lfm2 else "*.mlp.gate"
    return [gate, *(["*.mlp.shared_expert_gate"] if gated_shared_expert else [])]


def int8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """[..., rows, cols] float -> int8 of the same shape and float32 scales [..., rows]."""
    scale = w.abs().amax(-1).float().clamp(min=1e-12) / 127.0
    q = torch.round(w.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Experts(nn.Module):
    """`Experts` with int8 weights and their per-row float32 scales; the biases (gpt-oss) stay
    float, as they were, and the activation's limit and alpha carry over."""

    def __init__(self, experts: Experts):
        super().__init__()
        gate_up, gate_up_scale = int8_rows(experts.gate_up_proj.detach())
        down, down_scale = int8_rows(experts.down_proj.detach())
        self.register_buffer("gate_up_proj", gate_up)
        self.register_buffer("gate_up_scale", gate_up_scale)
        self.register_buffer("down_proj", down)
        self.register_buffer("down_scale", down_scale)
        for name in ("gate_up_proj_bias", "down_proj_bias"):  # None: not in the state dict
            bias = getattr(experts, name)
            self.register_buffer(name, None if bias is None else bias.detach())
        self.limit, self.alpha = experts.limit, experts.alpha

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        return moe.run_experts(
            x,
            weights,
            ids,
            self.gate_up_proj,
            self.down_proj,
            (self.gate_up_scale, self.down_scale),
            self.gate_up_proj_bias,
            self.down_proj_bias,
            self.limit,
            self.alpha,
        )


def quantize_experts(model: nn.Module) -> int:
    """Every `Experts` module swapped for its int8 version; returns how many."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Experts):
                setattr(module, name, Int8Experts(child))
                swapped += 1
    return swapped
