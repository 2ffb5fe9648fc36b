"""The one FX helper the graph passes share: adding a node the way a traced one looks."""

from __future__ import annotations

import contextlib
from typing import Any

from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.node import map_arg


def emit(graph: Graph, replaced: Node, target: Any, *args: Any, **kwargs: Any) -> Node:
    """Add `target(*args, **kwargs)` at the graph's insert point with the metadata later
    passes and Inductor read: its fake value, and the module path of the node it replaces."""
    new = graph.call_function(target, args, kwargs)
    vals, kwvals = map_arg((args, kwargs), lambda a: a.meta["val"])
    with detect_fake_mode((vals, kwvals)) or contextlib.nullcontext():
        new.meta["val"] = target(*vals, **kwvals)
    for key in ("nn_module_stack", "stack_trace"):
        if key in replaced.meta:
            new.meta[key] = replaced.meta[key]
    return new
