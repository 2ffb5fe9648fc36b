"""A/B two speculative packages that share a target, in one process, on the bench chat
prompts: per prompt, plain decode, then A's draft, then B's draft, then plain again through
B (a control: should read 1.00x), for `rounds` passes. One process and per-prompt turns keep
a machine's drift (tens of percent between `aotgen bench` invocations) out of the comparison.

    .venv/bin/python scripts/ab_spec.py artifacts/smollm2-135m-spec artifacts/OTHER 3
"""

from __future__ import annotations

import argparse
import json

from aotgen.bench import PROMPTS_FILE
from aotgen.cli.common import script_main
from aotgen.runtime.engine import Engine, GenerationConfig


def main(a_path: str, b_path: str, rounds: int) -> None:
    a, b = Engine.load(a_path, threads=2), Engine.load(b_path, threads=2)
    prompts = [a.chat_ids(p) for p in json.loads(PROMPTS_FILE.read_text())["chat"]]
    modes = {"plain": (a, None), "A draft": (a, "draft"), "B draft": (b, "draft"),
             "B plain": (b, None)}  # fmt: skip
    total = {m: [0.0, 0] for m in modes}
    for r in range(rounds):
        this = {m: [0.0, 0] for m in modes}
        for ids in prompts:
            for m, (engine, mode) in modes.items():
                res = engine.generate(ids, GenerationConfig(max_new_tokens=96, speculative=mode))
                for acc in (total, this):  # decode tok/s as `aotgen bench`: after the 1st token
                    acc[m][0] += res.decode_s
                    acc[m][1] += len(res.token_ids) - 1
        base = this["plain"][1] / this["plain"][0]
        print(f"round {r}: " + ", ".join(f"{m} {n / s / base:.2f}x" for m, (s, n) in this.items()))
    base = total["plain"][1] / total["plain"][0]
    print(
        "all: "
        + ", ".join(f"{m} {n / s:.1f} tok/s {n / s / base:.2f}x" for m, (s, n) in total.items())
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="speculative package A (artifacts/NAME)")
    ap.add_argument("b", help="speculative package B, same target")
    ap.add_argument("rounds", nargs="?", type=int, default=3)
    args = ap.parse_args()
    script_main(lambda: main(args.a, args.b, args.rounds))
