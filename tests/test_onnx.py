"""ONNX export and the ONNX Runtime backend on a tiny package built with `formats: [aoti,
onnx]` and a draft on the target's KV cache: each ONNX graph against the AOTInductor graph
of the same package, the caches updated in place through IO binding, greedy and speculative
generation, the shared weights file, and the hash check over the ONNX files.
(tests/test_families.py runs every family through ONNX Runtime; tests/test_smollm2.py the
real model.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE
from reference import reset_caches

from aotgen.package.build import build
from aotgen.package.manifest import PackageError
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.engine import Engine, GenerationConfig

onnx = pytest.importorskip("onnx", reason="needs the aotgen[onnx] extra (onnx)")
pytest.importorskip("onnxscript", reason="needs the aotgen[onnx] extra (onnxscript)")
pytest.importorskip("onnxruntime", reason="needs the aotgen[onnx] extra (onnxruntime)")

# Both backends compute in fp32 from the same weights; only the kernels' summation order
# differs (MLAS / ORT vs Inductor's generated loops), which moves logits by ~1e-7..1e-6
# relative (measured up to 2e-6 on this package). A wrong position, mask, cache slot or RoPE
# row moves them by 1e-2 or more; 1e-5 separates the two.
REL_TOL = 1e-5
SPEC = {"speculative": {"draft": {"layers": 1}, "k": TINY_RECIPE["verify_k"]}}


@pytest.fixture(scope="module")
def onnx_package(tiny_checkpoint, project) -> Path:
    data = {"checkpoint": str(tiny_checkpoint), **TINY_RECIPE, **SPEC, "formats": ["aoti", "onnx"]}
    return build(parse_recipe(data, "tiny-onnx", Path(".")), project).path


@pytest.fixture(scope="module")
def engines(onnx_package) -> dict[str, Engine]:
    return {b: Engine.load(onnx_package, backend=b) for b in ("aoti", "onnxruntime")}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _history(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "role,graph,start,length",
    [
        ("target", "prefill", 0, 13),
        ("target", "prefill", 9, 16),
        ("target", "decode", 21, 1),
        ("target", "verify", 17, 5),
        ("draft", "decode", 30, 1),
    ],
)
def test_graph_logits_and_caches_equal_aoti(engines, role, graph, start, length):
    """Each ONNX graph, after the same prefix went through each backend's own prefill,
    gives the AOTInductor graph's logits, and leaves the runtime's own cache buffers (bound
    as input and output) holding the same keys and values."""
    out = {}
    for backend, engine in engines.items():
        target = engine.target
        runner = target if role == "target" else engine.draft
        history = _history(start + length, target.vocab_size, start)
        reset_caches(target, runner)
        if start:
            target.forward(history[:start], 0)
        tokens = torch.tensor([history[start:]])
        logits = runner.graphs[graph](tokens, torch.arange(start, start + length), runner.caches)
        out[backend] = (logits[0].clone(), [c.clone() for c in target.caches])
    (want, want_caches), (got, got_caches) = out["aoti"], out["onnxruntime"]
    rows = 1 if graph == "prefill" else length  # prefill: its last row only
    assert got.shape == want.shape == (rows, engines["aoti"].target.vocab_size)
    assert _rel_err(got, want) < REL_TOL
    written = want_caches[0][:, :, start : start + length]
    assert written.abs().sum() > 0  # the graph wrote its positions
    for g, w in zip(got_caches, want_caches, strict=True):
        assert _rel_err(g, w) < REL_TOL


@pytest.mark.parametrize("mode", [None, "ngram", "draft", "draft+ngram"])
def test_generation_equals_aoti(engines, mode):
    """Greedy generation through ONNX Runtime gives AOTInductor's tokens, plain and with
    every speculative mode (the draft's ONNX decode graph runs on the target's cache)."""
    engine = engines["aoti"]
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick")
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True, speculative=mode)
    want = engines["aoti"].generate(ids, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    got = engines["onnxruntime"].generate(ids, cfg)
    assert got.token_ids == want.token_ids
    if mode:
        assert got.spec.steps > 0 and got.spec.accepted > 0


def test_graphs_checked_and_weights_stored_once(onnx_package):
    """Every graph passes onnx.checker with its external data; the three graphs share one
    data file holding each tensor once (about the safetensors' size, not three times it)."""
    import json

    manifest = json.loads((onnx_package / "manifest.json").read_text())
    target = manifest["models"]["target"]
    entry = target["onnx"]
    assert set(entry["graphs"]) == {"prefill", "decode", "verify"}
    for rel in entry["graphs"].values():
        onnx.checker.check_model(str(onnx_package / rel), full_check=True)
        assert rel in manifest["files"]
        model = onnx.load(str(onnx_package / rel), load_external_data=False)
        locations = {
            d.value for t in model.graph.initializer for d in t.external_data if d.key == "location"
        }
        assert locations == {Path(entry["data"]).name}
    data_bytes = (onnx_package / entry["data"]).stat().st_size
    weights_bytes = (onnx_package / target["weights"]["file"]).stat().st_size
    assert 0.5 * weights_bytes < data_bytes < 1.5 * weights_bytes
    assert manifest["models"]["draft"]["onnx"]["graphs"].keys() == {"decode"}


@pytest.mark.parametrize("which", ["graph", "data"])
def test_tampered_onnx_file_is_refused(onnx_package, tmp_path, which):
    copy = tmp_path / "pkg"
    shutil.copytree(onnx_package, copy)
    import json

    entry = json.loads((copy / "manifest.json").read_text())["models"]["target"]["onnx"]
    path = copy / (entry["graphs"]["decode"] if which == "graph" else entry["data"])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(PackageError, match="does not match its sha256"):
        Engine.load(copy, backend="onnxruntime")


def test_export_skips_only_rewrites_that_change_nothing(tiny_model):
    """The export leaves out onnxscript's rewrite rules of several output nodes, whose matching
    is quadratic in the graph's size (export/onnx.py): the files are byte for byte those of
    the exporter's full default rule set."""
    from unittest import mock

    from onnxscript import rewriter

    from aotgen.export import onnx as onnx_export
    from aotgen.export.aoti import GraphSpec
    from aotgen.model.llama import new_kv_cache

    model, cfg, cache_len = tiny_model
    caches = new_kv_cache(cfg, cache_len)
    full = rewriter._DEFAULT_REWRITE_RULES
    assert any(not r._target_pattern.has_single_output_node for r in full)  # there is one
    for spec in (GraphSpec("prefill", 2, 16), GraphSpec("verify", 5, 5)):
        ours = onnx_export.export_onnx(model, spec, caches)
        with mock.patch.object(onnx_export, "_single_output_rewrites", mock.MagicMock()):
            theirs = onnx_export.export_onnx(model, spec, caches)
        assert rewriter._DEFAULT_REWRITE_RULES is full  # put back
        assert ours.SerializeToString() == theirs.SerializeToString()


def test_package_without_onnx_graphs_is_a_clear_error(tiny_package):
    with pytest.raises(PackageError, match=r"formats: \[aoti, onnx\]"):
        Engine.load(tiny_package, backend="onnxruntime")
    with pytest.raises(PackageError, match="expected one of aoti, onnxruntime"):
        Engine.load(tiny_package, backend="tensorrt")


@pytest.mark.parametrize(
    "extra,phrase",
    [
        ({"formats": ["onnx"]}, "includes aoti"),
        ({"formats": "onnx"}, "must be a list"),
        ({"formats": ["aoti", "tflite"]}, "must be a list"),
        ({"formats": ["aoti", "onnx"], "dtype": "bfloat16"}, "float32 CPU packages"),
        ({"formats": ["aoti", "onnx"], "parallel": {"tensor": 2}}, "without `parallel`"),
    ],
)
def test_bad_formats_are_recipe_errors(extra, phrase):
    with pytest.raises(RecipeError, match=phrase):
        parse_recipe({"checkpoint": "x", **extra}, "bad", Path("."))


ISOLATION = """
import sys, torch
def refuse(*a, **k):
    raise AssertionError("torch.export / torch.compile / an AOTInductor loader was used")
torch.export.export = torch.compile = refuse
torch._C._aoti.AOTIModelPackageLoader = refuse
import typer
from aotgen.cli import app
args = ["run", sys.argv[1], "--prompt", "The quick brown fox", "--max-new-tokens", "8"]
args += ["--backend", "onnxruntime", "--lookup", "ngram", "--json"]
typer.main.get_command(app).main(args, standalone_mode=False)
loaded = [m for m in sys.modules if m.startswith(("aotgen.model", "aotgen.export", "onnxscript"))]
assert not loaded, loaded
"""


def test_cli_runs_onnx_without_model_code_or_aoti(onnx_package, engines):
    """`aotgen run --backend onnxruntime` loads no model or export code and no AOTInductor
    graph, and prints the tokens the AOTInductor backend generates."""
    import json

    proc = subprocess.run(
        [sys.executable, "-c", ISOLATION, str(onnx_package)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout)
    engine = engines["aoti"]
    ids = engine.tokenizer.prompt_ids("The quick brown fox")
    want = engine.generate(ids, GenerationConfig(max_new_tokens=8))
    assert got["ids"] == want.token_ids


# ---- the real model ----------------------------------------------------------------------
# SmolLM2 fp32, AOTInductor vs ONNX Runtime: 30 layers of the same fp32 math in another
# summation order. Measured relative error 1.5e-6 (docs/onnx.md); a wrong position, mask or
# cache slot moves the logits by 1e-2 or more.
SMOLLM2_REL_TOL = 1e-4
FRANCE = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2_engines(smollm2_onnx_package) -> dict[str, Engine]:
    return {b: Engine.load(smollm2_onnx_package, backend=b) for b in ("aoti", "onnxruntime")}


@pytest.mark.slow
def test_smollm2_graph_logits_equal_aoti(smollm2_engines):
    """Prefill, verify and decode on the chat prompt: ONNX Runtime's logits are the
    AOTInductor graphs' within fp32 rounding."""
    history = smollm2_engines["aoti"].chat_ids(FRANCE) + [504, 3575, 282, 4649, 314, 7042]
    n = len(history)
    got = {}
    for backend, engine in smollm2_engines.items():
        runner = engine.target
        reset_caches(runner)
        rows = []
        for graph, start, end in [
            ("prefill", 0, n - 6),
            ("verify", n - 6, n - 1),
            ("decode", n - 1, n),
        ]:
            tokens = torch.tensor([history[start:end]])
            rows.append(runner.graphs[graph](tokens, torch.arange(start, end), runner.caches)[0])
        got[backend] = torch.cat(rows)
    assert _rel_err(got["onnxruntime"], got["aoti"]) < SMOLLM2_REL_TOL


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "ngram"])
def test_smollm2_greedy_equals_aoti(smollm2_engines, mode):
    ids = smollm2_engines["aoti"].chat_ids("Write a short story about a robot who learns to paint.")
    cfg = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    want = smollm2_engines["aoti"].generate(ids, cfg)
    cfg.speculative = mode
    assert smollm2_engines["onnxruntime"].generate(ids, cfg).token_ids == want.token_ids


@pytest.mark.slow
def test_smollm2_cli_answers_france(smollm2_onnx_package):
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "aotgen", "run", str(smollm2_onnx_package), "--chat", FRANCE]
        + ["--backend", "onnxruntime", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"] == "The capital of France is Paris."
