"""Fixed-width graphs of a CUDA package replayed as CUDA graphs.

A decode step of a small model is some hundred kernel launches whose GPU work is shorter
than issuing them. Captured once and replayed, a step is one launch: SmolLM2-135M fp32 on an
H100 went from 2.2–3.1 ms a step to 1.5–1.7 ms (docs/cuda.md).

A graph can be captured when nothing in it reads the device from the host: CUDA builds
export decode, verify and tree taking the cache positions they attend as an input
(`"attention": "key_pos"` in the graph's signature, model/layers.py), and the runtime loads
them single-threaded (the AOTInductor container's multi-threaded run synchronises on an
event, which a capture refuses). Each graph is captured on first use per KV cache it runs on
(a batch slot's rows are another cache) and per span of keys (`model_runner.key_span`: a few
lengths, each covering up to twice the attended positions), with inputs copied into buffers
the capture owns, and replayed after.
The logits it returns live in the capture's memory: the next replay overwrites them, so
callers copy them out (to the CPU, where sampling runs) before the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from aotgen.runtime.model_runner import CompiledGraph


@dataclass
class _Capture:
    graph: torch.cuda.CUDAGraph
    inputs: list[Tensor]  # tokens, input_pos (and tree_mask): copied into before each replay
    logits: Tensor  # written by each replay


class ReplayedGraph:
    """Calls of one compiled graph (`CompiledGraph`) replayed as CUDA graphs."""

    def __init__(self, graph: CompiledGraph, pool: tuple[int, int]) -> None:
        self.graph = graph
        self.name, self.min_tokens, self.max_tokens = graph.name, graph.min_tokens, graph.max_tokens
        self.pool = pool  # one memory pool for all of a runner's captures: they never overlap
        # By the address of the first cache tensor and the span of keys.
        self._captures: dict[tuple[int, int], _Capture] = {}

    def __call__(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        caches: list[Tensor],
        tree_mask: Tensor | None = None,
        slots: Tensor | None = None,
        attend: int | None = None,
    ) -> Tensor:
        if slots is not None:
            raise ValueError(f"{self.name}: a batched call is not replayed")
        inputs = [tokens, input_pos] + ([] if tree_mask is None else [tree_mask])
        span = self.graph.span(attend)
        index = (caches[0].data_ptr(), span)
        capture = self._captures.get(index)
        if capture is None:
            capture = self._captures[index] = self._capture(inputs, caches, span)
        for static, value in zip(capture.inputs, inputs, strict=True):
            if static.shape != value.shape:
                raise ValueError(f"{self.name} takes {list(static.shape)}, got {list(value.shape)}")
            static.copy_(value, non_blocking=True)
        capture.graph.replay()
        return capture.logits

    def _capture(self, inputs: list[Tensor], caches: list[Tensor], span: int) -> _Capture:
        """Warm up on a side stream (kernel loading, cuBLAS handles: not capturable), then
        capture one call. Both run the step for real on `inputs`, writing the same keys and
        values to the same cache slots as the call they stand in for."""
        static = [x.clone() for x in inputs]
        tree_mask = static[2] if len(static) > 2 else None

        def call() -> Tensor:
            return self.graph(static[0], static[1], caches, tree_mask, attend=span)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = call()
        return _Capture(graph, static, logits)
