"""Sampling: temperature / top-k / top-p against a plain reference, greedy, seeding, validation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from aotgen.runtime.sampling import (
    SamplingParams,
    logits_to_probs,
    make_generator,
    sample,
    select_next,
    select_tokens,
)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Row-by-row, written for clarity: HF order temperature -> top-k -> top-p."""
    out = []
    for row in logits.float():
        row = row / temperature
        if 0 < top_k < row.numel():
            kth = sorted(row.tolist(), reverse=True)[top_k - 1]
            row = torch.where(row < kth, torch.tensor(float("-inf")), row)
        probs = torch.softmax(row, -1)
        if top_p < 1.0:  # smallest most-likely set whose mass reaches top_p
            order = probs.argsort(descending=True)
            last = min(int((probs[order].cumsum(0) < top_p).sum()), row.numel() - 1)
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[: last + 1]] = True
            probs = torch.where(mask, probs, 0.0)
            probs = probs / probs.sum()
        out.append(probs)
    return torch.stack(out)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [0, 1, 5, 40, 100])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
def test_matches_reference(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(16, 100, generator=make_generator(0)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = logits_to_probs(logits, params)
    expected = reference_probs(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    assert ((probs > 0) == (expected > 0)).all()  # identical support, not just close values
    torch.testing.assert_close(probs.sum(-1), torch.ones(16))


@pytest.mark.parametrize("min_p", [0.02, 0.2, 0.9])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (20, 1.0), (0, 0.8), (40, 0.9)])
def test_min_p_matches_transformers(min_p: float, top_k: int, top_p: float) -> None:
    """Temperature, top-k, top-p, min-p: the distribution of HF's warpers in HF's order."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(8, 500, generator=make_generator(3)) * 3
    warpers = [TemperatureLogitsWarper(0.8)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)]
    scores = logits.clone()
    for warper in warpers:
        scores = warper(None, scores)
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = logits_to_probs(logits, params)
    expected = torch.softmax(scores, -1)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    assert ((probs > 0) == (expected > 0)).all()
    kept = (probs > 0).sum(-1)
    without = (logits_to_probs(logits, replace(params, min_p=0)) > 0).sum(-1)
    assert (kept <= without).all()
    assert (kept < without).any() or min_p < 0.1  # min-p drops tokens


@pytest.mark.parametrize("top_k", [0, 300, 3000])
def test_top_p_on_a_large_flat_vocab(top_k: int) -> None:
    """Rows whose top_p set is larger than the first top-p head (256) take the widening path."""
    scale = torch.tensor([[0.2], [1.0], [4.0]])  # flat, medium, peaked
    logits = torch.randn(3, 5000, generator=make_generator(9)) * scale
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=0.9)
    probs = logits_to_probs(logits, params)
    expected = reference_probs(logits, 1.0, top_k, 0.9)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    assert ((probs > 0) == (expected > 0)).all()
    assert (probs[0] > 0).sum() > 256  # the flat row needed more than the first head


def test_temperature_scaling() -> None:
    logits = torch.randn(4, 50, generator=make_generator(1))
    for t in (0.3, 1.0, 2.5):
        probs = logits_to_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(probs, torch.softmax(logits / t, -1))
    entropy = [
        -(p * p.log()).sum().item()
        for p in (logits_to_probs(logits[0], SamplingParams(temperature=t)) for t in (0.3, 3.0))
    ]
    assert entropy[0] < entropy[1]


def test_top_k_keeps_ties_and_top_p_keeps_top_token() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [[True, True, True, True, False]]  # HF: ties stay in
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    # top_k >= V is a no-op, as is top_k == 0.
    full = logits_to_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(1.0, top_k=5)), full)
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(1.0, top_k=99)), full)


def test_greedy_is_one_hot_argmax_and_fast_path_agrees() -> None:
    logits = torch.randn(8, 300, generator=make_generator(2))
    greedy = SamplingParams()  # temperature 0
    probs = logits_to_probs(logits, greedy)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 300).float())
    assert torch.equal(select_tokens(logits, greedy), logits.argmax(-1))
    assert torch.equal(sample(probs, make_generator(0)), logits.argmax(-1))
    for row in logits:
        assert select_next(row, greedy) == int(row.argmax())
        assert select_next(row[None], greedy) == int(row.argmax())
    with pytest.raises(ValueError, match="one position"):
        select_next(logits, greedy)


def test_bf16_input_and_no_mutation() -> None:
    logits = torch.randn(3, 64, generator=make_generator(3))
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8)
    logits_to_probs(logits, params)
    assert torch.equal(logits, before)
    probs_bf16 = logits_to_probs(logits.bfloat16(), params)
    assert probs_bf16.dtype == torch.float32
    expected = reference_probs(logits.bfloat16().float(), 0.7, 10, 0.8)
    torch.testing.assert_close(probs_bf16, expected, atol=1e-6, rtol=1e-5)
    assert select_next(logits[0].bfloat16(), SamplingParams()) == int(logits[0].bfloat16().argmax())


def test_seeded_reproducibility() -> None:
    logits = torch.randn(64, 1000, generator=make_generator(4))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=123)
    a = select_tokens(logits, params, make_generator(params.seed))
    b = select_tokens(logits, params, make_generator(params.seed))
    c = select_tokens(logits, params, make_generator(124))
    assert torch.equal(a, b) and not torch.equal(a, c)
    gen_a, gen_b = make_generator(7), make_generator(7)
    seq_a = [select_next(row, params, gen_a) for row in logits]
    seq_b = [select_next(row, params, gen_b) for row in logits]
    assert seq_a == seq_b
    make_generator(None)  # unseeded works too


def test_sample_never_picks_zero_probability_tokens() -> None:
    gen = make_generator(8)
    for probs in (
        [0.0, 0.0, 1.0, 0.0],
        [1.0, 0.0, 0.0],
        [0.0, 0.0, 1.0],
        [0.0, 0.5, 0.0, 0.5, 0.0],
    ):
        p = torch.tensor(probs)
        draws = sample(p.expand(5000, -1), gen)
        assert (p[draws] > 0).all()
    assert sample(torch.tensor([[0.0, 2.0, 0.0, 6.0]]), gen).shape == (1,)  # unnormalised ok


def test_sample_follows_probs() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draws = sample(probs.expand(20_000, 4), make_generator(5))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[3] == 0
    assert (freq - probs).abs().sum() / 2 < 0.02


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_invalid_params(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
