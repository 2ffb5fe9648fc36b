"""Proposers: where the draft tokens of a speculative step come from.

A proposer answers `propose(history, k)` with a `Proposal` of up to k tokens to follow
`history` (prompt + output so far; its last token sits at position len(history) - 1 and is
not in the target's cache yet), and hears `accepted(pos)` once the target has verified them.
The engine's loop is the same whichever proposer it holds: propose -> verify -> accept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from aotgen.runtime.ngram import NgramProposer
from aotgen.runtime.sampling import SamplingParams, logits_to_probs, sample
from aotgen.runtime.speculative import Proposal

if TYPE_CHECKING:
    from aotgen.runtime.lookup_cache import LookupCache
    from aotgen.runtime.model_runner import ModelRunner
    from aotgen.runtime.rules import TokenRules


class Proposer(Protocol):
    def propose(self, history: list[int], k: int) -> Proposal:
        """Up to k tokens to follow history."""
        ...

    def accepted(self, pos: int) -> None:
        """After verification: positions < pos of the target's cache hold accepted tokens."""
        ...


def prefill_draft(draft: ModelRunner, prompt: list[int], slot: int, reuse: bool) -> None:
    """Put the prompt in a draft's own cache row, running only what no row holds yet (copied
    from the row holding it), all of it without `reuse`. Through `draft.forward`, which a
    tensor-parallel rank 0 announces to the other ranks."""
    start = draft.share_prefix(slot, prompt) if reuse else 0
    if start < len(prompt):
        draft.forward(prompt[start:], start, slot=slot)


def draft_token(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    rules: TokenRules | None = None,
) -> tuple[int, Tensor | None]:
    """One draft token: the argmax, or a draw whose distribution is kept for speculative
    sampling. Under the request's rules (penalties, grammar: runtime/rules.py), which then
    take the token (the drafter rolls back to where it started once the proposal is
    made)."""
    if rules is not None:
        logits = rules.restrict(logits)
    if params.greedy:
        tok, q = int(logits.argmax()), None
    else:
        q = logits_to_probs(logits[None], params)[0]
        tok = int(sample(q[None], generator))
    if rules is not None:
        rules.advance([tok])
    return tok, q


class LookupProposer:
    """n-gram lookup in the prompt + output (`NgramProposer`), then in earlier requests'
    texts (`shared`, a LookupCache) when given: no model, deterministic. One per request: its
    index grows with the request's text."""

    def __init__(self, min_n: int, max_n: int, shared: LookupCache | None = None) -> None:
        self.ngram = NgramProposer(min_n, max_n, shared)

    def propose(self, history: list[int], k: int) -> Proposal:
        tokens = self.ngram.propose(history, k)
        return Proposal(tokens, looked_up=bool(tokens))

    def accepted(self, pos: int) -> None:
        pass


class DraftProposer:
    """k tokens from the draft model, greedy or sampled; sampling keeps each token's
    distribution for speculative sampling; under the request's rules (runtime/rules.py).
    `self.pos` is the first position missing from the draft's cache."""

    def __init__(
        self,
        draft: ModelRunner,
        prompt: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        slot: int = 0,
        reuse_prefix: bool = True,
        rules: TokenRules | None = None,
    ) -> None:
        self.draft, self.params, self.generator, self.slot = draft, params, generator, slot
        self.rules = rules
        # A draft that shares the target's cache finds every accepted position already
        # written by the target (prefill, then each verify), so it never prefills and never
        # catches up: each round starts with a one-token decode of `tok` (history[-1]). Its
        # own entries (tok and the proposals) are overwritten by the verify that follows.
        if not draft.shares_cache:
            prefill_draft(draft, prompt, slot, reuse_prefix)
        self.pos = len(prompt)

    def propose(self, history: list[int], k: int) -> Proposal:
        if self.draft.shares_cache:
            self.pos = len(history) - 1
        # Catch the draft cache up on accepted tokens it has not seen, then draft.
        pending = history[self.pos :]
        logits = self.draft.forward(pending, self.pos, slot=self.slot)
        self.pos += len(pending)
        tokens: list[int] = []
        rows: list[Tensor] = []
        rules = self.rules
        start = rules.taken if rules is not None else 0
        for i in range(k):
            nxt, q = draft_token(logits, self.params, self.generator, rules)
            tokens.append(nxt)
            rows += [] if q is None else [q]
            if i + 1 == k or (rules is not None and nxt in rules.eos):
                break
            logits = self.draft.decode(nxt, self.pos, self.slot)
            self.pos += 1
        if rules is not None:
            rules.rollback(rules.taken - start)
        return Proposal(tokens, torch.stack(rows) if rows else None)

    def accepted(self, pos: int) -> None:
        # The draft cache is valid up to the accepted prefix; later positions are stale and
        # get overwritten next round (position overwrite: no rollback). After a full accept
        # the last proposal is not in it yet: it is fed with the next round.
        self.pos = min(self.pos, pos)


class DraftOrLookupProposer:
    """draft+ngram: a long enough match in the prompt + output costs nothing to propose; the
    draft runs only when there is none."""

    def __init__(self, lookup: LookupProposer, draft: DraftProposer) -> None:
        self.lookup, self.draft = lookup, draft

    def propose(self, history: list[int], k: int) -> Proposal:
        proposal = self.lookup.propose(history, k)
        return proposal if proposal.tokens else self.draft.propose(history, k)

    def accepted(self, pos: int) -> None:
        self.draft.accepted(pos)
