"""Linears onto the packed-panel kernels (kernels/packed.py), as a graph pass.

Every CPU linear with a float32 weight (`aten.linear`) or an int8 per-channel weight (the
quantize pass's `_weight_int8pack_mm`) becomes `aotgen.packed_linear[_int8]` on the weight
repacked into 16-output panels, with the tile the build's autotune measured fastest for the
graph's row count (package/autotune.py). An embedding that shares its table with a packed head
(tied embeddings, float32 or int8) gathers its rows from the panels, so the weight is stored
once.

A weight is left as it is when anything else reads it: packing it would need a second copy.
Those linears keep the row-major paths (passes/gemv.py for few rows, BLAS / the extern kernels
for prefill).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.fx import Node

from aotgen.kernels import packed as pk
from aotgen.passes.fx import WeightEditor, emit, float32_result, is_cast_from_float32

aten = torch.ops.aten
INT8_MM = aten._weight_int8pack_mm.default

# (kind, n, k, rows) -> (tile rows, tile panels): the autotune's choice.
TileChooser = Callable[[str, int, int, int], tuple[int, int]]


class PackLinears:
    """One model's pass: call it on each graph with the graph's row count; packed weights are
    shared by every graph, so the package stores each once."""

    def __init__(self, choose_tile: TileChooser):
        self.choose_tile = choose_tile
        self._packed: dict[int, tuple[Tensor, Tensor, Tensor | None]] = {}  # id(source) -> ...
        self.packed_names: set[str] = set()

    def __call__(self, ep: ExportedProgram, rows: int) -> ExportedProgram:
        edit = WeightEditor(ep)
        linears = [
            n
            for n in edit.graph.nodes
            if n.op == "call_function" and n.target in (aten.linear.default, INT8_MM)
        ]
        for weight in dict.fromkeys(n.args[1] for n in linears):  # each weight once
            found = edit.weight(weight)
            if found is not None and self._packable(found[1], weight):
                self._rewrite_users(edit, weight, found, rows)
        return edit.finish()

    @staticmethod
    def _packable(t: Tensor, weight: Node) -> bool:
        """Every reader is a linear on `weight` (a float32 one, or the int8 kernel on an int8
        one) or an embedding; at most one leading dim of the activations is symbolic."""
        if t.device.type != "cpu" or t.dim() != 2 or t.dtype not in (torch.float32, torch.int8):
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
        # The leading dims back as they were: a symbolic one (prefill's tokens) as -1.
        lead = [d if isinstance(d, int) else -1 for d in x.meta["val"].shape[:-1]]
        flat = add(aten.reshape.default, x, [-1, k])
        if scale is not None and x.meta["val"].dtype != torch.float32:
            flat = add(aten._to_copy.default, flat, dtype=torch.float32)
        kind = "int8" if scale is not None else "float32"
        tile = self.choose_tile(kind, n, k, rows)
        if scale is None:
            out = add(torch.ops.aotgen.packed_linear.default, flat, w, *tile)
        else:
            out = add(torch.ops.aotgen.packed_linear_int8.default, flat, w, scale, *tile)
        if pk.padded_outputs(n) != n:
            out = add(aten.slice.Tensor, out, 1, 0, n)
        out = add(aten.reshape.default, out, [*lead, n])
        if bias is not None:
            out = add(aten.add.Tensor, out, bias)
        return float32_result(add, node, out)


def _gather(add: Callable[..., Node], packed: Node, ids: Node) -> Node:
    hi = add(aten.div.Tensor_mode, ids, pk.PANEL, rounding_mode="floor")
    lo = add(aten.remainder.Scalar, ids, pk.PANEL)
    return add(aten.index.Tensor, packed, [hi, None, lo])
