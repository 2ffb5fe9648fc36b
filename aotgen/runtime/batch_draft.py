"""Draft tokens for several requests at once: each draft step is one `batch_decode` call of
the draft model for all of them, so its weights are read once per step, not once per request.

For drafts on the target's KV cache (`share_kv`): the target's verify has written every
accepted position of each request's row, so a round starts with a one-token decode of the
request's last token, as `DraftProposer` does alone. Tokens are chosen as it chooses them
(argmax, or sampled with the request's own generator, keeping each distribution for the
lossless acceptance rule), so a request drafts what it drafts alone up to float rounding.
"""

from __future__ import annotations

import torch

from aotgen.runtime.engine import ModelRunner
from aotgen.runtime.sampling import logits_to_probs, sample
from aotgen.runtime.sequence import Sequence
from aotgen.runtime.speculative import Proposal


def can_draft_in_batch(draft: ModelRunner | None) -> bool:
    return draft is not None and draft.shares_cache and "batch_decode" in draft.graphs


def draft_batch(draft: ModelRunner, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
    """`ks[i]` draft tokens for `seqs[i]`, all requests stepping together."""
    tokens: list[list[int]] = [[] for _ in seqs]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    last = [s.history[-1] for s in seqs]
    pos = [len(s.history) - 1 for s in seqs]
    for step in range(max(ks)):
        active = [i for i in range(len(seqs)) if step < ks[i]]
        logits_rows = draft.decode_many(
            [last[i] for i in active], [pos[i] for i in active], [seqs[i].slot for i in active]
        )
        for i, logits in zip(active, logits_rows, strict=True):
            params, generator = seqs[i].config.sampling, seqs[i].generator
            if params.greedy:
                nxt = int(logits.argmax())
            else:
                rows[i].append(logits_to_probs(logits[None], params)[0])
                nxt = int(sample(rows[i][-1][None], generator))
            tokens[i].append(nxt)
            last[i], pos[i] = nxt, pos[i] + 1
    return [Proposal(t, torch.stack(r) if r else None) for t, r in zip(tokens, rows, strict=True)]
