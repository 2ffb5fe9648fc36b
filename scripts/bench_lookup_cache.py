"""What a lookup cache of earlier requests buys n-gram speculation, against llama.cpp's own.

Two streams of chat requests, answered greedily one after another, as a service sees them:
- `repeat`: the bench's six chat prompts, asked `--passes` times over (retries, regenerated
  answers, a popular question asked again);
- `same task`: eight requests for small Python functions, asked twice: answers that share
  their shape (signature, docstring, loop, return) but not their content.

Each request runs plain, with n-gram lookup on its own text (`ngram`), and with lookup on its
own text and a `LookupCache` of the requests before it in the stream (`ngram + cache`), the
three in turn on each request. With `--llama-cpp GGUF` (the same weights), llama.cpp's
`llama-lookup` answers the same prompt ids too, without and with its dynamic cache file
(`-lcd`, carried from request to request). Rows pool each pass of a stream: decode tok/s
(tokens after the first over the time after it), acceptance, verify steps.

    python scripts/bench_lookup_cache.py artifacts/smollm2-135m --llama-cpp f32.gguf --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aotgen.bench import (  # noqa: E402
    PROMPTS_FILE,
    LookupRun,
    llama_lookup_binary,
    run_llama_lookup,
)
from aotgen.cli.common import print_json, script_main  # noqa: E402
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationResult  # noqa: E402
from aotgen.runtime.lookup_cache import LookupCache  # noqa: E402

FUNCTIONS = [
    "returns the sum of a list of numbers",
    "returns the largest number in a list",
    "returns the average of a list of numbers",
    "counts the vowels in a string",
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a string",
    "returns the factorial of a number",
]


@dataclass
class Pooled:
    """One mode's results over a pass of a stream."""

    tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    ids: list[list[int]] = field(default_factory=list)

    def add(self, result: GenerationResult) -> None:
        self.tokens += len(result.token_ids)
        self.decode_tokens += len(result.token_ids) - 1
        self.decode_s += result.decode_s
        if result.spec is not None:
            self.drafted += result.spec.drafted
            self.accepted += result.spec.accepted
            self.steps += result.spec.steps
        self.ids.append(result.token_ids)

    def add_llama(self, run: LookupRun) -> None:
        self.tokens += run.predicted
        self.decode_tokens += run.predicted - 1
        self.decode_s += run.decode_s
        self.drafted += run.drafted
        self.accepted += run.accepted

    def row(self, plain: Pooled | None) -> dict:
        return {
            "decode_tok_s": round(self.decode_tokens / self.decode_s, 1),
            "acceptance": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "accepted": self.accepted,
            "steps": self.steps or None,
            "tokens": self.tokens,
            "same_as_plain": None if plain is None or not self.ids else self.ids == plain.ids,
        }


def streams(engine: Engine, passes: int) -> dict[str, list[list[list[int]]]]:
    """Each stream's passes, each pass its requests' prompt ids in order."""
    chat = [engine.chat_ids(p) for p in json.loads(PROMPTS_FILE.read_text())["chat"]]
    code = [engine.chat_ids(f"Write a Python function that {what}.") for what in FUNCTIONS]
    return {"repeat": [chat] * passes, "same task": [code] * 2}


def bench_stream(
    engine: Engine,
    passes: list[list[list[int]]],
    tokens: int,
    llama: tuple[Path, Path, int] | None,
    llama_cache: Path,
) -> list[dict]:
    """Every request of every pass in each mode in turn; one row per pass and mode.
    `llama_cache`: llama-lookup's cache file for this stream (none yet)."""
    plain = GenerationConfig(max_new_tokens=tokens, reuse_prefix=False)
    ngram = replace(plain, speculative="ngram")
    cache = LookupCache()
    rows = []
    for n, prompts in enumerate(passes, 1):
        pooled = {m: Pooled() for m in ("plain", "ngram", "ngram + cache")}
        if llama:
            pooled |= {"llama-lookup": Pooled(), "llama-lookup -lcd": Pooled()}
        for ids in prompts:
            engine.lookup_cache = None
            pooled["plain"].add(engine.generate(ids, plain))
            pooled["ngram"].add(engine.generate(ids, ngram))
            engine.lookup_cache = cache
            pooled["ngram + cache"].add(engine.generate(ids, ngram))
            engine.lookup_cache = None
            if llama:
                binary, gguf, threads = llama
                text = engine.tokenizer.decode(ids)
                args = (binary, gguf, text, tokens, engine.verify_k, threads)
                pooled["llama-lookup"].add_llama(run_llama_lookup(*args))
                pooled["llama-lookup -lcd"].add_llama(run_llama_lookup(*args, llama_cache))
        rows += [
            {"pass": n, "mode": m, **p.row(pooled["plain"] if m != "plain" else None)}
            for m, p in pooled.items()
        ]
    return rows


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--llama-cpp", type=Path, help="a GGUF of the same weights")
    parser.add_argument("--passes", type=int, default=3, help="passes over the repeat stream")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    engine = Engine.load(args.package, threads=args.threads)
    llama = (llama_lookup_binary(), args.llama_cpp, args.threads) if args.llama_cpp else None
    engine.generate(engine.chat_ids("Hello"), GenerationConfig(max_new_tokens=8))  # warm-up
    report: dict = {"package": str(args.package), "threads": args.threads, "streams": {}}
    with tempfile.TemporaryDirectory() as work:
        for name, passes in streams(engine, args.passes).items():
            llama_cache = Path(work) / f"{name.replace(' ', '-')}.bin"
            rows = bench_stream(engine, passes, args.tokens, llama, llama_cache)
            report["streams"][name] = rows
    if args.json:
        print_json(report, indent=1)
    else:
        for name, rows in report["streams"].items():
            for row in rows:
                cells = " | ".join(f"{k} {v}" for k, v in row.items())
                print(f"{name} | {cells}")
    return report


if __name__ == "__main__":
    script_main(main)
