"""Linears onto the packed-panel kernels (kernels/packed.py), as a graph pass.

Every CPU linear with a float32 or bfloat16 weight (`aten.linear`) or an int8 per-channel
weight (the quantize pass's `_weight_int8pack_mm`) becomes `aotgen.packed_linear[_bf16|_int8]`
on the weight repacked into 16-output panels, with the tile the build's autotune measured
fastest for the graph's row count (package/autotune.py). An embedding that shares its table
with a packed head (tied embeddings) gathers its rows from the panels, so the weight is stored
once. A bfloat16 weight stays row-major where the CPU's own bfloat16 matmul (oneDNN; AMX tiles
where the CPU has them) measured faster at one of the model's row counts above one.

A weight is left as it is when anything else reads it: packing it would need a second copy.
Those linears keep the row-major paths (passes/gemv.py for few rows, BLAS / the extern kernels
for prefill).

With `quantize: {gguf: keep}` a float32 weight whose rows are a GGUF file's kept blocks
(passes/gguf_keep.py) runs on those blocks instead (kernels/gguf_blocks.py), one op per
segment of one block type, on its activations gathered in the segment's input order where it
has one (an act-order checkpoint's); a tied embedding reads its rows from the head's blocks
(one block type in the file's input order, as llama.cpp's quantizer writes a tied table).

The int8-activation block linears of `quantize: {activations: int8}` (kernels/block_dot.py, the
drafts') run on `gguf_dot`'s panels as well: their weights are Q4_1 / Q8_0 blocks
(`block_dot.as_gguf`), and gguf_dot's register tiles multiply each weight unit into every row
(block_dot.cpp goes row by row). The numbers are the same (same activation codes, same integer
sums, float sums in another order). One kernel per weight, so it is stored once: block_dot.cpp
only where the autotune measured it faster at every row count the model's graphs run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.fx import Node

from aotgen.kernels import block_dot as bd
from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import gguf_dot
from aotgen.kernels import packed as pk
from aotgen.passes.fx import (
    WeightEditor,
    emit,
    float32_result,
    is_cast_from_float32,
    view_dims,
)
from aotgen.passes.gguf_keep import KeepGGUF, Segment
from aotgen.passes.quantize_numerics import unpack_int4_cpu

aten = torch.ops.aten
INT8_MM = aten._weight_int8pack_mm.default
INT4_MM = torch.ops.quantized.int4mm_packed_weight_cpu.default

# (kind, n, k, rows) -> (tile rows, tile panels): the autotune's choice. For the block kinds
# (`block-int4` / `block-int8`), BLOCK_DOT where block_dot.cpp measured faster; for bfloat16
# at several rows, ROW_MAJOR where F.linear did.
TileChooser = Callable[[str, int, int, int], tuple[int, int]]
BLOCK_DOT = (0, 0)  # the autotune's answer: keep block_dot.cpp
ROW_MAJOR = (-1, -1)  # its answer for a bfloat16 shape that F.linear ran faster
BLOCK_BITS = {bd.OP_FOR["int4"]: 4, bd.OP_FOR["int8"]: 8}


class PackLinears:
    """One model's pass: call it on each graph with the graph's row count; packed weights are
    shared by every graph, so the package stores each once."""

    def __init__(
        self, choose_tile: TileChooser, gguf: KeepGGUF | None = None, rows: tuple[int, ...] = ()
    ):
        self.choose_tile = choose_tile
        self.gguf = gguf
        self.rows = rows  # every graph's row count: block linears pick one kernel for all
        self._dot: dict[int, tuple[Tensor, tuple | None]] = {}  # id(block weight) -> panels
        self._int4: dict[int, tuple[Tensor, tuple]] = {}  # id(int4 weight) -> Q4_1 panels
        self._packed: dict[int, tuple[Tensor, Tensor, Tensor | None]] = {}  # id(source) -> ...
        self._row_major: dict[int, tuple[Tensor, bool]] = {}  # id(bf16 weight) -> kept as is
        self._blocks: dict[int, tuple[Tensor, list[tuple[Segment, tuple]]]] = {}
        self.packed_names: set[str] = set()
        self.int4_names: set[str] = set()  # int4 weights moved onto Q4_1 panels

    def __call__(self, ep: ExportedProgram, rows: int) -> ExportedProgram:
        edit = WeightEditor(ep)
        linears = [
            n
            for n in edit.graph.nodes
            if n.op == "call_function" and n.target in (aten.linear.default, INT8_MM)
        ]
        for weight in dict.fromkeys(n.args[1] for n in linears):  # each weight once
            found = edit.weight(weight)
            if found is None or not self._packable(found[1], weight):
                continue
            if found[1].dtype == torch.bfloat16 and self._bf16_row_major(found[1]):
                continue
            segments = None
            if self.gguf is not None and found[1].dtype == torch.float32:
                segments = self.gguf.segments(found[1])
            if segments:
                self._rewrite_on_blocks(edit, weight, found, segments, rows)
            else:
                self._rewrite_users(edit, weight, found, rows)
        blocks = [n for n in edit.graph.nodes if n.op == "call_function" and n.target in BLOCK_BITS]
        for node in blocks:
            self._block_dot_linear(edit, node, rows)
        for node in [n for n in edit.graph.nodes if n.target == INT4_MM]:
            self._int4_linear(edit, node, rows)
        return edit.finish()

    @staticmethod
    def _packable(t: Tensor, weight: Node) -> bool:
        """Every reader is a linear on `weight` (`aten.linear` on a float32 or bfloat16 one, the
        int8 kernel on an int8 one) or an embedding; at most one leading dim of the activations
        is symbolic."""
        if t.device.type != "cpu" or t.dim() != 2:
            return False
        if t.dtype not in (torch.float32, torch.bfloat16, torch.int8):
            return False
        linear = INT8_MM if t.dtype == torch.int8 else aten.linear.default
        for user in weight.users:
            if user.target == linear and user.args[1] is weight:
                dims = user.args[0].meta["val"].shape[:-1]
                if sum(not isinstance(d, int) for d in dims) > 1:
                    return False
            elif not (user.target == aten.embedding.default and user.args[0] is weight):
                return False
        return True

    def _bf16_row_major(self, t: Tensor) -> bool:
        """Whether a bfloat16 weight keeps the row-major paths: F.linear measured faster than
        the panels at a row count above one of some graph (one decision for all graphs, which
        share the weight)."""
        if id(t) not in self._row_major:
            self._row_major[id(t)] = (t, self.bf16_rows_faster(*t.shape))
        return self._row_major[id(t)][1]

    def bf16_rows_faster(self, n: int, k: int) -> bool:
        """Whether F.linear on a row-major bfloat16 [n, k] weight measured faster than the
        panels at some graph's row count above one (the CPU's own bfloat16 matmul: oneDNN)."""
        several = [r for r in dict.fromkeys(self.rows) if r > 1]
        return any(self.choose_tile("bfloat16", n, k, r) == ROW_MAJOR for r in several)

    def _weights(
        self, edit: WeightEditor, weight: Node, target: str, t: Tensor
    ) -> tuple[Node, Node | None]:
        """The placeholders of `t` packed, and for int8 of its linear's scales (padded to whole
        panels; an embedding sharing the weight keeps reading its own)."""
        if id(t) not in self._packed:
            scale = None
            int8_users = [u for u in weight.users if u.target == INT8_MM]
            if int8_users:
                s = edit.weight(int8_users[0].args[2])[1].float()
                scale = torch.cat([s, s.new_zeros(pk.padded_outputs(len(s)) - len(s))])
            self._packed[id(t)] = (t, pk.pack(t), scale)
        _, packed, scale = self._packed[id(t)]
        self.packed_names.add(target)
        w = edit.add(f"{target}_packed", packed)
        return w, (edit.add(f"{target}_packed_scales", scale) if scale is not None else None)

    def _rewrite_users(
        self, edit: WeightEditor, weight: Node, found: tuple[str, Tensor], rows: int
    ) -> None:
        target, t = found
        w, scale = self._weights(edit, weight, target, t)
        for user in list(weight.users):
            with edit.graph.inserting_before(user):
                add = partial(emit, edit.graph, user)
                if user.target == aten.embedding.default:
                    out = _gather(add, w, user.args[1])
                else:
                    out = self._linear(add, user, w, scale, rows)
            user.replace_all_uses_with(out)
            edit.graph.erase_node(user)

    def _linear(
        self, add: Callable[..., Node], node: Node, w: Node, scale: Node | None, rows: int
    ) -> Node:
        x, weight, *rest = node.args
        bias = rest[0] if rest and scale is None else None
        n, k = weight.meta["val"].shape
        if scale is not None and is_cast_from_float32(x):
            x = x.args[0]  # the bf16 cast was for the int8 kernel; this one reads float32
        lead = view_dims(x.meta["val"].shape[:-1])  # the leading dims back as they were
        flat = add(aten.reshape.default, x, [-1, k])
        if x.meta["val"].dtype != torch.float32:  # exact: bfloat16 values are float32 values
            flat = add(aten._to_copy.default, flat, dtype=torch.float32)
        dtype = w.meta["val"].dtype  # the autotune's kind: float32 | bfloat16 | int8
        tile = self.choose_tile(str(dtype).removeprefix("torch."), n, k, _rows(lead, rows))
        if tile == ROW_MAJOR:  # a row count `_bf16_row_major` did not ask about
            tile = (min(_rows(lead, rows), 8), 1)
        weights = (w,) if scale is None else (w, scale)
        out = add(pk.OP_FOR[dtype], flat, *weights, *tile)
        if pk.padded_outputs(n) != n:
            out = add(aten.slice.Tensor, out, 1, 0, n)
        out = add(aten.reshape.default, out, [*lead, n])
        if bias is not None:
            out = add(aten.add.Tensor, out, bias)
        return float32_result(add, node, out)

    # ---- GGUF blocks ---------------------------------------------------------------------------
    def _block_weights(
        self, edit: WeightEditor, target: str, t: Tensor, segments: list[Segment]
    ) -> list[tuple[Segment, gb.QType, list[Node]]]:
        """Each segment's packed blocks as placeholders (packed once, shared by all graphs)."""
        if id(t) not in self._blocks:
            packed = []
            for seg in segments:
                dec = gb.decode(seg.raw, seg.qtype, (seg.stop - seg.start, t.shape[1]))
                packed.append((seg, gb.pack(dec)))
            self._blocks[id(t)] = (t, packed)
        self.packed_names.add(target)
        out = []
        orders: dict[bytes, Node] = {}  # one placeholder per input order, however many segments
        for i, (seg, tensors) in enumerate(self._blocks[id(t)][1]):
            names = ("codes", "groups", "supers")
            nodes = [
                edit.add(f"{target}_gguf{i}_{name}", tensor)
                for name, tensor in zip(names, tensors, strict=True)
                if tensor is not None
            ]
            key = None if seg.order is None else seg.order.tobytes()
            if key is not None and key not in orders:
                orders[key] = edit.add(f"{target}_gguf{i}_order", torch.from_numpy(seg.order))
            order = None if key is None else orders[key]
            out.append((seg, gb.QTYPES[seg.qtype], nodes, order))
        return out

    def _rewrite_on_blocks(
        self,
        edit: WeightEditor,
        weight: Node,
        found: tuple[str, Tensor],
        segments: list[Segment],
        rows: int,
    ) -> None:
        target, t = found
        pieces = self._block_weights(edit, target, t, segments)
        for user in list(weight.users):
            with edit.graph.inserting_before(user):
                add = partial(emit, edit.graph, user)
                if user.target != aten.embedding.default:
                    out = self._block_linear(add, user, pieces, rows)
                elif len(pieces) == 1 and pieces[0][3] is None:  # one type, the file's order
                    out = _gather_rows(add, user, pieces[0][1], pieces[0][2])
                else:  # the embedding keeps reading the float weight
                    self.gguf.left_float.add(target)
                    continue
            user.replace_all_uses_with(out)
            edit.graph.erase_node(user)
        self.gguf.kept[target] = "+".join(dict.fromkeys(s.qtype for s in segments))

    def _block_linear(self, add: Callable[..., Node], node: Node, pieces: list, rows: int) -> Node:
        x, weight, *rest = node.args
        bias = rest[0] if rest else None
        n, k = weight.meta["val"].shape
        lead = view_dims(x.meta["val"].shape[:-1])
        flat = add(aten.reshape.default, x, [-1, k])
        if x.meta["val"].dtype != torch.float32:
            flat = add(aten._to_copy.default, flat, dtype=torch.float32)
        integer = self.gguf.integer_dot  # llama.cpp's numerics, else exact float ones
        ops, kind = (gguf_dot.OPS, "gguf-dot-") if integer else (gb.OPS, "gguf-")
        outs = []
        gathered: dict[Node, Node] = {}  # an act-order segment's inputs, by its order
        for seg, q, tensors, order in pieces:
            size = seg.stop - seg.start
            tile = self.choose_tile(f"{kind}{q.name}", size, k, _rows(lead, rows))
            x_seg = flat
            if order is not None:
                if order not in gathered:
                    gathered[order] = add(aten.index_select.default, flat, 1, order)
                x_seg = gathered[order]
            out = add(ops[1] if q.n_supers else ops[0], x_seg, *tensors, q.index, *tile)
            if pk.padded_outputs(size) != size:
                out = add(aten.slice.Tensor, out, 1, 0, size)
            outs.append(out)
        out = outs[0] if len(outs) == 1 else add(aten.cat.default, outs, 1)
        out = add(aten.reshape.default, out, [*lead, n])
        if bias is not None:
            out = add(aten.add.Tensor, out, bias)
        return float32_result(add, node, out)

    # ---- block_dot's int4 / int8 weights ------------------------------------------------------
    def _block_dot_linear(self, edit: WeightEditor, node: Node, rows: int) -> None:
        """`node` (block_dot's op) onto gguf_dot's panels of the same blocks, unless the
        autotune keeps block_dot.cpp for its weight or something else reads the weight."""
        x, weight, scales = node.args
        found, found_scales = edit.weight(weight), edit.weight(scales)
        readers = {*weight.users, *scales.users}
        if found is None or found_scales is None or found[1].device.type != "cpu":
            return
        if any(u.target not in BLOCK_BITS or u.args[1:] != (weight, scales) for u in readers):
            return
        (target, t), bits = found, BLOCK_BITS[node.target]
        n, k = t.shape[0], x.meta["val"].shape[-1]
        rows = _rows(view_dims(x.meta["val"].shape[:-1]), rows)
        kind = f"block-int{bits}"
        if id(t) not in self._dot:
            counts = dict.fromkeys((*self.rows, rows))
            on_panels = any(self.choose_tile(kind, n, k, r) != BLOCK_DOT for r in counts)
            packed = gb.pack(bd.as_gguf(bits, t, found_scales[1])) if on_panels else None
            self._dot[id(t)] = (t, packed)
        packed = self._dot[id(t)][1]
        if packed is None:
            return
        q = gb.QTYPES["Q4_1" if bits == 4 else "Q8_0"]
        tile = self.choose_tile(kind, n, k, rows)
        if tile == BLOCK_DOT:  # faster here, not at another row count: the panels' best tile
            tile = self.choose_tile(f"gguf-dot-{q.name}", n, k, rows)
        self.packed_names.add(target)
        codes, groups, _ = packed
        codes = edit.add(f"{target}_gguf_codes", codes)
        groups = edit.add(f"{target}_gguf_groups", groups)
        with edit.graph.inserting_before(node):
            add = partial(emit, edit.graph, node)
            out = add(gguf_dot.OPS[0], x, codes, groups, q.index, *tile)
            if pk.padded_outputs(n) != n:
                out = add(aten.slice.Tensor, out, 1, 0, n)
        node.replace_all_uses_with(out)
        edit.graph.erase_node(node)

    # ---- int4 group-wise weights (the quantize pass's ATen kernel) ------------------------------
    def _int4_linear(self, edit: WeightEditor, node: Node, rows: int) -> None:
        """`node` (ATen's int4 kernel, bfloat16 activations) onto Q4_1 panels of the same codes
        with float32 activations (gguf_blocks' exact float kernel), when the group size is a
        multiple of Q4_1's 32 and nothing else reads the weight. Only bfloat16 scales: Q4_1's
        float16 pairs lose less than the bfloat16 activations (int4_as_q4_1); with
        `activations: float32` ATen's kernel computes exactly and stays."""
        x, weight, groupsize, scales_zeros = node.args
        found, found_g, found_sz = (edit.weight(a) for a in (weight, groupsize, scales_zeros))
        if found is None or found_g is None or found_sz is None:
            return
        if found_sz[1].dtype != torch.bfloat16:
            return
        g = int(found_g[1].item())
        readers = {*weight.users, *scales_zeros.users}
        if g % 32 or any(u.target != INT4_MM or u.args[1:] != node.args[1:] for u in readers):
            return
        target, t = found
        if id(t) not in self._int4:
            self._int4[id(t)] = (t, gb.pack(int4_as_q4_1(t, found_sz[1], g)))
        codes, groups, _ = self._int4[id(t)][1]
        self.packed_names.add(target)
        self.int4_names.add(target)
        codes = edit.add(f"{target}_q4_1_codes", codes)
        groups = edit.add(f"{target}_q4_1_groups", groups)
        n, k = codes.meta["val"].shape[0] * pk.PANEL, x.meta["val"].shape[-1]
        q = gb.QTYPES["Q4_1"]
        tile = self.choose_tile(
            f"gguf-{q.name}", n, k, _rows(view_dims(x.meta["val"].shape[:-1]), rows)
        )
        with edit.graph.inserting_before(node):
            add = partial(emit, edit.graph, node)
            out = add(gb.OPS[0], _float32_input(add, x), codes, groups, q.index, *tile)
            out = float32_result(add, node, out)
        node.replace_all_uses_with(out)
        edit.graph.erase_node(node)


