"""Speculative decoding core: greedy/stochastic verification, K schedule, stats.

The distribution tests follow vLLM's test_rejection_sampler.py: a toy "model" whose next-token
distribution depends only on the position (target p_table[pos], draft q_table[pos]), so the
tokens emitted by speculative sampling must be distributed exactly as p_table[0] x p_table[1].
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from aotgen.runtime.sampling import SamplingParams, logits_to_probs, make_generator, sample
from aotgen.runtime.speculative import (
    AdaptiveK,
    SpecStats,
    rejection_sample,
    residual_probs,
    verify_greedy,
    verify_stochastic,
)

V = 8
Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def one_hot_logits(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), vocab).float() * 5.0


# ---- verify_greedy ---------------------------------------------------------------------------


def test_verify_greedy_all_accepted_gets_bonus() -> None:
    assert verify_greedy([3, 1, 4], one_hot_logits([3, 1, 4, 7])) == [3, 1, 4, 7]


def test_verify_greedy_first_rejected() -> None:
    assert verify_greedy([3, 1, 4], one_hot_logits([2, 1, 4, 7])) == [2]


def test_verify_greedy_middle_rejected() -> None:
    assert verify_greedy([3, 1, 4], one_hot_logits([3, 9, 4, 7])) == [3, 9]
    assert verify_greedy([3, 1, 4], one_hot_logits([3, 1, 0, 7])) == [3, 1, 0]


def test_verify_greedy_no_draft_and_bad_shape() -> None:
    assert verify_greedy([], one_hot_logits([6])) == [6]
    with pytest.raises(ValueError, match="K\\+1"):
        verify_greedy([1, 2], one_hot_logits([1, 2]))


# ---- verify_stochastic: small cases ------------------------------------------------------------


def test_stochastic_with_one_hot_probs_equals_greedy() -> None:
    rng = random.Random(0)
    greedy = SamplingParams()
    for _ in range(200):
        k = rng.randint(0, 4)
        target_tokens = [rng.randrange(4) for _ in range(k + 1)]
        draft = [rng.randrange(4) for _ in range(k)]
        target_logits = one_hot_logits(target_tokens, 4)
        target = logits_to_probs(target_logits, greedy)
        draft_probs = logits_to_probs(one_hot_logits(draft, 4).reshape(k, 4), greedy)
        got = verify_stochastic(draft, draft_probs, target, make_generator(rng.randrange(99)))
        assert got == verify_greedy(draft, target_logits)


def test_verify_stochastic_is_the_batched_core() -> None:
    gen = make_generator(0)
    for k in (0, 1, 3):
        q = torch.softmax(torch.randn(k, V, generator=gen), -1)
        p = torch.softmax(torch.randn(k + 1, V, generator=gen), -1)
        draft = sample(q, gen).tolist() if k else []
        for seed in range(20):
            out = verify_stochastic(draft, q, p, make_generator(seed))
            tokens = torch.tensor(draft, dtype=torch.long).reshape(1, k)
            n, nxt = rejection_sample(tokens, q[None], p[None], make_generator(seed))
            assert out == draft[: int(n)] + [int(nxt)]
            assert 1 <= len(out) <= k + 1


def test_verify_stochastic_shape_errors() -> None:
    q, p = torch.full((2, V), 1 / V), torch.full((3, V), 1 / V)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_stochastic([1], q, p)
    with pytest.raises(ValueError, match="target_probs"):
        verify_stochastic([1, 2], q, p[:2])
    with pytest.raises(ValueError, match="vocab"):
        verify_stochastic([1, 2], q, torch.full((3, V + 1), 1 / (V + 1)))


def test_residual_all_zero_falls_back_to_target() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.4, 0.1, 0.5]])
    r = residual_probs(p, q)
    assert r[0].tolist() == p[0].tolist()  # p == q: nothing left, fall back to p
    torch.testing.assert_close(r[1], torch.tensor([0.0, 0.2, 0.0]))


# ---- verify_stochastic: distribution --------------------------------------------------------


def always_accept(draft_tokens, draft_probs, target_probs, generator):
    """Broken on purpose: accepts every draft token, so the output follows the draft."""
    batch, k = draft_tokens.shape
    return torch.full((batch,), k), sample(target_probs[:, k], generator)


def resample_from_target(draft_tokens, draft_probs, target_probs, generator):
    """Broken on purpose (a classic bug): after a rejection, sample p_target, not the residual."""
    batch, k = draft_tokens.shape
    tokens = draft_tokens.unsqueeze(-1)
    p_t = target_probs[:, :k].gather(-1, tokens).squeeze(-1)
    p_d = draft_probs.gather(-1, tokens).squeeze(-1)
    accepted = torch.rand((batch, k), generator=generator) * p_d < p_t
    n = accepted.long().cumprod(-1).sum(-1)
    return n, sample(target_probs[torch.arange(batch), n], generator)


def speculative_step(sampler: Sampler, p_table, q_table, k: int, start, gen):
    """One draft + verify step per row from position start[b]; emitted tokens padded to K+1."""
    batch = start.numel()
    pos = start[:, None] + torch.arange(k + 1)
    draft_probs = q_table[pos[:, :k]]
    draft = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=gen).reshape(batch, k)
    n, nxt = sampler(draft, draft_probs, p_table[pos], gen)
    emitted = torch.cat([draft, torch.zeros(batch, 1, dtype=torch.long)], 1)
    emitted[torch.arange(batch), n] = nxt
    return emitted, n + 1


def first_two_tokens(sampler: Sampler, p_table, q_table, k: int, n: int, seed: int):
    """[n, 2]: first two tokens of n independent speculative generations (1 or 2 steps each)."""
    gen = make_generator(seed)
    out = torch.empty(n, 2, dtype=torch.long)
    emitted, length = speculative_step(
        sampler, p_table, q_table, k, torch.zeros(n, dtype=torch.long), gen
    )
    out[:, 0] = emitted[:, 0]
    out[:, 1] = emitted[:, 1]
    short = torch.nonzero(length < 2).squeeze(-1)  # first step emitted one token: step again
    emitted, _ = speculative_step(sampler, p_table, q_table, k, torch.ones_like(short), gen)
    out[short, 1] = emitted[:, 0]
    return out


def tv_distance(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * (freq - probs.double()).abs().sum().item()


def matches(samples: torch.Tensor, probs: torch.Tensor) -> bool:
    """TV(empirical, probs) under sqrt(V/n): ~2.5x the expected TV of an exact sampler."""
    return tv_distance(samples, probs) < math.sqrt(probs.numel() / samples.numel())


def check_emitted(tokens: torch.Tensor, p_table: torch.Tensor) -> bool:
    """First token ~ p0, second ~ p1, and the pair ~ p0 x p1 (catches dependence between them)."""
    joint = (p_table[0][:, None] * p_table[1][None, :]).reshape(-1)
    return (
        matches(tokens[:, 0], p_table[0])
        and matches(tokens[:, 1], p_table[1])
        and matches(tokens[:, 0] * V + tokens[:, 1], joint)
    )


def random_tables(k: int, seed: int, params: SamplingParams | None = None):
    gen = make_generator(seed)
    target_logits = torch.randn(k + 2, V, generator=gen) * 1.5
    draft_logits = target_logits + torch.randn(k + 2, V, generator=gen)  # a related draft
    params = params or SamplingParams(temperature=1.0)
    return logits_to_probs(target_logits, params), logits_to_probs(draft_logits, params)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_distribution_matches_target(k: int) -> None:
    p_table, q_table = random_tables(k, seed=k)
    tokens = first_two_tokens(rejection_sample, p_table, q_table, k, n=100_000, seed=10 + k)
    assert check_emitted(tokens, p_table)
    assert check_emitted(tokens[:10_000], p_table)  # the bound shrinks with n and still holds
    # Far closer to p than to other distributions (incl. the draft itself).
    gen = make_generator(99)
    others = [e / e.sum() for e in (-torch.rand(V, generator=gen).log() for _ in range(5))]
    tv_p = tv_distance(tokens[:, 0], p_table[0])
    tv_others = [tv_distance(tokens[:, 0], r) for r in [*others, q_table[0]]]
    assert tv_p < 0.1 * min(tv_others)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
        SamplingParams(temperature=0.8, top_p=0.95, min_p=0.2),
    ],
)
def test_distribution_with_top_k_top_p_min_p(k: int, params: SamplingParams) -> None:
    p_table, q_table = random_tables(k, seed=20 + k, params=params)
    assert ((p_table > 0) != (q_table > 0)).any()  # supports differ: residual path exercised
    tokens = first_two_tokens(rejection_sample, p_table, q_table, k, n=100_000, seed=30 + k)
    assert check_emitted(tokens, p_table)
    assert (p_table[0][tokens[:, 0]] > 0).all() and (p_table[1][tokens[:, 1]] > 0).all()


def test_public_api_distribution() -> None:
    """verify_stochastic itself, one call per sample (fewer samples, same bound formula)."""
    k, n = 2, 10_000
    p_table, q_table = random_tables(k, seed=5)
    gen = make_generator(6)
    draft = torch.stack(
        [torch.multinomial(q_table[i], n, True, generator=gen) for i in range(k)], 1
    )
    first = [verify_stochastic(d, q_table[:k], p_table[: k + 1], gen)[0] for d in draft.tolist()]
    assert matches(torch.tensor(first), p_table[0])


@pytest.mark.parametrize("broken", [always_accept, resample_from_target])
def test_negative_controls_fail_the_check(broken: Sampler) -> None:
    for k in (1, 3):
        p_table, q_table = random_tables(k, seed=k)
        tokens = first_two_tokens(broken, p_table, q_table, k, n=100_000, seed=10 + k)
        assert not check_emitted(tokens, p_table)


# ---- AdaptiveK and SpecStats -----------------------------------------------------------------


def test_adaptive_k_schedule() -> None:
    sched = AdaptiveK(k=4, k_min=1, k_max=8)
    assert sched.update(4, 4) == 6  # full accept: +2
    assert sched.update(6, 6) == 8
    assert sched.update(8, 8) == 8  # clamped at k_max
    assert sched.update(8, 3) == 7  # partial: -1
    assert sched.update(0, 0) == 7  # nothing drafted: no information, no change
    for _ in range(10):
        sched.update(sched.k, 0)
    assert sched.k == 1  # clamped at k_min
    assert AdaptiveK(k=50, k_max=10).k == 10


def test_spec_stats() -> None:
    stats = SpecStats()
    assert stats.acceptance_rate == 0.0 and stats.mean_accepted_length == 0.0
    stats.update(3, 3)
    stats.update(3, 1)
    stats.update(2, 0)
    stats.update(0, 0)
    assert (stats.drafted, stats.accepted, stats.steps) == (8, 4, 4)
    assert stats.proposed_by_position == [3, 3, 2]
    assert stats.accepted_by_position == [2, 1, 1]
    assert stats.acceptance_rate == 0.5
    assert stats.mean_accepted_length == (4 + 4) / 4
    assert stats.acceptance_rate_by_position == [2 / 3, 1 / 3, 1 / 2]
    with pytest.raises(ValueError):
        stats.update(2, 3)
