"""A mixture of experts' experts on a GGUF file's own blocks (`quantize: {gguf: keep}`).

`moe_experts_gguf` computes `moe_experts` on gguf's dequantized weights, bit-exact weights in
float32 arithmetic (kernels/gguf_blocks.py); `moe_experts_gguf_dot` in llama.cpp's integer
numerics, each row's activations int8 per block of 32 (kernels/gguf_dot.py). The weights are
`gguf_blocks.pack`'s panels stacked by expert. Both are `torch.library` custom ops whose eager
implementation defines them; AOTInductor links moe.cpp (with gguf_blocks.cpp and gguf_dot.cpp,
whose kernels it runs per routed expert) into each graph's `.so` as their C shims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import gguf_dot, moe

SOURCE = moe.SOURCE


def _blocks_of(codes: Tensor, groups: Tensor, supers: Tensor | None, e: int) -> tuple:
    return codes[e], groups[e], None if supers is None else supers[e]


@torch.library.custom_op("aotgen::moe_experts_gguf", mutates_args=())
def moe_experts_gguf(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up_codes: Tensor,
    gate_up_groups: Tensor,
    gate_up_supers: Tensor | None,
    gate_up_qtype: int,
    down_codes: Tensor,
    down_groups: Tensor,
    down_supers: Tensor | None,
    down_qtype: int,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    limit: float = 0.0,
    alpha: float = 1.702,
) -> Tensor:
    """`moe_experts` with gate_up (2f outputs of d inputs: gate rows, then up) and down (d
    outputs of f inputs) as stacked panels: `[E, ...]` of `gb.pack`'s codes, groups and supers
    (None for the legacy types), their types `QType.index`; outputs whole panels (multiples of
    16, no padding). x float32."""
    gate_up = (gate_up_codes, gate_up_groups, gate_up_supers, gb.BY_INDEX[gate_up_qtype])
    down = (down_codes, down_groups, down_supers, gb.BY_INDEX[down_qtype])

    def project(rows: Tensor, e: int, first: bool) -> Tensor:
        codes, groups, supers, q = gate_up if first else down
        return rows @ gb.dequantize_packed(*_blocks_of(codes, groups, supers, e), q).T

    return moe.routed(x, weights, ids, project, gate_up_bias, down_bias, limit, alpha)


@torch.library.custom_op("aotgen::moe_experts_gguf_dot", mutates_args=())
def moe_experts_gguf_dot(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up_codes: Tensor,
    gate_up_groups: Tensor,
    gate_up_supers: Tensor | None,
    gate_up_qtype: int,
    down_codes: Tensor,
    down_groups: Tensor,
    down_supers: Tensor | None,
    down_qtype: int,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    limit: float = 0.0,
    alpha: float = 1.702,
) -> Tensor:
    """`moe_experts_gguf` in integer numerics: every projection `gguf_dot.reference_dot`."""
    gate_up = (gate_up_codes, gate_up_groups, gate_up_supers, gate_up_qtype)
    down = (down_codes, down_groups, down_supers, down_qtype)

    def project(rows: Tensor, e: int, first: bool) -> Tensor:
        codes, groups, supers, qtype = gate_up if first else down
        return gguf_dot.reference_dot(rows, *_blocks_of(codes, groups, supers, e), qtype)

    return moe.routed(x, weights, ids, project, gate_up_bias, down_bias, limit, alpha)


moe_experts_gguf.register_fake(moe.output_like_x)
moe_experts_gguf_dot.register_fake(moe.output_like_x)

OPS = (torch.ops.aotgen.moe_experts_gguf.default, torch.ops.aotgen.moe_experts_gguf_dot.default)
