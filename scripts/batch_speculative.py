"""Speculation inside a batch: 8 requests at once, plain vs n-gram vs draft vs both.

    python scripts/batch_speculative.py artifacts/smollm2-135m-serve-spec [--requests 8]

Chat prompts and copy/edit prompts from aotgen/data/bench_prompts.json, greedy, 96 new tokens
each; prints aggregate tok/s (prefill included), acceptance, and whether every output equals
plain decoding. Each pass runs the modes in turn; the first pass warms the graphs up.
"""

from __future__ import annotations

import argparse
import json
import time

from aotgen.bench import PROMPTS_FILE
from aotgen.cli.common import script_main
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import GenerationConfig

MODES = (None, "ngram", "draft", "draft+ngram")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    prompts = json.loads(PROMPTS_FILE.read_text())
    engine = BatchEngine.load(args.package)
    n = args.requests
    chat = [engine.engine.chat_ids(q) for q in prompts["chat"] * n][:n]
    grounded = [t.format(text=prompts["grounded_text"]) for t in prompts["grounded"]] * n
    tasks = {"chat": chat, "copy/edit": [engine.engine.chat_ids(t) for t in grounded[:n]]}
    modes = [m for m in MODES if m is None or "draft" not in m or engine.engine.draft]
    for task, ids in tasks.items():
        for p in range(args.passes):
            plain = None
            for mode in modes:
                config = GenerationConfig(
                    max_new_tokens=args.max_new_tokens, ignore_eos=True, speculative=mode
                )
                t0 = time.perf_counter()
                results = engine.generate_many(ids, config)
                wall = time.perf_counter() - t0
                outputs = [r.token_ids for r in results]
                plain = outputs if mode is None else plain
                drafted = sum(r.spec.drafted for r in results) if mode else 0
                accepted = sum(r.spec.accepted for r in results) if mode else 0
                print(
                    f"{task:9s} pass {p} {mode or 'plain':12s} "
                    f"{sum(map(len, outputs)) / wall:7.1f} tok/s  "
                    f"acceptance {accepted / drafted if drafted else float('nan'):.2f}  "
                    f"same as plain: {outputs == plain}",
                    flush=True,
                )


if __name__ == "__main__":
    script_main(main)
