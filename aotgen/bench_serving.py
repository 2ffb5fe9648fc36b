"""`aotgen bench --concurrency 1,4,8,16`: many requests at once through the batch engine,
beside llama.cpp's `llama-batched-bench` on a GGUF of the same weights.

Each level submits that many requests together (distinct prompts of `prompt_len` tokens,
greedy, `gen_tokens` new tokens each) and steps the engine until all are done. Aggregate
decode tok/s counts the tokens generated once every request has its first token, over the
time from then to the end: the steady state that llama-batched-bench's S_TG measures (it
prefills every sequence first, then decodes them together). `--shared-prompt` sends one prompt
from every request of a level (a shared system prompt), found in the cache and, in turns, run
per request, beside llama-batched-bench's `-pps` (its prompt run once, its cache copied).
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
    all_first_ms: float = float("nan")  # submission to the last request's first token


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class LevelRun:
    aggregate_tok_s: float
    all_first_ms: float
    results: list[GenerationResult]


def _one_level(
    engine: BatchEngine, level: int, prompt_len: int, gen_tokens: int, seed: int, shared: bool
) -> LevelRun:
    """Serve `level` requests at once: distinct prompts, or with `shared` one prompt that the
    first request runs and the others copy from its cache row."""
    vocab = engine.target.vocab_size
    config = GenerationConfig(max_new_tokens=gen_tokens, ignore_eos=True, reuse_prefix=shared)
    results: list[GenerationResult] = []
    ids = prompt_ids(vocab, prompt_len * level + seed)[seed:]
    engine.target.cached.clear()  # nothing from an earlier run is found
    submitted = time.perf_counter()
    for i in range(level):  # distinct prompts match no other request's cache row
        prompt = ids[i * prompt_len : (i + 1) * prompt_len] if not shared else ids[:prompt_len]
        engine.submit(prompt, config, on_done=results.append)
    seqs = list(engine.scheduler.waiting)
    start = start_tokens = None
    while engine.step():
        if start is None and all(s.first_token is not None for s in seqs):
            start, start_tokens = time.perf_counter(), sum(len(s.sink.ids) for s in seqs)
    end = time.perf_counter()
    tokens = sum(len(r.token_ids) for r in results) - start_tokens
    return LevelRun(tokens / (end - start), (start - submitted) * 1e3, results)


def bench_concurrency(
    package: Path,
    levels: list[int],
    prompt_len: int,
    gen_tokens: int,
    runs: int,
    shared: bool = False,
) -> list[ConcurrencyRow]:
    """The package's batch engine at each concurrency level, median of `runs`. With `shared`,
    every request of a level sends one prompt, found in the cache (copied from the row of the
    request that ran it) and, in turns, run per request."""
    engine = BatchEngine.load(package, max_queue=max(levels))
    if max(levels) > engine.slots:
        raise BenchError(
            f"--concurrency {max(levels)} exceeds the package's {engine.slots} slots: rebuild "
            "with a larger max_batch, or lower the level"
        )
    engine.warm_cache()  # as `aotgen serve` does: every level measures a running server
    _one_level(engine, min(levels), prompt_len, min(gen_tokens, 8), 0, shared)  # warm-up
    name = package.name
    modes = {f"{name} shared": True, f"{name} per request": False} if shared else {name: False}
    rows = []
    for level in levels:
        measured: dict[str, list[LevelRun]] = {name: [] for name in modes}
        for run in range(runs):
            for name, reuse in modes.items():  # in turns: the machine's drift hits both
                measured[name].append(_one_level(engine, level, prompt_len, gen_tokens, run, reuse))
        rows += [_row(name, level, level_runs) for name, level_runs in measured.items()]
    return rows


def _row(name: str, level: int, runs: list[LevelRun]) -> ConcurrencyRow:
    ttfts = [r.prefill_s * 1e3 for run in runs for r in run.results]
    return ConcurrencyRow(
        name,
        level,
        statistics.median(run.aggregate_tok_s for run in runs),
        _percentile(ttfts, 0.5),
        _percentile(ttfts, 0.99),
        statistics.median(r.decode_tok_s for run in runs for r in run.results),
        statistics.median(run.all_first_ms for run in runs),
    )


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
    gguf: Path,
    levels: list[int],
    prompt_len: int,
    gen_tokens: int,
    threads: int,
    shared: bool = False,
) -> list[ConcurrencyRow]:
    """llama.cpp's `llama-batched-bench` at the same levels: its S_TG column per level, and
    its T_PP (every sequence's prompt run) as the time to all first tokens. With `shared`,
    its `-pps`: the prompt runs once and its cache is copied to every sequence."""
    n_ctx = max(levels) * (prompt_len + gen_tokens) + 64
    cmd = [llama_binary("llama-batched-bench"), "-m", gguf, "-t", threads, "-tb", threads]
    cmd += ["-c", n_ctx, "-npp", prompt_len, "-ntg", gen_tokens]
    cmd += ["-npl", ",".join(map(str, levels)), *(["-pps"] if shared else [])]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    rows = []
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and all(re.fullmatch(r"[\d.]+", c) for c in cells[:8]):
            name, level = f"llama.cpp {gguf.name}{' -pps' if shared else ''}", int(cells[2])
            row = ConcurrencyRow(name, level, float(cells[7]), all_first_ms=float(cells[4]) * 1e3)
            rows.append(row)
    if proc.returncode != 0 or not rows:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        raise BenchError(f"llama-batched-bench failed (exit {proc.returncode}): {tail[0]}")
    return rows
