"""`quantize: {gguf: keep}`: linears run on the GGUF file's own blocks (kernels/gguf_blocks.py).

The float weights the build exports went through the checkpoint import (q/k rows un-permuted,
GPT-NeoX's qkv interleaved), the fuse pass (q/k/v and gate/up stacked) and the draft's layer
selection; each of these moves whole rows. So a weight's blocks are found row by row from its
values: every kept row is indexed by a digest of its dequantized float32 bytes, which are the
bytes the checkpoint holds. A weight whose rows are all found runs on their blocks, in segments
of one block type (Gemma's fused q/k/v mixes Q5_0 and Q8_0); any other weight stays float.

The rewrite itself is done by passes/pack.py, with the tiles the build's autotune picks.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import gguf
import numpy as np
from torch import Tensor


@dataclass(frozen=True)
class Segment:
    """Rows start..stop of a weight, all of one block type; `raw` their blocks in that order."""

    qtype: str
    start: int
    stop: int
    raw: np.ndarray


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=16).digest()


class KeepGGUF:
    """The kept blocks of one checkpoint, and what the build kept of them (for its report)."""

    def __init__(self, blocks: dict[str, tuple[str, np.ndarray]], integer_dot: bool = False):
        self.blocks = blocks
        self.integer_dot = integer_dot  # activations quantized per block to int8
        self._rows: dict[bytes, tuple[str, int]] = {}
        for name, (qtype, raw) in blocks.items():
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
            for i, row in enumerate(values.reshape(raw.shape[0], -1)):
                self._rows.setdefault(_digest(row), (name, i))
        self._found: dict[int, list[Segment] | None] = {}
        self.kept: dict[str, str] = {}  # weight name -> its block types
        self.left_float: set[str] = set()  # weights read by something other than linears

    def segments(self, weight: Tensor) -> list[Segment] | None:
        """`weight`'s rows as block segments, or None if any row is not a kept row."""
        if id(weight) not in self._found:
            self._found[id(weight)] = self._find(weight)
        return self._found[id(weight)]

    def _find(self, weight: Tensor) -> list[Segment] | None:
        if weight.dim() != 2:
            return None
        hits = [self._rows.get(_digest(row)) for row in weight.detach().cpu().numpy()]
        if not hits or any(h is None for h in hits):
            return None
        segments: list[Segment] = []
        start = 0
        for i in range(1, len(hits) + 1):
            if i == len(hits) or self.blocks[hits[i][0]][0] != self.blocks[hits[start][0]][0]:
                raw = np.stack([self.blocks[name][1][row] for name, row in hits[start:i]])
                segments.append(Segment(self.blocks[hits[start][0]][0], start, i, raw))
                start = i
        return segments

    def note(self) -> str:
        counts = Counter(t for types in self.kept.values() for t in types.split("+"))
        kinds = ", ".join(f"{t} x{n}" for t, n in sorted(counts.items()))
        numerics = "int8 activations, integer dots" if self.integer_dot else "float activations"
        note = f"gguf keep: {len(self.kept)} weights on the file's blocks ({kinds}; {numerics})"
        if self.left_float:
            note += f"; float: {', '.join(sorted(self.left_float))}"
        return note

    def manifest_entry(self) -> dict:
        return {
            "gguf": "keep",
            "activations": "int8" if self.integer_dot else "float32",
            "weights": dict(sorted(self.kept.items())),
        }
