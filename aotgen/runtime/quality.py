"""Quality of a compiled package, measured by the runtime on its own compiled graphs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from aotgen.runtime.engine import Engine


def cross_entropy(engine: Engine, ids: list[int]) -> float:
    """Mean next-token cross-entropy (nats/token) of `ids`, in windows of the context size."""
    window = engine.max_seq_len
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        logits = engine.target.forward(chunk[:-1], 0, all_logits=True)
        total += F.cross_entropy(logits.float(), torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return total / count


def perplexity(engine: Engine, ids: list[int]) -> float:
    return math.exp(cross_entropy(engine, ids))
