"""`quantize: {gguf: keep}`: linears run on the GGUF file's own blocks (kernels/gguf_blocks.py).

The float weights the build exports went through the checkpoint import (q/k rows un-permuted,
GPT-NeoX's qkv interleaved), the fuse pass (q/k/v and gate/up stacked) and the draft's layer
selection; each of these moves whole rows, and tensor-parallel sharding splits them into rows
(column-wise) or into contiguous runs of each row's inputs (row-wise). So a weight's blocks are
found row by row from its values: every kept row is indexed by a digest of its dequantized
float32 bytes, which are the bytes the checkpoint holds, and, for a row-wise shard, every
block-aligned slice of that width. A weight whose rows are all found runs on their blocks, in
segments of one block type (Gemma's fused q/k/v mixes Q5_0 and Q8_0); any other weight (a
shard that cuts a block) stays float. A quantized checkpoint's act-order linear holds blocks of
its inputs in another order: its rows are indexed in the weight's order, and its segments carry
the order the activations are gathered in (q/k/v quantized on one input share one).

The rewrite itself is done by passes/pack.py, with the tiles the build's autotune picks.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import gguf
import numpy as np
from torch import Tensor

from aotgen.kernels import gguf_blocks as gb


@dataclass(frozen=True)
class Segment:
    """Rows start..stop of a weight, all of one block type; `raw` their blocks in that order,
    each row's blocks of the weight's inputs taken in `order` (None: as they come)."""

    qtype: str
    start: int
    stop: int
    raw: np.ndarray
    order: np.ndarray | None = None


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=16).digest()


class BlockIndex:
    """The kept blocks of one checkpoint, indexed by row: built once per checkpoint and shared
    by the models that keep them (a draft made of the target's layers)."""

    def __init__(
        self,
        blocks: dict[str, tuple[str, np.ndarray]],
        orders: dict[str, np.ndarray] | None = None,
    ):
        self.blocks = blocks
        self.orders = orders or {}  # name -> the input behind each block input (act-order)
        # digest of a row (or, by width, of a block-aligned slice of one) -> (name, row, column)
        self._rows = self._index(None)
        self._slices: dict[int, dict[bytes, tuple[str, int, int]]] = {}
        self._found: dict[int, list[Segment] | None] = {}

    def _index(self, width: int | None) -> dict[bytes, tuple[str, int, int]]:
        """Whole rows (width None), or every block-aligned slice of `width` columns: a
        tensor-parallel row-wise shard holds a contiguous run of each row's inputs."""
        index: dict[bytes, tuple[str, int, int]] = {}
        for name, (qtype, raw) in self.blocks.items():
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
            values = values.reshape(raw.shape[0], -1)
            k = values.shape[1]
            if width is not None and (width >= k or k % width or width % gb.QTYPES[qtype].block):
                continue
            if name in self.orders:  # rows as the weight has them; a shard's slice has no blocks
                if width is not None:
                    continue
                values = values[:, np.argsort(self.orders[name])]
            for col in range(0, k, width or k):
                for i, row in enumerate(values[:, col : col + (width or k)]):
                    index.setdefault(_digest(row), (name, i, col))
        return index

    def segments(self, weight: Tensor) -> list[Segment] | None:
        """`weight`'s rows as block segments, or None if any row is not a kept row."""
        if id(weight) not in self._found:
            self._found[id(weight)] = self.find(weight)
        return self._found[id(weight)]

    def find(self, weight: Tensor) -> list[Segment] | None:
        if weight.dim() != 2 or weight.shape[0] == 0:
            return None
        digests = [_digest(row) for row in weight.detach().cpu().numpy()]
        hits = [self._rows.get(d) for d in digests]
        if any(h is None for h in hits):
            width = weight.shape[1]
            if width not in self._slices:
                self._slices[width] = self._index(width)
            hits = [self._slices[width].get(d) for d in digests]
            if any(h is None for h in hits):
                return None
        segments: list[Segment] = []
        start = 0
        for i in range(1, len(hits) + 1):
            qtype, order = self._kind(hits[start][0])
            if i == len(hits) or not self._same(self._kind(hits[i][0]), (qtype, order)):
                raw = np.stack([self._raw(*hit, weight.shape[1]) for hit in hits[start:i]])
                segments.append(Segment(qtype, start, i, raw, order))
                start = i
        return segments

    def _kind(self, name: str) -> tuple[str, np.ndarray | None]:
        """What rows of one segment share: the block type and the input order."""
        return self.blocks[name][0], self.orders.get(name)

    @staticmethod
    def _same(a: tuple[str, np.ndarray | None], b: tuple[str, np.ndarray | None]) -> bool:
        if a[0] != b[0] or (a[1] is None) != (b[1] is None):
            return False
        return a[1] is None or np.array_equal(a[1], b[1])

    def _raw(self, name: str, row: int, col: int, width: int) -> np.ndarray:
        """The blocks of `width` inputs from column `col` of a kept row."""
        qtype, raw = self.blocks[name]
        q = gb.QTYPES[qtype]
        return raw[row, col // q.block * q.block_bytes : (col + width) // q.block * q.block_bytes]


class KeepGGUF:
    """One model's `gguf: keep`: the checkpoint's blocks, the numerics, and what the build kept
    (for its report)."""

    def __init__(self, index: BlockIndex, integer_dot: bool = False):
        self.index = index
        self.integer_dot = integer_dot  # activations quantized per block to int8
        self.kept: dict[str, str] = {}  # weight name -> its block types
        self.left_float: set[str] = set()  # weights read by something other than linears

    def segments(self, weight: Tensor) -> list[Segment] | None:
        return self.index.segments(weight)

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
