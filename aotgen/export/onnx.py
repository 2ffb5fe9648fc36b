"""ONNX export: a model's prefill / decode / verify graphs as ONNX models for ONNX Runtime.

Each graph takes the AOTInductor graphs' inputs, `(tokens [1, T], input_pos [T], kv_0 ..
kv_{2L-1})`, and returns `(logits, kv_out_0 .. kv_out_{2L-1})`: ONNX has no in-place update
of an input, so every cache also comes back as an output. The cache write is one
`ScatterElements` along the position axis per cache (a custom translation of
`aten.index_copy`; the default one transposes the whole cache twice per layer), so a runtime
that binds one buffer as both a cache input and its output gets the update in place
(runtime/onnx_backend.py, docs/onnx.md).

The graphs are exported from the model's modules, not from the passed graphs (the quantize
pass's kernels and the packed linears are AOTInductor-only); a quantized model's linears and
embeddings are swapped for their ONNX Runtime `MatMulNBits` forms first (export/onnx_quant.py),
so its weights stay int8 / int4. All graphs of a model share one external-data file in which
each distinct tensor is stored once.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import onnx
import torch
from onnxscript import opset18 as op
from onnxscript import rewriter
from torch import Tensor, nn

from aotgen.export.aoti import GraphSpec, dynamic_shapes, example_inputs
from aotgen.export.onnx_quant import TRANSLATIONS, onnx_fallback, quantized_modules
from aotgen.model.llama import Transformer
from aotgen.passes.quantize_options import QuantizeOptions

ONNX_DIR = "onnx"
# Tensors smaller than this stay inside each graph file (scalars, shapes); the rest go to the
# shared data file, aligned so a reader may map them in place.
EXTERNAL_MIN_BYTES = 1024
DATA_ALIGN = 4096


class _CachesOut(nn.Module):
    """The model with its cache writes made outputs: export sees a copy updated and returned."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self, tokens: Tensor, input_pos: Tensor, caches: list[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        caches = [c.clone() for c in caches]
        return self.model(tokens, input_pos, caches), caches


def _index_copy(self, dim: int, index, source):
    """`cache.index_copy(2, positions, new)` as one ScatterElements on the position axis of
    a `[1, kv_heads, cache_len, head_dim]` cache (the model's only index_copy)."""
    positions = op.Reshape(index, op.Constant(value_ints=[1, 1, -1, 1]))
    return op.ScatterElements(self, op.Expand(positions, op.Shape(source)), source, axis=dim)


def export_onnx(model: nn.Module, spec: GraphSpec, caches: list[Tensor]) -> onnx.ModelProto:
    """One graph of `model` as an ONNX model, weights inline (export_model moves them out)."""
    n = len(caches)
    # torch.onnx.export runs torch.export itself, so the model sees is_in_onnx_export()
    # (model/layers.py picks its decode attention by it).
    with (
        warnings.catch_warnings(),
        _quiet_exporter(),
        _single_output_rewrites(),
        model.last_row_logits(spec.last_row_logits),
    ):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            _CachesOut(model),
            example_inputs(spec, caches),
            dynamic_shapes=dynamic_shapes(spec, caches),
            dynamo=True,
            optimize=True,
            verbose=False,
            input_names=["tokens", "input_pos", *(f"kv_{i}" for i in range(n))],
            output_names=["logits", *(f"kv_out_{i}" for i in range(n))],
            custom_translation_table={
                torch.ops.aten.index_copy.default: _index_copy,
                **TRANSLATIONS,
            },
        )
    return program.model_proto


@contextmanager
def _single_output_rewrites() -> Iterator[None]:
    """The exporter's optimizer with only its rewrite rules that match one output node:
    onnxscript matches a pattern of several output nodes (`SlicesSplit`) by trying every
    combination of same-op nodes, quadratic in the graph's size, and that rule rewrites
    nothing in these graphs (docs/onnx.md, "Export time")."""
    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if rules is None:  # an onnxscript that keeps its rules elsewhere: its optimizer as it is
        yield
        return
    patterns = [getattr(r, "_target_pattern", None) for r in rules]
    single = tuple(
        r for r, p in zip(rules, patterns, strict=True) if p is None or p.has_single_output_node
    )
    with mock.patch.object(rewriter, "_DEFAULT_REWRITE_RULES", single):
        yield


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter logs a warning per torchvision op it cannot register: not ours to show."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _externalize(tensor: onnx.TensorProto, data, data_name: str, stored: dict) -> None:
    """Point `tensor` at its bytes in the data file, appending them if not stored yet."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        raise ValueError(f"initializer {tensor.name} is already external")
    raw = tensor.raw_data or onnx.numpy_helper.to_array(tensor).tobytes()
    if len(raw) < EXTERNAL_MIN_BYTES:
        return
    key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(raw).hexdigest())
    if key not in stored:
        data.write(b"\0" * (-data.tell() % DATA_ALIGN))
        stored[key] = (data.tell(), len(raw))
        data.write(raw)
    offset, length = stored[key]
    for field in ("float_data", "int32_data", "int64_data", "double_data"):
        tensor.ClearField(field)
    tensor.raw_data = raw  # set_external_data insists on it; cleared just after
    onnx.external_data_helper.set_external_data(tensor, data_name, offset, length)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.ClearField("raw_data")


def export_model(
    out: Path,
    role: str,
    model: Transformer,
    graphs: list[GraphSpec],
    caches: list[Tensor],
    quantize: QuantizeOptions | None = None,
) -> dict[str, Any]:
    """Every graph of one model as ONNX in `out/ONNX_DIR`, with the weights in one data file
    shared by the graphs, each distinct tensor once; every file checked with `onnx.checker`.
    `quantize`: the model's quantize options, whose int8 / int4 weights the graphs keep.
    One graph is in memory at a time. Returns the model's manifest entry."""
    folder = out / ONNX_DIR
    folder.mkdir(parents=True, exist_ok=True)
    data_name = f"{role}.onnx.data"
    stored: dict[tuple, tuple[int, int]] = {}  # (dtype, dims, sha256) -> (offset, length)
    files = {}
    with (
        open(folder / data_name, "wb") as data,
        torch.no_grad(),
        quantized_modules(model, quantize) as quantized,
    ):
        for spec in graphs:
            proto = export_onnx(model, spec, caches)
            for tensor in proto.graph.initializer:
                _externalize(tensor, data, data_name, stored)
            path = folder / f"{role}-{spec.name}.onnx"
            path.write_bytes(proto.SerializeToString())
            files[spec.name] = f"{ONNX_DIR}/{path.name}"
    for rel in files.values():
        onnx.checker.check_model(str(out / rel))
    return {
        "graphs": files,
        "data": f"{ONNX_DIR}/{data_name}",
        "inputs": ["tokens", "input_pos", "kv_0..kv_N"],
        "outputs": ["logits", "kv_out_0..kv_out_N (bind each to its kv_i buffer)"],
        "weights": _weights_entry(quantize, quantized),
    }


def _weights_entry(quantize: QuantizeOptions | None, quantized: dict[str, str]) -> Any:
    """What the manifest says of the ONNX weights: float32, or per op how it is stored."""
    if quantize is None:
        return "float32"
    if not quantized:
        why = onnx_fallback(quantize) or "no linear or embedding is quantized"
        return {"float32": f"quantized only in the AOTInductor graphs: {why}"}
    return {"quantized": dict(sorted(quantized.items())), "other": "float32"}
