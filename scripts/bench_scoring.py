"""Prompt scoring (every prompt token's logprob, as lm-eval's loglikelihood requests ask)
against a plain prefill of the same prompt, on one package, in turns.

    python scripts/bench_scoring.py artifacts/smollm2-135m-serve --lengths 128,512 --runs 3

"score graph" scores through the package's `score` graph (`score_graph: true`); "verify
chunks" hides it, so every row's logits come from the verify graph, `verify_k + 1` rows a call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from aotgen.bench import prompt_ids
from aotgen.runtime.engine import Engine, GenerationConfig

PREFILL = GenerationConfig(max_new_tokens=1, reuse_prefix=False)
SCORE = GenerationConfig(max_new_tokens=0, prompt_logprobs=1)


def timed(engine: Engine, prompt: list[int], config: GenerationConfig) -> float:
    start = time.perf_counter()
    engine.generate(prompt, config)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--lengths", default="128,512", help="prompt lengths, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    engine = Engine.load(args.package, threads=args.threads)
    target = engine.target
    if not target.score_chunk:
        parser.error(f"{args.package} has no score graph: build it with `score_graph: true`")
    score_chunk = target.score_chunk
    print(f"{args.package.name}, {torch.get_num_threads()} threads, median of {args.runs} (ms)")
    for length in [int(n) for n in args.lengths.split(",")]:
        prompt = prompt_ids(target.vocab_size, length)
        times: dict[str, list[float]] = {"prefill": [], "score graph": [], "verify chunks": []}
        timed(engine, prompt, SCORE)  # warm-up
        for _ in range(args.runs):
            times["prefill"].append(timed(engine, prompt, PREFILL))
            times["score graph"].append(timed(engine, prompt, SCORE))
            target.score_chunk = 0  # every row from the verify graph
            times["verify chunks"].append(timed(engine, prompt, SCORE))
            target.score_chunk = score_chunk
        cells = ", ".join(
            f"{name} {statistics.median(t):.0f} ({min(t):.0f}-{max(t):.0f})"
            for name, t in times.items()
        )
        print(f"{length} tokens: {cells}")


if __name__ == "__main__":
    main()
