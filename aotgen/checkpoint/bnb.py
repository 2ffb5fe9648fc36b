"""bitsandbytes checkpoints (`quant_method: bitsandbytes`) as transformers saves them.

4-bit (NF4 or FP4): two codes a byte, the first in the high nibble, each an index into the
16 values of `weight.quant_map`, times the absmax of its block of `blocksize` weights (in
row-major order); with double quantization the absmaxes are themselves 8-bit codes into
`weight.nested_quant_map`, times a nested absmax per `nested_blocksize`, plus `nested_offset`.
The layout is a JSON object in `weight.quant_state.bitsandbytes__nf4` (or `__fp4`).
8-bit (LLM.int8): int8 rows, each times its `SCB` / 127.

Both are read as the float32 weights they stand for; no GGUF block holds NF4/FP4 values, and
the 8-bit rows' scales are float32.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import torch
from torch import Tensor

STATE = ".weight.quant_state.bitsandbytes__"  # + nf4 | fp4: the JSON layout of a 4-bit linear
FOUR_BIT = (
    "weight",
    "weight.absmax",
    "weight.quant_map",
    "weight.nested_absmax",
    "weight.nested_quant_map",
)
EIGHT_BIT = ("weight", "SCB", "weight_format")


def read(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], int]:
    """Every tensor in float32, the quantized linears' `.weight` dequantized; and how many
    linears were quantized. A damaged linear raises ValueError naming it."""
    four = {name.split(STATE)[0]: name for name in tensors if STATE in name}
    eight = [name.removesuffix(".SCB") for name in tensors if name.endswith(".SCB")]
    weights: dict[str, Tensor] = {}
    used: set[str] = set()
    for prefix, state in four.items():
        parts = _parts(tensors, prefix, FOUR_BIT)
        used |= {f"{prefix}.{leaf}" for leaf in parts} | {state}
        weights[f"{prefix}.weight"] = _checked(prefix, _four_bit, parts, tensors[state])
    for prefix in eight:
        parts = _parts(tensors, prefix, EIGHT_BIT)
        used |= {f"{prefix}.{leaf}" for leaf in parts}
        weights[f"{prefix}.weight"] = _checked(prefix, _eight_bit, parts)
    for name, t in tensors.items():
        if name not in used:
            weights[name] = t.float()
    return weights, len(four) + len(eight)


def _parts(tensors: dict[str, Tensor], prefix: str, leaves: tuple[str, ...]) -> dict[str, Tensor]:
    return {leaf: tensors[f"{prefix}.{leaf}"] for leaf in leaves if f"{prefix}.{leaf}" in tensors}


def _checked(prefix: str, dequantize: Callable[..., Tensor], *args: object) -> Tensor:
    try:
        return dequantize(*args)
    except (KeyError, IndexError, RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{prefix}: bitsandbytes tensors do not fit their layout ({e})") from None


def _four_bit(parts: dict[str, Tensor], state: Tensor) -> Tensor:
    layout = json.loads(bytes(state.numpy()).decode())
    shape, blocksize = [int(v) for v in layout["shape"]], int(layout["blocksize"])
    n = math.prod(shape)
    packed = parts["weight"].contiguous().view(torch.uint8).reshape(-1).long()
    codes = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1)[:n]
    absmax = parts["weight.absmax"]
    if "nested_blocksize" in layout:
        nested = parts["weight.nested_absmax"].float()
        nested = nested.repeat_interleave(int(layout["nested_blocksize"]))[: absmax.numel()]
        absmax = parts["weight.nested_quant_map"].float()[absmax.long()] * nested
        absmax = absmax + float(layout["nested_offset"])
    scale = absmax.float().repeat_interleave(blocksize)[:n]
    if codes.numel() != n or scale.numel() != n:
        raise ValueError(f"{codes.numel()} codes, {scale.numel()} scales for shape {shape}")
    return (parts["weight.quant_map"].float()[codes] * scale).reshape(shape)


def _eight_bit(parts: dict[str, Tensor]) -> Tensor:
    if int(parts.get("weight_format", torch.tensor(0))) != 0:
        raise ValueError("weight_format is not 'row' (0): saved by an old bitsandbytes")
    q, scb = parts["weight"], parts["SCB"].float()
    if q.dtype != torch.int8 or q.dim() != 2 or scb.shape != (q.shape[0],):
        raise ValueError(f"weight {q.dtype} {tuple(q.shape)}, SCB {tuple(scb.shape)}")
    return q.float() * scb[:, None] * (1 / 127)  # as bitsandbytes computes it
