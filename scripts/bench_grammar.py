"""What a grammar costs per token: JSON-schema answers against the same prompts answered free.

For each request (a chat prompt asking for JSON, and its schema), aotgen answers greedily with
the schema and without it, and under the grammar of a tool_choice "auto" request with two
tools (Hermes' calls: text free until `<tool_call>`) against the free answer that also ends
at eos (`auto_tools`, `auto_free`; `auto_same`: whether the grammar left the answer as it
was), in rotating order, `--runs` times; with `--spec PKG`, also the
package's draft under the schema. With `--llama-cpp GGUF` (the same weights), llama.cpp's
`llama-server` answers the same prompt ids with its `json_schema` field and without it. Decode
rates are each engine's own (tokens after the first over the time after the first), medians
over runs; the free answers run as many tokens as the constrained ones (eos ignored).

    python scripts/bench_grammar.py artifacts/smollm2-135m --spec artifacts/smollm2-135m-spec \\
        --llama-cpp f32.gguf --runs 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aotgen.bench_chat import llama_completion, llama_server  # noqa: E402
from aotgen.cli.common import print_json, script_main  # noqa: E402
from aotgen.runtime.engine import Engine, GenerationConfig  # noqa: E402
from aotgen.runtime.grammar import Grammar  # noqa: E402
from aotgen.tool_calls import HermesFormat  # noqa: E402

# The tools of the auto rows: a template's tools (their calls never come: the prompts ask
# for JSON, not for a tool).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string"}},
                "required": [key],
            },
        },
    }
    for name, key in (("get_weather", "city"), ("search", "query"))
]

REQUESTS = [
    (
        "Describe Paris as JSON with keys city, country and population.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "country": {"type": "string"},
                "population": {"type": "integer"},
            },
            "required": ["city", "country", "population"],
            "additionalProperties": False,
        },
    ),
    (
        "Give a pancake recipe as JSON: a list of ingredients and a list of steps.",
        {
            "type": "object",
            "properties": {
                "ingredients": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
            },
            "required": ["ingredients", "steps"],
            "additionalProperties": False,
        },
    ),
    (
        "Invent a person and describe them as JSON: name, age, email and home address.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string"},
                "address": {
                    "type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"],
                },
            },
            "required": ["name", "age", "email", "address"],
        },
    ),
]


def _aotgen(engine: Engine, ids: list[int], schema: dict, max_tokens: int, runs: int, mode):
    """Median decode tok/s with the schema, free and under the auto tool grammar (as many
    tokens, in rotating order); the constrained answer's tokens; whether it parsed as JSON;
    whether the auto grammar's answer was the free one."""
    constrained = GenerationConfig(
        max_new_tokens=max_tokens, grammar=Grammar.json_schema(schema), speculative=mode
    )
    first = engine.generate(ids, constrained)  # greedy: every run answers this
    n = len(first.token_ids)
    free = GenerationConfig(max_new_tokens=n, ignore_eos=True, speculative=mode)
    # The auto grammar ends at eos (a grammar refuses ignore_eos): against the free answer
    # that ends there too, the same tokens where the grammar left it as it was.
    tools = HermesFormat().auto_grammar(TOOLS, True, engine.tokenizer.special_tokens)
    auto = GenerationConfig(max_new_tokens=max_tokens, grammar=tools, speculative=mode)
    free_eos = replace(auto, grammar=None)
    same = engine.generate(ids, auto).text == engine.generate(ids, free_eos).text
    rates: dict[str, list[float]] = {"schema": [], "free": [], "auto": [], "free_eos": []}
    order = [("schema", constrained), ("free", free), ("auto", auto), ("free_eos", free_eos)]
    for run in range(runs):
        for name, config in order[run % 4 :] + order[: run % 4]:
            rates[name].append(engine.generate(ids, config).decode_tok_s)
    try:
        parsed = isinstance(json.loads(first.text), dict)
    except json.JSONDecodeError:
        parsed = False
    median = {name: statistics.median(values) for name, values in rates.items()}
    return median["schema"], median["free"], n, parsed, median["auto"], median["free_eos"], same


def _llama(url: str, ids: list[int], schema: dict, max_tokens: int, runs: int):
    rates, free, n = [], [], 0
    for _ in range(runs):
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False}
        answer = llama_completion(url, {**body, "json_schema": schema})
        n = answer["timings"]["predicted_n"]
        rates.append(answer["timings"]["predicted_per_second"])
        plain = llama_completion(url, {**body, "n_predict": n, "ignore_eos": True})
        free.append(plain["timings"]["predicted_per_second"])
    return statistics.median(rates), statistics.median(free), n


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--spec", type=Path, help="a package with a draft model")
    parser.add_argument("--llama-cpp", type=Path, help="a GGUF of the same weights")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    engine = Engine.load(args.package, threads=args.threads)
    spec = Engine.load(args.spec, threads=args.threads) if args.spec else None
    rows = []
    for question, schema in REQUESTS:
        ids = engine.chat_ids(question)
        engine.generate(ids, GenerationConfig(max_new_tokens=4))  # warm-up
        row = dict(
            zip(
                ("schema", "free", "tokens", "json", "auto_tools", "auto_free", "auto_same"),
                _aotgen(engine, ids, schema, args.max_tokens, args.runs, None),
                strict=True,
            )
        )
        if spec is not None:
            row["draft_schema"], row["draft_free"], *_ = _aotgen(
                spec, ids, schema, args.max_tokens, args.runs, "draft"
            )
        rows.append({"question": question, **row})
    if args.llama_cpp:
        with llama_server(args.llama_cpp, args.threads) as url:
            for row, (question, schema) in zip(rows, REQUESTS, strict=True):
                ids = engine.chat_ids(question)
                rate, free, n = _llama(url, ids, schema, args.max_tokens, args.runs)
                row |= {"llama_schema": rate, "llama_free": free, "llama_tokens": n}
    report = {"package": str(args.package), "threads": args.threads, "rows": rows}
    if args.json:
        print_json(report, indent=1)
    else:
        for row in rows:
            cells = [f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()]
            print(" | ".join(cells))
    return report


if __name__ == "__main__":
    script_main(main)
