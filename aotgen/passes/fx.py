"""FX helpers the graph passes share: adding a node the way a traced one looks, and
swapping an ExportedProgram's lifted weights."""

from __future__ import annotations

import contextlib
import re
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Graph, Node
from torch.fx.node import map_arg


def emit(graph: Graph, replaced: Node, target: Any, *args: Any, **kwargs: Any) -> Node:
    """Add `target(*args, **kwargs)` at the graph's insert point with the metadata later
    passes and Inductor read: its fake value, and the module path of the node it replaces.
    The Python dispatcher runs composite ops (linear -> matmul) through their symbolic-shape
    aware decompositions, as export does; torch 2.11's C++ matmul asks a dynamic
    token dimension for a concrete numel() and fails without it."""
    new = graph.call_function(target, args, kwargs)
    vals, kwvals = map_arg((args, kwargs), lambda a: a.meta["val"])
    fake_mode = detect_fake_mode((vals, kwvals)) or contextlib.nullcontext()
    with fake_mode, enable_python_dispatcher():
        new.meta["val"] = target(*vals, **kwvals)
    for key in ("nn_module_stack", "stack_trace"):
        if key in replaced.meta:
            new.meta[key] = replaced.meta[key]
    return new


def view_dims(shape: Any) -> list[int]:
    """`shape` for a view: a symbolic dim (prefill's token count) as -1."""
    return [d if isinstance(d, int) else -1 for d in shape]


def is_cast_from_float32(node: Node) -> bool:
    """`node` is a plain dtype cast of a float32 value (e.g. the bf16 cast in front of an
    int8 kernel)."""
    return (
        node.target == torch.ops.aten._to_copy.default
        and set(node.kwargs) == {"dtype"}
        and node.args[0].meta["val"].dtype == torch.float32
    )


def float32_result(add: Any, replaced: Node, out: Node) -> Node:
    """`out` (float32) standing in for `replaced`, which returned another dtype (the int8
    kernel's bf16): users that only cast back to float32 take `out` directly, else it is cast
    to `replaced`'s dtype. A bf16 round trip would be dropped by Inductor (it does not emulate
    intermediate precision casts) but not by eager execution of the same graph.
    `add(target, *args, **kwargs)` emits a node."""
    want = replaced.meta["val"].dtype
    if out.meta["val"].dtype == want:
        return out
    cast = torch.ops.aten._to_copy.default
    users = list(replaced.users)
    if all(u.target == cast and u.kwargs == {"dtype": torch.float32} for u in users):
        for user in users:
            user.replace_all_uses_with(out)
            user.graph.erase_node(user)
        return out
    return add(cast, out, dtype=want)


