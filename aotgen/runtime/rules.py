"""What a request does to the logits before each token is chosen: logit bias, penalties on
tokens already in the text, its grammar (runtime/grammar.py), and `min_tokens`.

Order, per row: logit bias; the repetition penalty on every token of the prompt and the
answer so far (a positive logit divided by it, a negative one multiplied: HF's and vLLM's
rule); the frequency and presence penalties on the answer's tokens (OpenAI's: minus
frequency x count, minus presence if present); then the grammar's refusals at -inf; then,
while the answer is shorter than `min_tokens`, the tokens that would end it (eos, stop token
ids) at -inf, unless the grammar allows nothing else (its text is complete); last, where a
spent reasoning budget forces its closing text (runtime/reasoning_budget.py), only the forced
token. Sampling (temperature, top-k, top-p) follows. Logprobs are read from the raw rows
(runtime/logprobs.py).

The state (the answer's token counts, the grammar's position) advances with each accepted
token. Speculative decoding applies the rules to each verify row as they stand after the
proposal tokens before it, and to each tree node's row after its path, so the accepted
tokens are those the request would get decoding alone; drafters apply them while drafting
and roll back to where they started.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from aotgen.runtime.grammar import TokenConstraint
from aotgen.runtime.reasoning_budget import ReasoningBudget
from aotgen.runtime.sampling import SamplingParams, select_next
from aotgen.runtime.speculative import Proposal, verify

RowRules = Callable[[Tensor], Tensor]  # [n, V] logits -> the rows with the rules applied


@dataclass(frozen=True)
class Penalties:
    """OpenAI's and vLLM's penalties on repeated tokens, and OpenAI's logit bias."""

    repetition: float = 1.0  # > 1 discourages tokens of the prompt and the answer
    presence: float = 0.0  # subtracted from tokens the answer holds, -2..2
    frequency: float = 0.0  # subtracted per occurrence in the answer, -2..2
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit, -100..100)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.repetition) and self.repetition > 0):
            raise ValueError(f"repetition penalty must be > 0 (1 is off), got {self.repetition}")
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} penalty must be in -2..2 (0 is off), got {value}")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit bias of token {token} must be in -100..100, got {bias}")

    @property
    def active(self) -> bool:
        return self.repetition != 1 or bool(self.presence or self.frequency or self.logit_bias)


