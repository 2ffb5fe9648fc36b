"""Token sampling: logits -> probabilities -> token ids.

Pure tensor code (torch + stdlib only) so the runtime can use it without any model code.
Greedy decoding is the temperature-0 case of the same math (a one-hot distribution), which
lets speculative verification treat greedy and stochastic decoding alike; `select_next`
keeps a cheap argmax path for the plain decode loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf/nan.
GREEDY_EPS = 1e-5
# Seeds are torch.Generator's: 64-bit unsigned.
SEED_MAX = 2**64 - 1
# top-p first looks at this many most likely tokens (see _top_p).
TOP_P_HEAD = 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Order of application (as in HF): temperature, top-k, top-p,
    min-p."""

    temperature: float = 0.0  # 0 -> greedy (argmax)
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1 -> off
    seed: int | None = None
    min_p: float = 0.0  # 0 -> off; else drop tokens below min_p x the top token's probability

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator; seeded for reproducible runs, else seeded from OS entropy."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, top-p and
    min-p.

    top-k keeps every token tied with the k-th largest logit, top-p keeps the smallest set
    of most likely tokens whose mass reaches top_p (always at least the top token), and min-p
    the tokens at least min_p times as likely as the top one, all as in HF's logits warpers.
    Greedy params give the one-hot of the argmax. The input is not modified.
    """
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)

    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)  # ties with the k-th stay in
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p, head=params.top_k or TOP_P_HEAD)
    if params.min_p > 0.0:
        floor = params.min_p * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _top_p(probs: Tensor, top_p: float, head: int) -> Tensor:
    """Keep the smallest most-likely set reaching top_p mass, renormalised.

    Token j (in descending order) is kept iff the mass strictly before it is < top_p, which is
    HF's "drop if ascending cumsum <= 1 - top_p"; the top token is always kept. Sorting a 50k
    vocab costs milliseconds on CPU, so look only at the top `head` tokens and widen that until
    it holds top_p of the mass (usually at once): every token past it is dropped anyway.
    """
    vocab = probs.shape[-1]
    width = min(max(head, 1), vocab)
    while True:
        values, indices = torch.topk(probs, width, dim=-1)  # sorted, descending
        cumulative = values.cumsum(-1)
        if width == vocab or bool((cumulative[..., -1] >= top_p).all()):
            break
        width = min(width * 8, vocab)
    values = values.masked_fill(cumulative - values >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, indices, values)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """[N, V] probabilities (need not be normalised) -> [N] int64 token ids, one draw per row.

    Inverse-CDF sampling: one uniform per row and a binary search. torch.multinomial draws an
    exponential per vocab entry, ~20x slower for a 50k vocab on CPU. u lies in (0, total], so
    the first index with cdf >= u is never a zero-probability token.
    """
    cdf = probs.float().cumsum(-1)
    total = cdf[..., -1:]
    u = (1.0 - torch.rand(total.shape, generator=generator)) * total
    return torch.searchsorted(cdf, u).squeeze(-1)


def select_tokens(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> Tensor:
    """[N, V] logits -> [N] int64 next tokens; greedy is a bare argmax (no softmax)."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, params), generator)


def select_next(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """The decode-loop hot path: logits for one position ([V] or [1, V]) -> next token id."""
    if logits.numel() != logits.shape[-1]:
        raise ValueError(
            f"select_next takes logits for one position, got shape {tuple(logits.shape)}"
        )
    if params.greedy:
        return int(logits.argmax())
    return int(sample(logits_to_probs(logits.reshape(1, -1), params), generator))
