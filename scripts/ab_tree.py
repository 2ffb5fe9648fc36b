"""A/B a chain and a best-first tree of one package, in one process, on the bench chat
prompts: per prompt, the draft's chain, then the draft's best-first tree (`--best-first`), for
`rounds` passes in each order. Tokens per verify step come from the engine's statistics, ms
per token from the decode time after the first token (as `aotgen bench`).

    .venv/bin/python scripts/ab_tree.py artifacts/smollm2-135m-spec-tree --rounds 2
"""

from __future__ import annotations

import argparse
import json

from aotgen.bench import PROMPTS_FILE
from aotgen.cli.common import script_main
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.sampling import SamplingParams
from aotgen.runtime.tree_draft import TreeParams


def main(package: str, rounds: int, temperature: float, k: int) -> None:
    engine = Engine.load(package, threads=2)
    prompts = [engine.chat_ids(p) for p in json.loads(PROMPTS_FILE.read_text())["chat"]]
    sampling = SamplingParams(temperature=temperature, seed=0 if temperature else None)
    configs = {
        name: GenerationConfig(
            max_new_tokens=96, sampling=sampling, speculative="draft", k=k, tree=tree
        )
        for name, tree in (("chain", None), ("best-first tree", TreeParams(4, best_first=True)))
    }
    engine.generate(prompts[0], configs["chain"])  # warm up
    for r in range(2 * rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            seconds = tokens = accepted = steps = 0
            for ids in prompts:
                res = engine.generate(ids, configs[name])
                seconds += res.decode_s
                tokens += len(res.token_ids) - 1
                accepted += res.spec.accepted
                steps += res.spec.steps
            per_step = (accepted + steps) / steps
            print(
                f"pass {r} {name}: {1000 * seconds / tokens:.2f} ms/token, {per_step:.2f} tok/step"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("--rounds", type=int, default=2, help="passes in each order")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--k", type=int, default=6)
    args = parser.parse_args()
    script_main(lambda: main(args.package, args.rounds, args.temperature, args.k))