class TokenRules:
    """One request's rules and their state: the answer's token counts, its grammar's
    position. `taken` counts the answer's tokens so far (`eos`, the ids that end it, none
    under ignore_eos, is never taken)."""

    def __init__(
        self,
        penalties: Penalties | None,
        prompt: list[int],
        vocab_size: int,
        eos: set[int],
        grammar: TokenConstraint | None,
        min_tokens: int = 0,
        ends: set[int] = frozenset(),
        budget: ReasoningBudget | None = None,
    ):
        self.penalties = penalties if penalties is not None and penalties.active else None
        self.grammar, self.eos, self.budget = grammar, eos, budget
        self.min_tokens = min_tokens  # before this many answer tokens, `ends` are refused
        self.ends = torch.tensor(sorted(ends), dtype=torch.long)
        self.counts = torch.zeros(vocab_size)
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
        self.in_prompt[prompt] = True
        self.bias = torch.zeros(vocab_size)
        for token, bias in self.penalties.logit_bias if self.penalties else ():
            self.bias[token] += bias
        self.tokens: list[int] = []

    @property
    def taken(self) -> int:
        return len(self.tokens)

    def restrict(self, logits: Tensor) -> Tensor:
        """One row (`[V]` or `[1, V]`) with the rules as they stand now."""
        out = self._penalize(logits, self.counts)
        out = self.grammar.restrict(out) if self.grammar is not None else out
        out = self._hold_open(out, torch.tensor([self.taken])) if self.holding else out
        return out if self.budget is None else _force(out, [self.budget.forced()])

    def advance(self, tokens: list[int]) -> None:
        """Take a step's tokens, chosen under these rules, up to eos."""
        for tok in tokens:
            if tok in self.eos:
                return
            if self.grammar is not None:
                self.grammar.advance([tok])
            if self.budget is not None:
                self.budget.advance([tok])
            self.counts[tok] += 1
            self.tokens.append(tok)

    def rollback(self, count: int) -> None:
        if self.grammar is not None:
            self.grammar.rollback(count)
        if self.budget is not None:
            self.budget.rollback(count)
        for _ in range(count):
            self.counts[self.tokens.pop()] -= 1

    def along(self, tokens: list[int]) -> tuple[int, RowRules]:
        """How many leading `tokens` the rules take from here (the grammar may refuse one, a
        spent reasoning budget force another), and the rules of the verify rows: row i as
        they stand after tokens[:i]."""
        n, masks = self.grammar.along(tokens) if self.grammar is not None else (len(tokens), None)
        forced = None
        if self.budget is not None:
            taken, forced = self.budget.along(tokens[:n])
            n, forced = taken, forced[: taken + 1]
            masks = None if masks is None else masks[: n + 1]
        steps = None
        if self.penalties is not None:  # the counts each row adds to the answer's
            steps = torch.zeros(n + 1, len(self.counts))
            for i, tok in enumerate(tokens[:n]):
                steps[i + 1 :, tok] += 1
        lengths = self.taken + torch.arange(n + 1) if self.holding else None
        return n, lambda rows: self._rows(rows, steps, masks, lengths, forced)

    def over_tree(self, tokens: list[int], parents: list[int]) -> RowRules:
        """The rules of each tree node's row, as they stand after the node's path (node 0,
        the root, is the current token: the rules as they stand now)."""
        steps = None
        if self.penalties is not None:  # the counts each node's path adds to the answer's
            steps = torch.zeros(len(tokens), len(self.counts))
            for node, parent in enumerate(parents[1:], 1):
                steps[node] = steps[parent]
                steps[node, tokens[node]] += 1
        masks = None
        if self.grammar is not None:
            masks = self.grammar.over_tree(tokens, parents)
        lengths = None
        if self.holding:  # the answer's length at each node: its depth past the root
            depths = [0] * len(parents)
            for node, parent in enumerate(parents[1:], 1):
                depths[node] = depths[parent] + 1
            lengths = self.taken + torch.tensor(depths)
        forced = None if self.budget is None else self.budget.over_tree(tokens, parents)
        return lambda rows: self._rows(rows, steps, masks, lengths, forced)

    def _rows(
        self,
        rows: Tensor,
        steps: Tensor | None,
        masks: Tensor | None,
        lengths: Tensor | None,
        forced: list[int | None] | None = None,
    ) -> Tensor:
        """Verify or tree rows; `lengths`: the answer's length as each row stands (None when
        min_tokens holds nothing off); `forced`: each row's forced token (None: any)."""
        out = rows if steps is None else self._penalize(rows, self.counts + steps)
        out = out if masks is None else out.masked_fill(~masks, -math.inf)
        out = out if lengths is None else self._hold_open(out, lengths)
        return out if forced is None else _force(out, forced)

    @property
    def holding(self) -> bool:
        """Whether min_tokens still refuses the ending tokens."""
        return self.taken < self.min_tokens and len(self.ends) > 0

    def _hold_open(self, rows: Tensor, lengths: Tensor) -> Tensor:
        """`min_tokens`: the ending tokens refused in rows whose answer is still short, where
        anything else is allowed (callers check `holding` first)."""
        flat = rows.reshape(-1, rows.shape[-1])
        shut = flat.index_fill(1, self.ends, -math.inf)
        held = (lengths < self.min_tokens) & (shut.amax(dim=-1) > -math.inf)
        return torch.where(held[:, None], shut, flat).reshape(rows.shape)

    def _penalize(self, logits: Tensor, counts: Tensor) -> Tensor:
        """Bias and penalties, with the answer's token `counts` (broadcast over rows)."""
        p = self.penalties
        if p is None:
            return logits
        out = logits.float() + self.bias
        if p.repetition != 1:
            seen = self.in_prompt | (counts > 0)
            out = torch.where(
                seen, torch.where(out > 0, out / p.repetition, out * p.repetition), out
            )
        return out - p.frequency * counts - p.presence * (counts > 0).float()


def _force(rows: Tensor, forced: list[int | None]) -> Tensor:
    """Rows (`[V]` or `[n, V]`) whose forced token (None: none) is all they allow."""
    if all(token is None for token in forced):
        return rows
    flat = rows.reshape(-1, rows.shape[-1]).clone()
    for row, token in enumerate(forced):
        if token is not None:
            flat[row] = -math.inf
            flat[row, token] = 0.0
    return flat.reshape(rows.shape)


def select(
    logits: Tensor, params: SamplingParams, generator: torch.Generator, rules: TokenRules | None
) -> int:
    """`select_next` under the request's rules, which then take the chosen token."""
    if rules is None:
        return select_next(logits, params, generator)
    tok = select_next(rules.restrict(logits), params, generator)
    rules.advance([tok])
    return tok


def fit(proposal: Proposal, rules: TokenRules | None) -> tuple[Proposal, RowRules | None]:
    """The proposal cut to what the rules take, and the rules of its verify rows."""
    if rules is None:
        return proposal, None
    n, rows = rules.along(proposal.tokens)
    if n < len(proposal.tokens):
        probs = None if proposal.probs is None else proposal.probs[:n]
        proposal = Proposal(proposal.tokens[:n], probs, proposal.looked_up and n > 0)
    return proposal, rows


def verify_within(
    proposal: Proposal,
    logits: Tensor,
    rows: RowRules | None,
    params: SamplingParams,
    generator: torch.Generator,
    rules: TokenRules | None,
) -> list[int]:
    """`verify` with each row under the rules as they stand after the proposal tokens before
    it (`fit`); the rules then take the accepted tokens."""
    if rules is None or rows is None:
        return verify(proposal, logits, params, generator)
    accepted = verify(proposal, rows(logits), params, generator)
    rules.advance(accepted)
    return accepted
