"""Draft tokens for several requests at once: each draft step is one `batch_decode` call of
the draft model for all of them, so its weights are read once per step, not once per request.

For drafts on the target's KV cache (`share_kv`): the target's verify has written every
accepted position of each request's row, so a round starts with a one-token decode of the
request's last token, as `DraftProposer` does alone. Tokens are chosen as it chooses them
(argmax, or sampled with the request's own generator, keeping each distribution for the
lossless acceptance rule; under its rules: penalties, grammar), so a request
drafts what it drafts alone up to float rounding.
"""

from __future__ import annotations

import torch

from aotgen.runtime.model_runner import ModelRunner
from aotgen.runtime.proposers import draft_token
from aotgen.runtime.sequence import Sequence
from aotgen.runtime.speculative import Proposal


def can_draft_in_batch(draft: ModelRunner | None) -> bool:
    return draft is not None and draft.shares_cache and "batch_decode" in draft.graphs


def draft_batch(draft: ModelRunner, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
    """`ks[i]` draft tokens for `seqs[i]` (fewer where it drafts eos), all requests
    stepping together."""
    tokens: list[list[int]] = [[] for _ in seqs]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    last = [s.history[-1] for s in seqs]
    pos = [len(s.history) - 1 for s in seqs]
    todo = list(ks)
    start = [s.rules.taken if s.rules is not None else 0 for s in seqs]
    while active := [i for i in range(len(seqs)) if todo[i] > 0]:
        logits_rows = draft.decode_many(
            [last[i] for i in active], [pos[i] for i in active], [seqs[i].slot for i in active]
        )
        for i, logits in zip(active, logits_rows, strict=True):
            seq = seqs[i]
            nxt, q = draft_token(logits, seq.config.sampling, seq.generator, seq.rules)
            tokens[i].append(nxt)
            rows[i] += [] if q is None else [q]
            last[i], pos[i] = nxt, pos[i] + 1
            ends = seq.rules is not None and nxt in seq.rules.eos
            todo[i] = 0 if ends else todo[i] - 1
    for seq, taken in zip(seqs, start, strict=True):
        if seq.rules is not None:
            seq.rules.rollback(seq.rules.taken - taken)
    return [Proposal(t, torch.stack(r) if r else None) for t, r in zip(tokens, rows, strict=True)]
