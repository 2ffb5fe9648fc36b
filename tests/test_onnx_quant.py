"""Quantized weights in the ONNX graphs (export/onnx_quant.py): a tiny package with int4,
int8 and a tied int8 embedding / lm_head, each ONNX graph against the AOTInductor graph of
the same package, greedy generation, the MatMulNBits tensors, and the data file's size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE
from reference import reset_caches

from aotgen.package.build import build
from aotgen.passes.quantize_numerics import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)
from aotgen.passes.quantize_options import parse_quantize
from aotgen.recipe import parse_recipe
from aotgen.runtime.engine import Engine, GenerationConfig

onnx = pytest.importorskip("onnx", reason="needs the aotgen[onnx] extra (onnx)")
pytest.importorskip("onnxscript", reason="needs the aotgen[onnx] extra (onnxscript)")
pytest.importorskip("onnxruntime", reason="needs the aotgen[onnx] extra (onnxruntime)")

from aotgen.export.aoti import GraphSpec  # noqa: E402
from aotgen.export.onnx import export_model  # noqa: E402
from aotgen.runtime.onnx_backend import OnnxGraph  # noqa: E402

# float32 activations: both backends compute in fp32 from the same dequantized weights (the
# same integers and scales), so only the summation order differs, as for fp32 packages
# (measured 3e-7); a wrong nibble order, block, scale or zero moves logits by 1e-2 or more.
QUANT = {
    "linear": {"int4": {"groupsize": 32}},
    "overrides": {"*.mlp.down_proj": "int8", "lm_head": "int8"},
    "embedding": "int8",
    "activations": "float32",
}
REL_TOL = 1e-5
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def quant_package(tied_checkpoint, project) -> Path:
    data = {"checkpoint": str(tied_checkpoint), **TINY_RECIPE, "quantize": QUANT}
    recipe = parse_recipe({**data, "formats": ["aoti", "onnx"]}, "tiny-onnx-quant", Path("."))
    return build(recipe, project).path


@pytest.fixture(scope="module")
def engines(quant_package) -> dict[str, Engine]:
    return {b: Engine.load(quant_package, backend=b) for b in ("aoti", "onnxruntime")}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_graph_logits_equal_aoti(engines):
    """Prefill, verify and decode through ONNX Runtime give the AOTInductor graphs' logits."""
    vocab = engines["aoti"].target.vocab_size
    history = torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    got = {}
    for backend, engine in engines.items():
        runner = engine.target
        reset_caches(runner)
        rows = []
        for graph, start, end in [("prefill", 0, 14), ("verify", 14, 19), ("decode", 19, 20)]:
            tokens = torch.tensor([history[start:end]])
            rows.append(runner.graphs[graph](tokens, torch.arange(start, end), runner.caches)[0])
        got[backend] = torch.cat(rows)
    assert _rel_err(got["onnxruntime"], got["aoti"]) < REL_TOL


@pytest.mark.parametrize("mode", [None, "ngram"])
def test_generation_equals_aoti(engines, mode):
    ids = engines["aoti"].tokenizer.encode("The quick brown fox jumps over the lazy dog. The")
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    want = engines["aoti"].generate(ids, cfg)
    cfg.speculative = mode
    assert engines["onnxruntime"].generate(ids, cfg).token_ids == want.token_ids


