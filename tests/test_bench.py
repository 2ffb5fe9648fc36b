"""`aotgen bench`'s measurements: what they count, and the llama.cpp baseline's errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from aotgen.bench import (
    BenchError,
    LlamaCppRunner,
    PackageRunner,
    bench_interleaved,
    gguf_kv_bytes,
    kv_read_bytes,
)
from aotgen.checkpoint.gguf import find_gemma3_gguf, find_smollm2_gguf
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


def test_kv_read_bytes_counts_each_layers_window():
    """After 8 prompt tokens, the 3 decode steps of 4 new tokens attend 9, 10 and 11 keys: a
    full layer reads them all (10 on average), a layer with a window of 4 its last 4."""
    assert kv_read_bytes([10, 20, 30], [None, 4, 3], prompt_len=8, gen_tokens=4) == 270
    assert kv_read_bytes([10], [None], prompt_len=8, gen_tokens=1) == 0  # no decode step


def test_bench_counts_the_kv_cache_a_decode_step_reads(tiny_package: Path):
    """The package row's KV bytes: the runtime's own caches, bytes per position, times the
    mean keys attended; the roofline counts them beside the weights."""
    runner = PackageRunner(tiny_package, prompt_len=100, gen_tokens=10, threads=1)
    caches = runner.engine.target.caches
    per_position = sum(c.nbytes for c in caches) // runner.engine.target.cache_len
    assert runner.kv_bytes == per_position * 105  # 9 decode steps attend 101..109 keys
    (r,) = bench_interleaved([runner], runs=1, warmup=0)
    assert r.kv_bytes == runner.kv_bytes
    assert r.roofline(10.0) == pytest.approx((r.weight_bytes + r.kv_bytes) * r.decode_tok_s / 1e10)


def test_llama_cpp_row_counts_an_f16_cache():
    """SmolLM2 (30 layers, 3 KV heads of 64) and Gemma 3 270M (18 layers, 1 KV head of 256,
    15 of them in a 512-position window) as llama.cpp caches them: f16 keys and values."""
    try:
        smollm2, gemma = find_smollm2_gguf(), find_gemma3_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    mean_keys = 4096 + 32  # steps after a 4,096-token prompt attend 4,097..4,159 keys
    assert gguf_kv_bytes(smollm2, 4096, 64) == 30 * 2 * 3 * 64 * 2 * mean_keys
    per_layer = 2 * 1 * 256 * 2
    assert gguf_kv_bytes(gemma, 4096, 64) == 3 * per_layer * mean_keys + 15 * per_layer * 512
