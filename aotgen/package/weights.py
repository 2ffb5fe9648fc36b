"""The package's weights file: safetensors laid out so both runtimes use it in place.

`safetensors.save_file` packs tensors back to back after an 8-byte-aligned header, so a
memory-mapped tensor is only 8-byte aligned, and the compiled kernels ran 2.5x slower on
such weights (misaligned AVX-512 loads): the runtimes had to copy every tensor (0.5 s for
SmolLM2). Here the header is padded so data starts at a multiple of 64 bytes, and a `U8`
filler tensor named `__pad*` precedes any tensor that would not start on one (the format
requires the data section to be covered with no gaps). The file stays a valid safetensors
file for every reader; the runtimes skip the fillers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import Tensor

ALIGN = 64
PAD_PREFIX = "__pad"

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def save_aligned(tensors: dict[str, Tensor], path: Path) -> None:
    """Write `tensors` (sorted by name) with every tensor's data 64-byte aligned in the file."""
    header: dict[str, dict] = {}
    pieces: list[Tensor] = []
    offset = 0
    for name in sorted(tensors):
        if name.startswith(PAD_PREFIX):
            raise ValueError(f"tensor name {name!r} is reserved for alignment padding")
        t = tensors[name].detach().contiguous()
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
        gap = -offset % ALIGN
        if gap:
            header[f"{PAD_PREFIX}{len(header)}"] = {
                "dtype": "U8",
                "shape": [gap],
                "data_offsets": [offset, offset + gap],
            }
            pieces.append(torch.zeros(gap, dtype=torch.uint8))
            offset += gap
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        pieces.append(t)
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)  # readers strip trailing spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in pieces:
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def is_padding(name: str) -> bool:
    return name.startswith(PAD_PREFIX)


def save_constants(path: Path, tensors: dict[str, Tensor]) -> tuple[dict[str, str], int]:
    """Write each distinct tensor once; names that share storage become aliases."""
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    by_storage: dict[tuple, str] = {}
    for name in sorted(tensors):
        t = tensors[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in by_storage:
            aliases[name] = by_storage[key]
        else:
            by_storage[key] = name
            unique[name] = t.contiguous().cpu()
    save_aligned(unique, path)
    return aliases, sum(t.numel() * t.element_size() for t in unique.values())