class WeightEditor:
    """Swap an ExportedProgram's lifted weights: look them up, add new ones, and drop the
    ones no op reads any more (so the package does not store them).

        edit = WeightEditor(ep)
        node = edit.add("layers.0.qkv.weight", tensor)   # a persistent buffer placeholder
        ...rewrite ops...
        ep = edit.finish()
    """

    def __init__(self, ep: ExportedProgram):
        self.ep = ep
        self.graph = ep.graph_module.graph
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        specs = ep.graph_signature.input_specs
        self.spec_of = {s.arg.name: s for s in specs if isinstance(s.arg, TensorArgument)}
        self.tensors = {**ep.state_dict, **ep.constants}
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in self.placeholders])
        self.first_user = next(
            n for n in self.placeholders if self.spec_of[n.name].kind == InputKind.USER_INPUT
        )
        self.state_dict, self.constants = dict(ep.state_dict), dict(ep.constants)
        self.new_specs: list[InputSpec] = []
        self.added: dict[str, Node] = {}

    def weight(self, node: Any) -> tuple[str, Tensor] | None:
        """(name, tensor) when `node` is a lifted parameter / buffer / constant, else None."""
        spec = self.spec_of.get(getattr(node, "name", None))
        if spec is None or spec.kind not in (
            InputKind.PARAMETER,
            InputKind.BUFFER,
            InputKind.CONSTANT_TENSOR,
        ):
            return None
        return spec.target, self.tensors[spec.target]

    def add(self, target: str, t: Tensor) -> Node:
        """The placeholder of a new weight `target` (one per graph, however often asked)."""
        if target not in self.added:
            with self.graph.inserting_before(self.first_user):
                node = self.graph.placeholder("b_" + target.replace(".", "_"))
            node.meta["val"] = self.fake_mode.from_tensor(t, static_shapes=True)
            # A persistent buffer, not a CONSTANT_TENSOR: `ep.module()` then registers it
            # under its name, and AOTInductor asks for it by that name (a plain tensor
            # constant would come back anonymous, as `_tensor_constantN`).
            self.new_specs.append(
                InputSpec(InputKind.BUFFER, TensorArgument(node.name), target, persistent=True)
            )
            self.state_dict[target] = t
            self.added[target] = node
        return self.added[target]

    def _output_specs(self) -> list[OutputSpec]:
        """The output specs naming the nodes the output returns now: a rewritten op whose
        result is a graph output (a model returning a linear's output) has a new node."""
        returned = self.graph.output_node().args[0]
        specs = list(self.ep.graph_signature.output_specs)
        if not isinstance(returned, tuple | list) or len(returned) != len(specs):
            return specs
        return [
            replace(spec, arg=TensorArgument(name=node.name))
            if isinstance(spec.arg, TensorArgument) and isinstance(node, Node)
            else spec
            for spec, node in zip(specs, returned, strict=True)
        ]

    def finish(self) -> ExportedProgram:
        """The edited program, without the weights that lost their last reader."""
        graph, gm = self.graph, self.ep.graph_module
        dropped = {n.name for n in self.placeholders if not n.users and self.weight(n)}
        for n in self.placeholders:
            if n.name in dropped:
                graph.erase_node(n)
                target = self.spec_of[n.name].target
                self.state_dict.pop(target, None)
                self.constants.pop(target, None)
        specs = [
            s
            for s in self.ep.graph_signature.input_specs
            if getattr(s.arg, "name", None) not in dropped
        ]
        first = next(i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT)
        signature = ExportGraphSignature(
            input_specs=specs[:first] + self.new_specs + specs[first:],
            output_specs=self._output_specs(),
        )
        graph.lint()
        gm.recompile()
        return ExportedProgram(
            root=gm,
            graph=graph,
            graph_signature=signature,
            state_dict=self.state_dict,
            range_constraints=self.ep.range_constraints,
            module_call_graph=self.ep.module_call_graph,
            example_inputs=self.ep.example_inputs,
            constants=self.constants,
            verifiers=self.ep.verifiers,
        )


def op_name(node: Node, weight_target: str) -> str:
    """The module path of the op (`lm_head`, `model.layers.0.mlp.up_proj`) when export
    recorded it, else the weight's name without `.weight`."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        if path:
            return path
    return weight_target.removesuffix(".weight")


def compact_names(names: set[str]) -> str:
    """`model.layers.{0-2,5}.mlp.up_proj, lm_head`: one entry per op across layers."""
    layers: dict[str, list[int]] = {}
    for name in names:
        m = re.search(r"\.layers\.(\d+)\.", name)
        key = name[: m.start(1)] + "{}" + name[m.end(1) :] if m else name
        layers.setdefault(key, []).extend([int(m.group(1))] if m else [])
    out = []
    for key, idx in sorted(layers.items()):
        spans: list[list[int]] = []
        for i in sorted(idx):
            if spans and i == spans[-1][1] + 1:
                spans[-1][1] = i
            else:
                spans.append([i, i])
        text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
        out.append(key.replace("{}", "{" + text + "}") if idx else key)
    return ", ".join(out)
