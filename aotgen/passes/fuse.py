"""Linears that read the same activation, fused into one: q/k/v, and gate/up.

gpt-fast's `wqkv` / `w1 w3`, done on the exported graph, so no model definition changes.
The fused weight is the members' weights stacked along the output dim; the members become
slices of its output. Prefill then runs one larger GEMM; decode and verify (see gemv.py)
one reduction loop over all rows instead of one per weight, each ended by a thread barrier
(SmolLM2 int8 decode kernel: 9 -> 6 work-sharing loops per layer). Measured on 2 cores:
+3 % to +15 % decode tok/s in paired `aotgen bench` runs, no difference in a loop of the
graph alone, i.e. within the machine's noise.

Numerics are unchanged: each output row still comes from its own weight row, and the
quantize pass (run after this one) quantizes per row (int8) or per row and group (int4),
so it chooses the same integers as for the separate weights. Linears that a quantize
`skip` / `overrides` pattern names stay separate, so those patterns keep their meaning.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.fx import Node

from aotgen.passes.fx import WeightEditor, compact_names, emit, op_name

aten = torch.ops.aten


class FuseLinearsPass:
    """`ExportedProgram -> ExportedProgram`; one instance per model, reused for its graphs
    so that every graph gets the same fused tensor objects (stored once in the package)."""

    def __init__(self, exclude: tuple[str, ...] = ()):
        self.exclude = exclude  # globs on module path or weight name
        self._cache: dict[tuple[int, ...], Tensor] = {}
        self._keep: list[Tensor] = []  # sources stay alive so their ids stay unique
        self.fused: set[str] = set()  # fused op names, for the build report

    def note(self) -> str:
        """The build-report line: which linears now run as one."""
        if not self.fused:
            return "fuse_linears: no linears share an input"
        return f"fuse_linears: {len(self.fused)} fused: {compact_names(self.fused)}"

    def __call__(self, ep: ExportedProgram) -> ExportedProgram:
        edit = WeightEditor(ep)
        groups: dict[tuple, list[tuple[Node, str, Tensor, Tensor | None]]] = {}
        for node in edit.graph.nodes:
            if node.target is not aten.linear.default:
                continue
            lifted = edit.weight(node.args[1])
            has_bias = len(node.args) > 2 and node.args[2] is not None
            bias = edit.weight(node.args[2]) if has_bias else None
            if lifted is None or (has_bias and bias is None):
                continue
            target, w = lifted
            names = (op_name(node, target), target)
            if any(fnmatch.fnmatchcase(n, p) for p in self.exclude for n in names):
                continue
            # Biased linears (Qwen2's q/k/v) fuse with each other, their biases concatenated.
            b = bias[1] if bias else None
            key = (node.args[0], w.dtype, w.device, has_bias)
            groups.setdefault(key, []).append((node, target, w, b))
        for members in groups.values():
            if len(members) > 1:
                self._fuse(edit, members)
        return edit.finish()

    def _fuse(
        self, edit: WeightEditor, members: list[tuple[Node, str, Tensor, Tensor | None]]
    ) -> None:
        nodes, targets, weights, biases = zip(*members, strict=True)
        key = tuple(id(w) for w in weights)
        if key not in self._cache:
            self._keep.extend(weights)
            self._cache[key] = torch.cat(weights)
        has_bias = biases[0] is not None
        bias_key = tuple(id(b) for b in biases)
        if has_bias and bias_key not in self._cache:
            self._keep.extend(biases)
            self._cache[bias_key] = torch.cat(biases)
        # Names: the members' common module path (whole components) + their own parts.
        parts = [op_name(n, t).split(".") for n, t in zip(nodes, targets, strict=True)]
        common = 0
        while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
            common += 1
        prefix = "".join(c + "." for c in parts[0][:common])
        leaves = [".".join(p[common:]) for p in parts]
        name = f"{prefix}{{{','.join(leaves)}}}"  # model.layers.0.self_attn.{q_proj,k_proj,v_proj}
        fused_w = edit.add(f"{prefix}{'_'.join(leaves)}.weight", self._cache[key])
        graph, first = edit.graph, nodes[0]
        fused_b = (
            [edit.add(f"{prefix}{'_'.join(leaves)}.bias", self._cache[bias_key])]
            if has_bias
            else []
        )
        with graph.inserting_before(first):
            out = emit(graph, first, aten.linear.default, first.args[0], fused_w, *fused_b)
        stack = dict(first.meta.get("nn_module_stack") or {})
        if stack:  # the fused op's module path names all its members
            last = list(stack)[-1]
            stack[last] = (name, *stack[last][1:])
            out.meta["nn_module_stack"] = stack
        start = 0
        for node, w in zip(nodes, weights, strict=True):
            with graph.inserting_before(node):
                part = emit(graph, node, aten.slice.Tensor, out, -1, start, start + len(w))
            start += len(w)
            node.replace_all_uses_with(part)
            graph.erase_node(node)
        self.fused.add(name)
