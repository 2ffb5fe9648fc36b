"""`quantize: {gguf: keep}` for a mixture of experts' experts: each expert's projections on the
GGUF file's own blocks (kernels/moe_gguf.py: bit-exact weights with float activations, or
llama.cpp's integer numerics with `activations: int8`), applied to the model before export.

The graph pass (pack.py) rewrites linears; the experts are stacked tensors the MoE op reads, so
they are swapped here, on the module. Each expert's rows are found among the kept blocks by
their values, as a linear's are (passes/gguf_keep.py): the import wrote `ffn_{gate,up,down}_exps`
back as one tensor per expert, and the load stacked them again. An expert projection runs on
blocks when every expert's rows are found, all of one block type (gate and up of one type, as
llama.cpp's quantizer writes them), in whole panels of 16 outputs; else the layer's experts
stay float32 and the build's report names them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import moe_gguf
from aotgen.model.moe import Experts
from aotgen.passes.gguf_keep import BlockIndex, KeepGGUF

Packed = tuple[Tensor, Tensor, Tensor | None, int]  # codes, groups, supers, QType.index


def _stacked_blocks(index: BlockIndex, stacked: Tensor) -> Packed | None:
    """[E, N, K] float weights -> every expert's blocks in panels, stacked, or None where an
    expert's rows are not all kept blocks of one type and input order, or N is not whole panels."""
    if stacked.shape[1] % gb.PANEL:
        return None
    packed, types = [], set()
    for e in range(stacked.shape[0]):
        segments = index.find(stacked[e].detach())
        if not segments or len(segments) > 1 or segments[0].order is not None:
            return None
        seg = segments[0]
        types.add(seg.qtype)
        packed.append(gb.pack(gb.decode(seg.raw, seg.qtype, tuple(stacked.shape[1:]))))
    if len(types) > 1:
        return None
    (qtype,) = types
    codes, groups, supers = (
        None if parts[0] is None else torch.stack(parts) for parts in zip(*packed, strict=True)
    )
    return codes, groups, supers, gb.QTYPES[qtype].index


class GGUFExperts(nn.Module):
    """`Experts` on a GGUF file's blocks (biases, where any, and the activation carried over);
    `integer_dot`: int8 activations, integer dot products."""

    def __init__(self, experts: Experts, gate_up: Packed, down: Packed, integer_dot: bool):
        super().__init__()
        self.integer_dot = integer_dot
        for name, (codes, groups, supers, qtype) in (("gate_up", gate_up), ("down", down)):
            self.register_buffer(f"{name}_codes", codes)
            self.register_buffer(f"{name}_groups", groups)
            self.register_buffer(f"{name}_supers", supers)  # None: not in the state dict
            setattr(self, f"{name}_qtype", qtype)
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            bias = getattr(experts, name)
            self.register_buffer(name, None if bias is None else bias.detach())
        self.limit, self.alpha = experts.limit, experts.alpha

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        run = moe_gguf.moe_experts_gguf_dot if self.integer_dot else moe_gguf.moe_experts_gguf
        return run(
            x, weights, ids,
            self.gate_up_codes, self.gate_up_groups, self.gate_up_supers, self.gate_up_qtype,
            self.down_codes, self.down_groups, self.down_supers, self.down_qtype,
            self.gate_up_proj_bias, self.down_proj_bias, self.limit, self.alpha,
        )  # fmt: skip


def keep_experts(model: nn.Module, keep: KeepGGUF) -> int:
    """Every `Experts` module whose projections are all found swapped for `GGUFExperts`;
    recorded in `keep` (kept, or left float). Returns how many were swapped."""
    swapped = 0
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, Experts):
                continue
            where = f"{path}.{name}" if path else name
            gate_up = _stacked_blocks(keep.index, child.gate_up_proj)
            down = _stacked_blocks(keep.index, child.down_proj) if gate_up else None
            if gate_up is None or down is None:
                keep.left_float.add(f"{where} (experts)")
                continue
            setattr(module, name, GGUFExperts(child, gate_up, down, keep.integer_dot))
            keep.kept[f"{where}.gate_up_proj"] = gb.BY_INDEX[gate_up[3]].name
            keep.kept[f"{where}.down_proj"] = gb.BY_INDEX[down[3]].name
            swapped += 1
    return swapped
