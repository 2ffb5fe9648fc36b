"""Log-probabilities of generated tokens (runtime/logprobs.py): every token's logprob and top
alternatives against the eager model's log-softmax over the same sequence, whatever picked the
token (greedy, sampling, a grammar, n-gram, draft or tree speculation, the batch engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import EagerModel, eager_engine
from test_cli_help import aotgen

from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationError
from aotgen.runtime.sampling import SamplingParams
from aotgen.runtime.tree_draft import TreeParams

REPO = Path(__file__).resolve().parents[1]
TOP = 4


@pytest.fixture(scope="module")
def engine(tiny_batch_package) -> Engine:
    return Engine.load(tiny_batch_package, threads=1)


@pytest.fixture(scope="module")
def eager(tiny_checkpoint) -> EagerModel:
    return EagerModel(tiny_checkpoint, 256)


def _prompt(i: int) -> list[int]:
    return [5 + (i * 31 + j * 7) % 250 for j in range(6 + 3 * i)]


def _check(result, prompt: list[int], eager: EagerModel, top: int = TOP) -> None:
    """Each token's logprob and alternatives equal the eager model's over prompt + answer."""
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    eager.reset()
    seq = prompt + result.token_ids
    want = eager.forward(seq, 0)[len(prompt) - 1 : len(seq) - 1].float().log_softmax(-1)
    for i, (lp, tok) in enumerate(zip(result.logprobs, result.token_ids, strict=True)):
        assert lp.token == tok
        assert lp.logprob == pytest.approx(float(want[i, tok]), abs=1e-4)
        ids = [t for t, _ in lp.top]
        assert len(ids) == top
        torch.testing.assert_close(
            torch.tensor([v for _, v in lp.top]), want[i, ids], rtol=0, atol=1e-4
        )
        assert ids[0] == int(want[i].argmax())


def _repeating_prompt(engine: Engine, i: int) -> list[int]:
    """A prompt whose continuation it already holds, so n-gram lookup finds proposals."""
    seen = engine.generate(_prompt(i), GenerationConfig(max_new_tokens=12, ignore_eos=True))
    return _prompt(i) + seen.token_ids + _prompt(i)


@pytest.mark.parametrize("mode", [None, "ngram", "draft", "draft+ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_the_eager_models(engine, eager, mode, temperature):
    for i in range(2):
        prompt = _repeating_prompt(engine, i)
        sampling = SamplingParams(temperature=temperature, seed=i)
        config = GenerationConfig(
            max_new_tokens=24, sampling=sampling, speculative=mode, logprobs=TOP
        )
        result = engine.generate(prompt, config)
        _check(result, prompt, eager)
        if mode is not None and temperature == 0:
            assert result.spec.accepted > 0  # some tokens came from verify rows


def test_logprobs_under_a_grammar_are_the_models_own(engine, eager):
    """A grammar changes which token is picked, not the reported distribution."""
    pytest.importorskip("llguidance")
    from aotgen.runtime.grammar import Grammar

    config = GenerationConfig(
        max_new_tokens=30,
        grammar=Grammar("regex", "[a-z ]{4,20}"),
        logprobs=TOP,
        speculative="ngram",
    )
    result = engine.generate(_prompt(1), config)
    _check(result, _prompt(1), eager)


def test_tree_speculation_reports_the_accepted_paths_rows(tiny_checkpoint, eager):
    tree_engine = eager_engine(tiny_checkpoint, tiny_checkpoint, 160, 6, tree_nodes=12)
    config = GenerationConfig(
        max_new_tokens=20, speculative="draft", logprobs=2, tree=TreeParams(3, 0.05, False)
    )
    result = tree_engine.generate(_prompt(0), config)
    assert result.spec.tree_nodes > 0
    _check(result, _prompt(0), eager, top=2)


def test_logprobs_end_with_the_answer_and_zero_lists_none(engine):
    """eos and stop strings cut the logprobs where they cut the ids; logprobs=0 gives each
    token's own with no alternatives; without logprobs there are none."""
    prompt = _prompt(2)
    free = engine.generate(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True))
    stop = engine.tokenizer.decode(free.token_ids[3:5])
    result = engine.generate(
        prompt, GenerationConfig(max_new_tokens=12, stop=(stop,), logprobs=0, speculative="ngram")
    )
    assert len(result.logprobs) == len(result.token_ids) and all(
        not lp.top for lp in result.logprobs
    )
    assert free.logprobs is None


def _check_prompt(scored, prompt: list[int], eager: EagerModel, top: int) -> None:
    """Prompt token i's logprob (i >= 1) and alternatives equal the eager model's row i - 1."""
    assert scored[0] is None and len(scored) == len(prompt)
    eager.reset()
    want = eager.forward(prompt, 0).float().log_softmax(-1)
    for i in range(1, len(prompt)):
        assert scored[i].token == prompt[i]
        assert scored[i].logprob == pytest.approx(float(want[i - 1, prompt[i]]), abs=1e-4)
        assert [t for t, _ in scored[i].top] == want[i - 1].topk(top).indices.tolist()


