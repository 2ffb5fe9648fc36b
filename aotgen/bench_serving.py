"""`aotgen bench --concurrency 1,4,8,16`: many requests at once through the batch engine,
beside llama.cpp's `llama-batched-bench` on a GGUF of the same weights.

Each level submits that many requests together (distinct prompts of `prompt_len` tokens,
greedy, `gen_tokens` new tokens each) and steps the engine until all are done. Aggregate
decode tok/s counts the tokens generated once every request has its first token, over the
time from then to the end: the steady state that llama-batched-bench's S_TG measures (it
prefills every sequence first, then decodes them together).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from aotgen.bench import BenchError, prompt_ids
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import GenerationConfig, GenerationResult


@dataclass
class ConcurrencyRow:
    name: str
    concurrency: int
    aggregate_tok_s: float  # decode tokens of all requests per second, all requests decoding
    ttft_p50_ms: float = float("nan")  # submission to first token, queueing included
    ttft_p99_ms: float = float("nan")
    request_tok_s: float = float("nan")  # median over requests of its own decode tok/s


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _one_level(
    engine: BatchEngine, level: int, prompt_len: int, gen_tokens: int, seed: int
) -> tuple[float, list[GenerationResult]]:
    """Serve `level` requests at once; (aggregate decode tok/s, their results)."""
    vocab = engine.target.vocab_size
    config = GenerationConfig(max_new_tokens=gen_tokens, ignore_eos=True, reuse_prefix=False)
    results: list[GenerationResult] = []
    ids = prompt_ids(vocab, prompt_len * level + seed)[seed:]
    for i in range(level):  # distinct prompts: no request's cache rows match another's
        engine.submit(ids[i * prompt_len : (i + 1) * prompt_len], config, on_done=results.append)
    seqs = list(engine.scheduler.waiting)
    start = start_tokens = None
    while engine.step():
        if start is None and all(s.first_token is not None for s in seqs):
            start, start_tokens = time.perf_counter(), sum(len(s.sink.ids) for s in seqs)
    end = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in results) - start_tokens
    return tokens / (end - start), results


def bench_concurrency(
    package: Path, levels: list[int], prompt_len: int, gen_tokens: int, runs: int
) -> list[ConcurrencyRow]:
    """The package's batch engine at each concurrency level, median of `runs`."""
    engine = BatchEngine.load(package, max_queue=max(levels))
    if max(levels) > engine.slots:
        raise BenchError(
            f"--concurrency {max(levels)} exceeds the package's {engine.slots} slots: rebuild "
            "with a larger max_batch, or lower the level"
        )
    _one_level(engine, min(levels), prompt_len, min(gen_tokens, 8), 0)  # warm-up
    rows = []
    for level in levels:
        aggregates, ttfts, per_request = [], [], []
        for run in range(runs):
            agg, results = _one_level(engine, level, prompt_len, gen_tokens, run)
            aggregates.append(agg)
            ttfts += [r.prefill_s * 1e3 for r in results]
            per_request += [r.decode_tok_s for r in results]
        rows.append(
            ConcurrencyRow(
                package.name,
                level,
                statistics.median(aggregates),
                _percentile(ttfts, 0.5),
                _percentile(ttfts, 0.99),
                statistics.median(per_request),
            )
        )
    return rows


def llama_binary(name: str) -> Path:
    """One of llama.cpp's tools from $LLAMA_CPP_BIN (its build/bin), else from PATH."""
    folder = os.environ.get("LLAMA_CPP_BIN")
    found = Path(folder) / name if folder else shutil.which(name)
    if not found or not Path(found).is_file():
        raise BenchError(
            f"this benchmark needs llama.cpp's {name} binary: set LLAMA_CPP_BIN to the "
            "directory holding it, or put it on PATH"
        )
    return Path(found)


def llama_batched_bench(
    gguf: Path, levels: list[int], prompt_len: int, gen_tokens: int, threads: int
) -> list[ConcurrencyRow]:
    """llama.cpp's `llama-batched-bench` at the same levels: its S_TG column per level."""
    n_ctx = max(levels) * (prompt_len + gen_tokens) + 64
    cmd = [llama_binary("llama-batched-bench"), "-m", gguf, "-t", threads, "-tb", threads]
    cmd += ["-c", n_ctx, "-npp", prompt_len, "-ntg", gen_tokens]
    cmd += ["-npl", ",".join(map(str, levels))]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    rows = []
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and all(re.fullmatch(r"[\d.]+", c) for c in cells[:8]):
            rows.append(ConcurrencyRow(f"llama.cpp {gguf.name}", int(cells[2]), float(cells[7])))
    if proc.returncode != 0 or not rows:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        raise BenchError(f"llama-batched-bench failed (exit {proc.returncode}): {tail[0]}")
    return rows
