"""Benchmarks of built packages: prefill / decode tok/s and the memory roofline.

Decode of a small model on CPU is bound by reading the weights once per token, so the
honest yardstick is `weight bytes per token × tok/s ÷ measured read bandwidth`.
Runtime-side only: imports no model code.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.sampling import SamplingParams


def measure_bandwidth(mbytes: int = 512, runs: int = 5) -> float:
    """Read bandwidth in GB/s: best of `runs` sums over a buffer far larger than cache."""
    buf = torch.ones(mbytes * (1 << 20) // 4)
    buf.sum()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def weight_bytes(engine: Engine) -> int:
    """Bytes of target weights read per decoded token (every weight, once)."""
    seen, total = set(), 0
    for t in engine.target.weights.values():
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


@dataclass
class BenchResult:
    package: str
    prefill_tok_s: float
    decode_tok_s: float
    decode_ms: float
    weight_bytes: int
    load_s: float
    spec: str = ""

    def roofline(self, bandwidth_gbs: float) -> float:
        """Fraction of the memory roofline the decode reaches."""
        return self.weight_bytes * self.decode_tok_s / (bandwidth_gbs * 1e9)


def bench_package(
    path: str | Path,
    prompt_len: int = 128,
    gen_tokens: int = 64,
    runs: int = 5,
    warmup: int = 1,
    threads: int | None = None,
) -> BenchResult:
    """Median of `runs` timed generations (greedy, eos ignored) after `warmup` ones."""
    engine = Engine.load(path, threads=threads)
    vocab = engine.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (prompt_len,), generator=gen).tolist()
    cfg = GenerationConfig(max_new_tokens=gen_tokens, ignore_eos=True, sampling=SamplingParams())
    prefill, decode = [], []
    for i in range(warmup + runs):
        r = engine.generate(prompt, cfg)
        if i >= warmup:
            prefill.append(r.prefill_tok_s)
            decode.append(r.decode_tok_s)
    dec = statistics.median(decode)
    return BenchResult(
        package=str(path),
        prefill_tok_s=statistics.median(prefill),
        decode_tok_s=dec,
        decode_ms=1e3 / dec if dec else float("nan"),
        weight_bytes=weight_bytes(engine),
        load_s=engine.load_s,
    )
