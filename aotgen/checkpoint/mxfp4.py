"""MXFP4 checkpoints (`quant_method: mxfp4`): gpt-oss's experts as OpenAI releases them.

Each stacked expert tensor `X` of shape [E, rows, cols] is stored as `X_blocks` (uint8 [E,
rows, cols / 32, 16]: two FP4 E2M1 codes a byte, the first in the low nibble) and `X_scales`
(uint8 [E, rows, cols / 32]: a power of two per block of 32 values, exponent + 127, E8M0).
They are read as the float32 tensors they stand for, in the layout transformers gives them
(`[E, cols, rows]`: `gate_up_proj [E, d, 2f]`, `down_proj [E, f, d]`), exactly: every value
is a small multiple of a power of two. Every other tensor is read as float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The 16 values of an E2M1 code: sign, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)


def read(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], int]:
    """Every tensor in float32, each `X_blocks` / `X_scales` pair as `X`; and how many pairs
    there were. A damaged pair raises ValueError naming it."""
    stems = [name.removesuffix("_blocks") for name in tensors if name.endswith("_blocks")]
    weights: dict[str, Tensor] = {}
    for stem in stems:
        scales = tensors.get(f"{stem}_scales")
        if scales is None:
            raise ValueError(f"{stem}_blocks has no {stem}_scales")
        weights[stem] = dequantize(tensors[f"{stem}_blocks"], scales, stem)
    used = {f"{stem}{leaf}" for stem in stems for leaf in ("_blocks", "_scales")}
    weights |= {name: t.float() for name, t in tensors.items() if name not in used}
    return weights, len(stems)


def dequantize(blocks: Tensor, scales: Tensor, name: str = "tensor") -> Tensor:
    """uint8 blocks [E, rows, groups, 16] and scales [E, rows, groups] -> float32
    [E, groups * 32, rows]."""
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.dim() != 4
        or blocks.shape[-1] != 16
        or blocks.shape[:-1] != scales.shape
    ):
        raise ValueError(
            f"{name}: MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales "
            f"{scales.dtype} {tuple(scales.shape)} do not fit [E, rows, groups, 16] and "
            "[E, rows, groups] uint8"
        )
    lut = torch.tensor(FP4_VALUES)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = torch.ldexp(values.flatten(-2), scales.int()[..., None] - 127)
    return values.flatten(-2).transpose(1, 2).contiguous()