@pytest.mark.parametrize("max_new_tokens", [0, 6])
def test_prompt_logprobs_equal_the_eager_models(engine, eager, max_new_tokens):
    """Every prompt token scored (the whole prompt runs again, though the cache holds it);
    max_new_tokens 0 scores without generating."""
    prompt = _prompt(3) * 3  # 45 tokens: several verify-graph chunks
    engine.generate(prompt, GenerationConfig(max_new_tokens=2))  # now in the cache
    config = GenerationConfig(max_new_tokens=max_new_tokens, prompt_logprobs=3, logprobs=1)
    result = engine.generate(prompt, config)
    assert result.cached_tokens == 0 and len(result.token_ids) == max_new_tokens
    assert result.finish_reason == "length"
    _check_prompt(result.prompt_logprobs, prompt, eager, 3)
    if max_new_tokens:
        _check(result, prompt, eager, top=1)


@pytest.fixture(scope="module")
def score_engine(tiny_checkpoint, project, tmp_path_factory) -> Engine:
    """The tiny recipe with a score graph (prefill chunk 16, every row's logits)."""
    from conftest import TINY_RECIPE

    from aotgen.package.build import build
    from aotgen.recipe import parse_recipe

    data = {"checkpoint": str(tiny_checkpoint), **TINY_RECIPE, "score_graph": True}
    recipe = parse_recipe(data, "tiny-score", tmp_path_factory.mktemp("score"))
    return Engine.load(build(recipe, project).path, threads=1)


@pytest.mark.parametrize(("length", "score_calls"), [(3, []), (45, [16, 16, 13])])
def test_the_score_graph_scores_prompts_as_the_eager_model(
    score_engine, eager, monkeypatch, length, score_calls
):
    """With a score graph, every row's logits come from it in prefill-sized chunks (a tail
    shorter than the verify graph goes through that): the eager model's logprobs."""
    graphs = score_engine.target.graphs
    calls, graph = [], graphs["score"]
    monkeypatch.setitem(
        graphs,
        "score",
        lambda tokens, *a, **kw: calls.append(tokens.shape[1]) or graph(tokens, *a, **kw),
    )
    prompt = (_prompt(3) * 3)[:length]
    result = score_engine.generate(prompt, GenerationConfig(max_new_tokens=0, prompt_logprobs=3))
    _check_prompt(result.prompt_logprobs, prompt, eager, 3)
    assert calls == score_calls


def test_the_batch_engine_scores_prompts_in_chunks(tiny_batch_package, engine, eager):
    """Prompts prefilled in chunks of 7 beside decoding requests: each prompt's logprobs are
    the eager model's, as alone."""
    batch = BatchEngine(Engine.load(tiny_batch_package, threads=1, slots=0), prefill_step=7)
    prompts = [_prompt(i) * 2 for i in range(4)]
    configs = [
        GenerationConfig(max_new_tokens=[0, 5, 9, 3][i], prompt_logprobs=i % 3 if i else 2)
        for i in range(4)
    ]
    results = batch.generate_many(prompts, configs)
    for prompt, config, got in zip(prompts, configs, results, strict=True):
        _check_prompt(got.prompt_logprobs, prompt, eager, config.prompt_logprobs)
        assert got.token_ids == engine.generate(prompt, config).token_ids


@pytest.mark.parametrize("bad", [-1, 21, 2.5, "3"])
def test_bad_logprobs_are_refused(engine, bad):
    with pytest.raises(GenerationError, match="logprobs must be"):
        engine.generate([5, 6], GenerationConfig(max_new_tokens=4, logprobs=bad))
    with pytest.raises(GenerationError, match="prompt_logprobs must be"):
        engine.generate([5, 6], GenerationConfig(max_new_tokens=4, prompt_logprobs=bad))
    with pytest.raises(GenerationError, match="max_new_tokens must be a whole number >= 1"):
        engine.generate([5, 6], GenerationConfig(max_new_tokens=0, logprobs=2))


def test_the_batch_engine_reports_what_requests_alone_do(tiny_batch_package, engine):
    batch = BatchEngine.load(tiny_batch_package, threads=1)
    configs = [
        GenerationConfig(
            max_new_tokens=10 + i,
            logprobs=i % 3,
            speculative=[None, "ngram", "draft"][i % 3],
            sampling=SamplingParams(temperature=0.7 * (i % 2), seed=i),
        )
        for i in range(6)
    ]
    prompts = [_prompt(i) for i in range(6)]
    for prompt, config, got in zip(
        prompts, configs, batch.generate_many(prompts, configs), strict=True
    ):
        want = engine.generate(prompt, config)
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_run_json_prints_logprobs(tiny_batch_package, engine):
    flags = "--max-new-tokens 5 --ignore-eos --json --logprobs 2 --threads 1".split()
    proc = aotgen("run", str(tiny_batch_package), "--prompt", "the cat", *flags, cwd=REPO)
    printed = json.loads(proc.stdout)
    want = engine.generate(
        engine.tokenizer.prompt_ids("the cat"),
        GenerationConfig(max_new_tokens=5, ignore_eos=True, logprobs=2),
    )
    assert [p["id"] for p in printed["logprobs"]] == want.token_ids
    assert [p["logprob"] for p in printed["logprobs"]] == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=1e-5
    )
