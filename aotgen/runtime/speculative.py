"""Speculative decoding core: verify drafted tokens against the target, draft length, stats.

Pure tensor code (torch + stdlib only). Verification follows Leviathan et al. 2023 / Chen et
al. 2023 (as in gpt-fast's `speculative_decode` and vLLM's rejection sampler): every verify
step emits the accepted draft prefix plus exactly one token from the target, so the output
is distributed exactly as if the target had decoded on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from aotgen.runtime.sampling import SamplingParams, logits_to_probs, sample, select_next


def verify_greedy(draft_tokens: list[int], target_logits: Tensor) -> list[int]:
    """Accept draft tokens while they equal the target's argmax, then add the target's token.

    target_logits is [K+1, V]: row i is the target's prediction after i draft tokens. Returns
    the accepted prefix plus the target's argmax at the first mismatch (or the bonus token from
    row K when all K are accepted): 1..K+1 tokens.
    """
    k = len(draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits must be [K+1, V] = [{k + 1}, V], got {tuple(target_logits.shape)}"
        )
    predicted = target_logits.argmax(-1).tolist()
    accepted = 0
    while accepted < k and draft_tokens[accepted] == predicted[accepted]:
        accepted += 1
    return list(draft_tokens[:accepted]) + [predicted[accepted]]


def residual_probs(target_probs: Tensor, draft_probs: Tensor) -> Tensor:
    """max(0, p_target - p_draft) per row (unnormalised), or p_target where that is all zero.

    The residual is only all-zero when p_target == p_draft, where rejection has probability 0;
    the fallback keeps float noise from ever handing an all-zero row to the sampler.
    """
    residual = (target_probs - draft_probs).clamp_(min=0.0)
    empty = residual.sum(-1, keepdim=True) <= 0
    return torch.where(empty, target_probs, residual)


def rejection_sample(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Batched speculative sampling over B independent sequences.

    draft_tokens [B, K] int64, draft_probs [B, K, V] (the distribution each draft token was
    drawn from), target_probs [B, K+1, V], both processed with the same SamplingParams.
    Returns (num_accepted [B] in 0..K, next_token [B]): the emitted tokens of row b are
    draft_tokens[b, :num_accepted[b]] followed by next_token[b].
    """
    batch, k = draft_tokens.shape
    draft_probs = draft_probs.float()
    target_probs = target_probs.float()
    rows = torch.arange(batch)
    if k == 0:
        return torch.zeros(batch, dtype=torch.long), sample(target_probs[:, 0], generator)

    # Accept token i with probability min(1, p_target / p_draft), i.e. u * p_draft < p_target
    # for u ~ U[0, 1) (no division, and p_target >= p_draft > 0 always accepts).
    tokens = draft_tokens.unsqueeze(-1)
    p_target = target_probs[:, :k].gather(-1, tokens).squeeze(-1)
    p_draft = draft_probs.gather(-1, tokens).squeeze(-1)
    uniform = torch.rand((batch, k), generator=generator)
    accepted = uniform * p_draft < p_target
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # length of the all-accepted prefix

    # First rejection at i < K: sample from the residual max(0, p_target[i] - p_draft[i]).
    # All K accepted: sample the bonus token from p_target[K] (a residual against zero).
    rejected = num_accepted < k
    draft_row = draft_probs[rows, num_accepted.clamp(max=k - 1)] * rejected.unsqueeze(-1)
    next_probs = residual_probs(target_probs[rows, num_accepted], draft_row)
    return num_accepted, sample(next_probs, generator)


