"""One rank of a tensor-parallel package under torchrun, for tests/test_tp.py.

    torchrun --nproc-per-node 2 tests/tp_worker.py PACKAGE OUT.pt

Rank 0 runs the graph calls of `SCENARIOS` and a greedy generation through the runtime
(every call replayed by the other ranks) and saves logits, token ids and any model/export
module the runtime imported (there must be none) to OUT.pt.
"""

from __future__ import annotations

import sys

import torch
from test_runtime_isolation import FORBIDDEN_MODULES

from aotgen.runtime.distributed import start
from aotgen.runtime.engine import GenerationConfig

# (name, tokens, start position): 11 and 16 tokens run the prefill graph, 1 decode, 5 verify.
SCENARIOS = [("prefill", 11, 0), ("prefill", 16, 5), ("decode", 1, 7), ("verify", 5, 9)]
GREEDY_PROMPT = "Paris is the capital of"
GREEDY_TOKENS = 32


def scenario_logits(runner, length: int, start_pos: int) -> torch.Tensor:
    """Fill positions 0..start_pos-1 with a prefix, then score `length` tokens at start_pos."""
    g = torch.Generator().manual_seed(length + start_pos)
    history = torch.randint(0, runner.vocab_size, (start_pos + length,), generator=g).tolist()
    if start_pos:
        runner.forward(history[:start_pos], 0)
    return runner.forward(history[start_pos:], start_pos, all_logits=True)


def greedy(engine) -> list[int]:
    ids = engine.tokenizer.encode(GREEDY_PROMPT)
    cfg = GenerationConfig(max_new_tokens=GREEDY_TOKENS, ignore_eos=True)
    return engine.generate(ids, cfg).token_ids


def main(package: str, out: str) -> None:
    engine = start(package, threads=1)
    if engine is None:  # rank > 0: replayed rank 0's calls
        return
    logits = {f"{n}-{t}-{s}": scenario_logits(engine.target, t, s) for n, t, s in SCENARIOS}
    tokens = greedy(engine)
    loaded = sorted(m for m in sys.modules if m.startswith((*FORBIDDEN_MODULES, "torch._dynamo")))
    torch.save({"logits": logits, "greedy": tokens, "model_modules": loaded}, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
