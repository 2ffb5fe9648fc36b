"""How a KV cache stores a row (one position of one head): float32 or bfloat16 as they are, or
int8 codes with their own scale (`kv_cache_dtype: int8`).

An int8 row of `d` values holds `d` codes `round(x / s)`, `s = max|x| / 127`, then the 4 bytes of
`s` as float32: `d + 4` int8 a row, one tensor per layer's keys or values as for the other
dtypes, so both runtimes allocate, copy and move rows without knowing the format. A scale per
row (llama.cpp's q8_0 keeps one per 32 values) costs 4 bytes in 68 at head_dim 64 and needs no
block bookkeeping in the kernel: it multiplies a key's score, or a value's weight, once.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_BYTES = 4  # an int8 row's float32 scale, after its codes
CODE_MAX = 127


def row_width(dim: int, dtype: torch.dtype) -> int:
    """Elements a cache row of `dim` values takes in `dtype`."""
    return dim + SCALE_BYTES if dtype == torch.int8 else dim


def encode_rows(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x [..., d]` as cache rows of `dtype`: a cast, or for int8 `[..., d + 4]` codes and scale
    (a row of zeros codes as zeros with scale 0)."""
    if dtype != torch.int8:
        return x.to(dtype)
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / CODE_MAX
    codes = torch.where(scale > 0, x / scale, 0.0).round().to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], -1)


def decode_rows(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """Cache rows back to `[..., d]` values of `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    codes, scale = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:].contiguous()
    return (codes.float() * scale.view(torch.float32)).to(dtype)