def int4_as_q4_1(packed: Tensor, scales_zeros: Tensor, groupsize: int) -> gb.Decoded:
    """The quantize pass's int4 weight (ATen's CPU layout, w = (q - 8) * s + z per group) as
    Q4_1 blocks (w = q * d + m): d = s and m = z - 8 s, each group's pair repeated over its
    32-input blocks. float16 holds bfloat16's s exactly (down to 6e-5); m is rounded to float16
    once, an error of at most 1/2048 of |m|."""
    q = unpack_int4_cpu(packed, groupsize)
    s, z = scales_zeros.float().permute(1, 0, 2).unbind(-1)  # [N, K / g] each
    groups = torch.stack([s, z - 8 * s], -1).repeat_interleave(groupsize // 32, dim=1)
    return gb.Decoded(gb.QTYPES["Q4_1"], q.to(torch.uint8).numpy(), groups.half().numpy())


def _float32_input(add: Callable[..., Node], x: Node) -> Node:
    """The float32 activation behind `x`, the int4 kernel's bfloat16 input (cast, then
    zero-padded to the weight's in_features)."""
    if is_cast_from_float32(x):
        return x.args[0]
    if x.target == aten.constant_pad_nd.default and is_cast_from_float32(x.args[0]):
        return add(aten.constant_pad_nd.default, x.args[0].args[0], *x.args[1:])
    return add(aten._to_copy.default, x, dtype=torch.float32)


def _rows(lead: list[int], rows: int) -> int:
    """The rows a linear multiplies: its static count (the prefill graph's head runs on the
    last row alone), else the graph's most."""
    return min(rows, math.prod(lead)) if all(d > 0 for d in lead) else rows


def _gather_rows(add: Callable[..., Node], node: Node, q: gb.QType, blocks: list[Node]) -> Node:
    """An embedding's rows dequantized from its tied head's blocks (`gb.gguf_rows`): exact."""
    ids = node.args[1]
    lead = view_dims(ids.meta["val"].shape)
    flat = add(aten.reshape.default, ids, [-1])
    if ids.meta["val"].dtype != torch.int64:
        flat = add(aten._to_copy.default, flat, dtype=torch.int64)
    codes, groups, *supers = blocks
    supers_or_none = supers[0] if supers else None
    rows = add(torch.ops.aotgen.gguf_rows.default, flat, codes, groups, supers_or_none, q.index)
    k = codes.meta["val"].shape[1] * q.unit
    return float32_result(add, node, add(aten.reshape.default, rows, [*lead, k]))


def _gather(add: Callable[..., Node], packed: Node, ids: Node) -> Node:
    """`pk.gather_rows` in the graph."""
    hi = add(aten.div.Tensor_mode, ids, pk.PANEL, rounding_mode="floor")
    lo = add(aten.remainder.Scalar, ids, pk.PANEL)
    if packed.meta["val"].dtype == torch.bfloat16:  # pk.slot
        half = add(aten.div.Tensor_mode, lo, 8, rounding_mode="floor")
        lo = add(aten.add.Tensor, add(aten.mul.Tensor, add(aten.remainder.Scalar, lo, 8), 2), half)
    return add(aten.index.Tensor, packed, [hi, None, lo])