def verify_stochastic(
    draft_tokens: list[int],
    draft_probs: Tensor,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative sampling for one sequence: accepted draft prefix + one target token.

    draft_probs [K, V], target_probs [K+1, V]; see `rejection_sample` (this is its B=1 case).
    With greedy (one-hot) probabilities this reduces to `verify_greedy`.
    """
    k = len(draft_tokens)
    if draft_probs.dim() != 2 or draft_probs.shape[0] != k:
        raise ValueError(f"draft_probs must be [K, V] = [{k}, V], got {tuple(draft_probs.shape)}")
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"target_probs must be [K+1, V] = [{k + 1}, V], got {tuple(target_probs.shape)}"
        )
    if k and draft_probs.shape[1] != target_probs.shape[1]:
        raise ValueError(
            f"vocab mismatch: draft_probs has {draft_probs.shape[1]}, "
            f"target_probs has {target_probs.shape[1]}"
        )
    tokens = torch.tensor([draft_tokens], dtype=torch.long).reshape(1, k)
    num_accepted, next_token = rejection_sample(
        tokens, draft_probs.unsqueeze(0), target_probs.unsqueeze(0), generator
    )
    n = int(num_accepted)
    return list(draft_tokens[:n]) + [int(next_token)]


@dataclass
class Proposal:
    """The draft tokens of one verify step (see aotgen/runtime/proposers.py)."""

    tokens: list[int]
    # [K, V]: the distribution each token was drawn from (a sampled draft); None for a
    # deterministic proposal (a greedy draft, n-gram lookup).
    probs: Tensor | None = None
    looked_up: bool = False  # from n-gram lookup, not the draft model

    def draft_probs(self, vocab: int) -> Tensor:
        """probs; a deterministic proposal is a distribution with all mass on its token."""
        if self.probs is not None:
            return self.probs
        q = torch.zeros(len(self.tokens), vocab)
        q[torch.arange(len(self.tokens)), torch.tensor(self.tokens)] = 1.0
        return q


def verify(
    proposal: Proposal,
    target_logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The accepted prefix of the proposal plus one token from the target: 1..K+1 tokens.

    target_logits [K+1, V] score the current token followed by the proposal. Greedy decoding
    accepts exact argmax matches; sampling uses speculative sampling (`verify_stochastic`).
    """
    if params.greedy:
        return verify_greedy(proposal.tokens, target_logits)
    if not proposal.tokens:
        return [select_next(target_logits[0], params, generator)]
    return verify_stochastic(
        proposal.tokens,
        proposal.draft_probs(target_logits.shape[-1]),
        logits_to_probs(target_logits, params),
        generator,
    )


@dataclass
class AdaptiveK:
    """Draft-length schedule of HF assisted generation: +2 after a full accept, else -1."""

    k: int = 4
    k_min: int = 1
    k_max: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        self.k = min(max(self.k, self.k_min), self.k_max)

    def update(self, num_drafted: int, num_accepted: int) -> int:
        """Adjust k after a verify step and return it. Steps with no draft leave k alone."""
        if num_drafted > 0:
            step = 2 if num_accepted >= num_drafted else -1
            self.k = min(max(self.k + step, self.k_min), self.k_max)
        return self.k


@dataclass
class SpecStats:
    """Acceptance bookkeeping across verify steps (for logs and benchmarks)."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    lookup_steps: int = 0  # steps whose proposal came from n-gram lookup, not the draft
    tree_nodes: int = 0  # drafted tree nodes (tree speculation: `drafted` counts depths)
    branch_steps: int = 0  # tree steps whose accepted path left the main chain
    accepted_by_position: list[int] = field(default_factory=list)
    proposed_by_position: list[int] = field(default_factory=list)

    def update(self, num_drafted: int, num_accepted: int, lookup: bool = False) -> None:
        """Record one verify step that checked num_drafted tokens and accepted num_accepted."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {num_accepted}, {num_drafted}")
        self.steps += 1
        self.lookup_steps += lookup
        self.drafted += num_drafted
        self.accepted += num_accepted
        width = max(len(self.proposed_by_position), num_drafted)
        for counts in (self.proposed_by_position, self.accepted_by_position):
            counts.extend([0] * (width - len(counts)))
        for i in range(num_drafted):
            self.proposed_by_position[i] += 1
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the target accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: accepted drafts plus the target's own token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate_by_position(self) -> list[float]:
        """P(draft position i accepted | it was proposed)."""
        return [
            a / p if p else 0.0
            for a, p in zip(self.accepted_by_position, self.proposed_by_position, strict=True)
        ]
