"""`aotgen bench --turns N`: a multi-turn chat, each turn's time to first token with the
conversation so far found in the KV cache (prefix reuse) against the same prompt run whole.

Each turn's prompt is the chat template over every message so far, as a chat client sends
it: the earlier answers come back as text and are encoded again, so the reused prefix is
what re-encoding leaves equal to the ids the engine holds. Two engines of the package take
each turn, one reusing, one running every prompt from position 0, in alternating order;
their answers are compared (greedy: equal unless float rounding breaks a near-tie).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from aotgen.bench import PROMPTS_FILE
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationResult


@dataclass
class TurnRow:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_whole_ms: float  # median over conversations
    ttft_reused_ms: float
    same_text: bool  # in every conversation


def _conversation(
    reusing: Engine, whole: Engine, questions: list[str], turns: int, gen_tokens: int, flip: bool
) -> list[tuple[GenerationResult, GenerationResult]]:
    """One chat from an empty cache: per turn (reused, whole)."""
    reusing.target.cached.clear()
    config = GenerationConfig(max_new_tokens=gen_tokens)
    cold = GenerationConfig(max_new_tokens=gen_tokens, reuse_prefix=False)
    messages: list[dict[str, str]] = []
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": questions[turn % len(questions)]})
        ids = reusing.tokenizer.encode_chat(messages)
        if (turn % 2 == 0) != flip:
            reused, run_whole = reusing.generate(ids, config), whole.generate(ids, cold)
        else:
            run_whole, reused = whole.generate(ids, cold), reusing.generate(ids, config)
        out.append((reused, run_whole))
        messages.append({"role": "assistant", "content": reused.text})
    return out


def bench_chat(
    package: Path, turns: int, gen_tokens: int, runs: int, threads: int | None
) -> list[TurnRow]:
    """`runs` conversations of `turns` turns over the shipped chat prompts."""
    reusing = Engine.load(package, threads=threads)
    whole = Engine.load(package, threads=threads)
    questions = json.loads(PROMPTS_FILE.read_text())["chat"]
    _conversation(reusing, whole, questions, 1, 4, False)  # warm-up
    chats = [
        _conversation(reusing, whole, questions, turns, gen_tokens, run % 2 == 1)
        for run in range(runs)
    ]
    rows = []
    for turn in range(turns):
        pairs = [chat[turn] for chat in chats]
        reused = [r for r, _ in pairs]
        rows.append(
            TurnRow(
                turn + 1,
                reused[0].prompt_tokens,
                min(r.cached_tokens for r in reused),
                statistics.median(w.prefill_s for _, w in pairs) * 1e3,
                statistics.median(r.prefill_s for r in reused) * 1e3,
                all(r.token_ids == w.token_ids for r, w in pairs),
            )
        )
    return rows
