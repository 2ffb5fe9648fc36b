"""`aotgen bench`'s measurements: what they count, and the llama.cpp baseline's errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from aotgen.bench import BenchError, LlamaCppRunner, PackageRunner, bench_interleaved
from aotgen.package.weights import is_padding

# The tiny Llama's tables a decode step reads one row of: its untied embedding, RoPE's.
BY_ROW = {"model.embed_tokens.weight", "rope_cos", "rope_sin"}


def test_bench_package_counts_every_weight_once(tiny_package: Path):
    """The bytes a decoded token reads: every stored weight once, of a gathered table a row."""
    runner = PackageRunner(tiny_package, prompt_len=8, gen_tokens=4, threads=1)
    r, again = bench_interleaved([runner, runner], runs=2, warmup=0)
    assert r.package == again.package == tiny_package.name
    assert r.prefill_tok_s > 0 and r.decode_tok_s > 0
    assert r.decode_ms == pytest.approx(1e3 / r.decode_tok_s)
    manifest = json.loads((tiny_package / "manifest.json").read_text())
    assert set(manifest["models"]["target"]["weights"]["read_by_row"]) == BY_ROW
    read = 0
    with safe_open(next(tiny_package.glob("rank0/*.safetensors")), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if not is_padding(name):
                t = f.get_tensor(name)
                read += t.numel() * t.element_size() // (t.shape[0] if name in BY_ROW else 1)
    assert r.weight_bytes == read


def test_llama_cpp_baseline_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the extra were not installed
    with pytest.raises(BenchError, match="pip install llama-cpp-python"):
        LlamaCppRunner(tmp_path / "model.gguf", 8, 4, threads=1)
    monkeypatch.undo()
    pytest.importorskip("llama_cpp")
    with pytest.raises(BenchError, match="no such GGUF file"):
        LlamaCppRunner(tmp_path / "model.gguf", 8, 4, threads=1)
