"""Quality of a compiled package, measured by the runtime on its own compiled graphs."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from aotgen.runtime.engine import Engine
from aotgen.runtime.tokenizer import Tokenizer

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "heldout.txt"


def cross_entropy(engine: Engine, ids: list[int]) -> float:
    """Mean next-token cross-entropy (nats/token) of `ids`, in windows of the context size."""
    return cross_entropy_of(
        lambda chunk: engine.target.forward(chunk, 0, all_logits=True), ids, engine.max_seq_len
    )


def cross_entropy_of(forward: Callable[[list[int]], Tensor], ids: list[int], window: int) -> float:
    """`cross_entropy` for any `forward(tokens) -> logits [T, V]` run from position 0: the
    builder scores its eager float model with it, on the same windows as the package."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        logits = forward(chunk[:-1])
        total += F.cross_entropy(logits.float(), torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return total / count


def heldout_ids(tokenizer: Tokenizer) -> list[int]:
    """The project's held-out English text (`aotgen/data/heldout.txt`, written for aotgen)."""
    return tokenizer.prompt_ids(HELDOUT.read_text())


def perplexity(engine: Engine, ids: list[int]) -> float:
    return math.exp(cross_entropy(engine, ids))