def test_weights_are_matmulnbits(quant_package):
    """Every quantized linear is one MatMulNBits on uint8 codes of its bit width; the tied
    embedding gathers from lm_head's codes (one tensor); no float copy of them is left."""
    manifest = json.loads((quant_package / "manifest.json").read_text())
    entry = manifest["models"]["target"]
    config = entry["config"]
    assert len(entry["onnx"]["weights"]["quantized"]) == 2 * 7 + 2  # layers, lm_head, embed
    graph = onnx.load(
        str(quant_package / entry["onnx"]["graphs"]["decode"]), load_external_data=False
    ).graph
    inits = {t.name: t for t in graph.initializer}
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * len(LAYER_LINEARS) + 1
    bits = sorted(onnx.helper.get_node_attr_value(n, "bits") for n in nbits)
    assert bits == [4] * 2 * 6 + [8] * 3  # down_proj x 2 and lm_head in int8
    for node in nbits:
        b = inits[node.input[1]]
        attr = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        blocks = -(-attr["K"] // attr["block_size"])
        assert b.data_type == onnx.TensorProto.UINT8
        assert list(b.dims) == [attr["N"], blocks, attr["block_size"] * attr["bits"] // 8]
    head = next(n for n in nbits if onnx.helper.get_node_attr_value(n, "N") == config["vocab_size"])
    readers = {n.op_type for n in graph.node if head.input[1] in n.input}
    assert readers == {"MatMulNBits", "Gather"}
    floats = [t for t in inits.values() if t.data_type == onnx.TensorProto.FLOAT]
    smallest_weight = config["hidden_size"] * config["intermediate_size"]
    assert all(_numel(t) < smallest_weight for t in floats)  # no float weight matrix


def _numel(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n


# ---- one graph exported without a package: the data file's size, ORT's int8 activations ----
def _payload(folder: Path) -> int:
    """Bytes of the graph's distinct tensors: in the data file (without its alignment
    padding), and the small ones inside the graph file."""
    model = onnx.load(str(folder / "onnx" / "target-decode.onnx"), load_external_data=False)
    spans, inline = set(), 0
    for t in model.graph.initializer:
        info = {d.key: d.value for d in t.external_data}
        if info:
            spans.add((int(info["offset"]), int(info["length"])))
        else:
            inline += onnx.numpy_helper.to_array(t).nbytes
    return inline + sum(length for _, length in spans)


def _export_decode(model, cache_len: int, cfg, out: Path, quantize: dict | None) -> OnnxGraph:
    from aotgen.model.llama import new_kv_cache

    caches = new_kv_cache(cfg, cache_len)
    export_model(
        out, "target", model, [GraphSpec("decode", 1, 1)], caches, parse_quantize(quantize)
    )
    sig = {"tokens": {"min": 1, "max": 1}, "outputs": [{"shape": [1, 1, cfg.vocab_size]}]}
    return OnnxGraph(out / "onnx" / "target-decode.onnx", sig, torch.get_num_threads())


def _dequantized(model, quantize: dict) -> dict[str, torch.Tensor]:
    """The weights the quantize pass's kernels compute with (its numerics, not the export's)."""
    scale = getattr(torch, quantize.get("activations", "bfloat16"))
    g = 32
    out = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(mod, torch.nn.Embedding) or (name == "lm_head"):
            out[f"{name}.weight"] = dequantize_int8(*quantize_int8(w, scale))
        elif isinstance(mod, torch.nn.Linear):
            kind = quantize["linear"]
            if kind == "int8":
                out[f"{name}.weight"] = dequantize_int8(*quantize_int8(w, scale))
            else:
                out[f"{name}.weight"] = dequantize_int4(*quantize_int4(w, g, scale), g)
    return out


@pytest.mark.parametrize("linear", ["int8", "int4"])
def test_data_file_size_and_int8_activations(tiny_model, tmp_path, linear):
    """The data file holds each quantized weight at its layout's size (bits/8 bytes a weight
    plus float32 scales per block, and int4's zeros), a quarter / a fifth of fp32's; ORT's
    int8 activations (the default bfloat16 `activations`) keep the decode logits within 2e-2
    of float32 math on the same dequantized weights (measured 9e-3 int8, 7e-3 int4: int8
    rounding of each linear's input, ~1/254 of its block's largest value)."""
    model, cfg, cache_len = tiny_model
    quantize = {
        "linear": linear if linear == "int8" else {"int4": {"groupsize": 32}},
        "overrides": {"lm_head": "int8"},
        "embedding": "int8",
    }
    fp32 = _export_decode(model, cache_len, cfg, tmp_path / "fp32", None)
    quant = _export_decode(model, cache_len, cfg, tmp_path / linear, quantize)
    del fp32
    float_bytes, layout_bytes = 0, 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear | torch.nn.Embedding):
            n, k = mod.weight.shape
            float_bytes += 4 * n * k
            if isinstance(mod, torch.nn.Embedding):
                layout_bytes += n * k + 4 * n * -(-k // 64) + 4 * n  # + its row scales
            elif linear == "int8" or name == "lm_head":
                layout_bytes += n * k + 4 * n * -(-k // 64)
            else:
                layout_bytes += n * k // 2 + 2 * 4 * n * -(-k // 32)
    base = _payload(tmp_path / "fp32")
    got = _payload(tmp_path / linear)
    # 2 %: the exporter merges equal small tensors (here the embedding's row scales and
    # lm_head's one-block scales); a float copy of any weight would add over 10 %.
    assert got == pytest.approx(base - float_bytes + layout_bytes, rel=0.02)
    weights = got - (base - float_bytes)  # without the float norms and RoPE tables
    assert weights / float_bytes < (0.3 if linear == "int8" else 0.25)

    # ORT (accuracy_level 4) against float32 eager math with the pass's dequantized weights
    from aotgen.model.llama import new_kv_cache

    ref_model = type(model)(model.config, cache_len)
    ref_model.load_state_dict({**model.state_dict(), **_dequantized(model, quantize)})
    history = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    caches = new_kv_cache(cfg, cache_len)
    with torch.no_grad():
        ref_model(history[None, :5], torch.arange(5), caches)
        onnx_caches = [c.clone() for c in caches]
        want = ref_model(history[None, 5:], torch.arange(5, 6), caches)[0]
    got_logits = quant(history[None, 5:], torch.arange(5, 6), onnx_caches)[0]
    assert _rel_err(got_logits, want) < 2e-2
