"""The ONNX Runtime backend: a package's ONNX graphs (export/onnx.py) run in place of its
AOTInductor graphs, under the same contract: `graph(tokens, input_pos, caches) -> logits`,
with the runtime-owned KV caches updated in place.

Each cache buffer is bound with IO binding as both the graph's cache input and the matching
cache output, so ORT's ScatterElements writes the new keys/values into the runtime's buffer
(it copies input to output only when the two differ): no cache copy per step, and a draft on
the target's cache sees the target's writes (docs/onnx.md has the measurements).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from aotgen.package.manifest import PackageError

BACKENDS = ("aoti", "onnxruntime")


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise PackageError(
            "--backend onnxruntime needs the optional onnxruntime package: "
            "pip install 'aotgen[onnx]'"
        ) from None
    return onnxruntime


class OnnxGraph:
    """One ONNX graph in an ORT session; checks the token count it was exported for."""

    def __init__(self, path: Path, signature: dict[str, Any], threads: int):
        ort = _ort()
        self.name = path.name
        self.min_tokens = signature["tokens"]["min"]
        self.max_tokens = signature["tokens"]["max"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.vocab = self.session.get_outputs()[0].shape[-1]
        rows = signature["outputs"][0]["shape"][1]
        self.logit_rows = rows if isinstance(rows, int) else None  # None: one per token
        self.binding = self.session.io_binding()
        self._bound: list[int] = []  # data pointers of the caches bound now

    def _bind_caches(self, caches: list[Tensor]) -> None:
        """Each cache as kv_i and kv_out_i: ORT writes the update into the buffer itself."""
        ptrs = [c.data_ptr() for c in caches]
        if ptrs == self._bound:
            return
        for i, cache in enumerate(caches):
            value = _ort().OrtValue.ortvalue_from_numpy(cache.numpy())
            self.binding.bind_ortvalue_input(f"kv_{i}", value)
            self.binding.bind_ortvalue_output(f"kv_out_{i}", value)
        self._bound = ptrs

    def __call__(
        self, tokens: Tensor, input_pos: Tensor, caches: list[Tensor], attend: int | None = None
    ) -> Tensor:
        """`attend` is the engine's hint for graphs that take `key_pos`; ONNX graphs attend up
        to their last position by themselves."""
        t = tokens.shape[1]
        if not self.min_tokens <= t <= self.max_tokens:
            raise ValueError(
                f"{self.name} takes {self.min_tokens}..{self.max_tokens} tokens, got {t}"
            )
        self._bind_caches(caches)
        logits = np.empty((1, self.logit_rows or t, self.vocab), dtype=np.float32)
        b = self.binding
        b.bind_cpu_input("tokens", tokens.numpy())
        b.bind_cpu_input("input_pos", input_pos.numpy())
        b.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(b)
        return torch.from_numpy(logits)


def onnx_graphs(root: Path, entry: dict[str, Any], role: str) -> dict[str, OnnxGraph]:
    """The ONNX graphs of one model of the package at `root`, one ORT session each."""
    onnx = entry.get("onnx")
    if not onnx:
        raise PackageError(
            f"{root} has no ONNX graphs for its {role} model; add `formats: [aoti, onnx]` to "
            "the recipe and rebuild, or run with --backend aoti"
        )
    threads = torch.get_num_threads()
    return {
        name: OnnxGraph(root / onnx["graphs"][name], sig, threads)
        for name, sig in entry["graphs"].items()
    }


def onnx_weight_bytes(root: Path, entry: dict[str, Any]) -> int:
    """Bytes of a model's ONNX weights (its shared data file)."""
    return (root / entry["onnx"]["data"]).stat().st_size
