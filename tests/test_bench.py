"""`aotgen bench`'s measurements: what they count, and the llama.cpp baseline's errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from aotgen.bench import BenchError, LlamaCppRunner, PackageRunner, bench_interleaved
from aotgen.package.weights import is_padding


def test_bench_package_counts_every_weight_once(tiny_package: Path):
    runner = PackageRunner(tiny_package, prompt_len=8, gen_tokens=4, threads=1)
    r, again = bench_interleaved([runner, runner], runs=2, warmup=0)
    assert r.package == again.package == tiny_package.name
    assert r.prefill_tok_s > 0 and r.decode_tok_s > 0
    assert r.decode_ms == pytest.approx(1e3 / r.decode_tok_s)
    stored = 0
    with safe_open(next(tiny_package.glob("rank0/*.safetensors")), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if not is_padding(name):
                t = f.get_tensor(name)
                stored += t.numel() * t.element_size()
    assert r.weight_bytes == stored


def test_llama_cpp_baseline_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the extra were not installed
    with pytest.raises(BenchError, match="pip install llama-cpp-python"):
        LlamaCppRunner(tmp_path / "model.gguf", 8, 4, threads=1)
    monkeypatch.undo()
    pytest.importorskip("llama_cpp")
    with pytest.raises(BenchError, match="no such GGUF file"):
        LlamaCppRunner(tmp_path / "model.gguf", 8, 4, threads=1)
