"""Penalties and logit bias (runtime/rules.py): greedy decoding against a reference loop that
applies the penalties as their definitions read (test_structured.penalized) to the package's
logits; every speculative mode against plain decoding; the batch engine against requests
alone; `run` and `serve`. (Sampled decoding's exact distribution under penalties is checked
in tests/test_structured.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reference import eager_engine, reset_caches
from test_cli_help import aotgen
from test_structured import TREES, penalized

from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationError
from aotgen.runtime.rules import Penalties
from aotgen.runtime.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
STRONG = Penalties(repetition=1.5, presence=0.6, frequency=0.5)
# Three favoured tokens taken in turns as each one's count lowers it: the rows of a proposal
# must count the proposal's own tokens.
CYCLE = Penalties(frequency=1.0, logit_bias=((40, 30.0), (41, 29.5), (42, 29.0)))
N = 24


@pytest.fixture(scope="module")
def engine(tiny_batch_package) -> Engine:
    return Engine.load(tiny_batch_package, threads=1)


def _prompt(i: int) -> list[int]:
    return [5 + (i * 29 + j * 13) % 240 for j in range(8 + 2 * i)]


def _reference_greedy(engine: Engine, prompt: list[int], pen: Penalties) -> list[int]:
    out: list[int] = []
    reset_caches(engine.target)
    while len(out) < N:
        out.append(
            int(penalized(engine.target.forward(prompt + out, 0), prompt, out, pen).argmax())
        )
    return out


@pytest.mark.parametrize("mode", [None, "ngram", "draft", "draft+ngram"])
def test_greedy_with_penalties_equals_the_reference(engine, mode):
    changed = 0
    for i in range(3):
        free = engine.generate(_prompt(i), GenerationConfig(max_new_tokens=N, ignore_eos=True))
        for pen in (
            STRONG,
            Penalties(repetition=0.8, frequency=-0.3),
            Penalties(presence=1.2),
            CYCLE,
        ):
            config = GenerationConfig(
                max_new_tokens=N,
                ignore_eos=True,
                penalties=pen,
                speculative=mode,
                reuse_prefix=False,
            )
            got = engine.generate(_prompt(i), config)
            assert got.token_ids == _reference_greedy(engine, _prompt(i), pen), (i, pen)
            changed += got.token_ids != free.token_ids
    assert changed >= 3  # the penalties changed answers: the test compares something


def test_logit_bias_forces_and_bans_tokens(engine):
    config = GenerationConfig(
        max_new_tokens=6, ignore_eos=True, penalties=Penalties(logit_bias=((77, 100.0),))
    )
    assert engine.generate(_prompt(1), config).token_ids == [77] * 6
    free = engine.generate(_prompt(1), GenerationConfig(max_new_tokens=N, ignore_eos=True))
    banned = tuple((t, -100.0) for t in set(free.token_ids))
    config = GenerationConfig(
        max_new_tokens=N,
        ignore_eos=True,
        speculative="ngram",
        penalties=Penalties(logit_bias=banned),
    )
    assert not set(engine.generate(_prompt(1), config).token_ids) & set(free.token_ids)


@pytest.mark.parametrize("tree", TREES, ids=["p-split", "best-first"])
def test_tree_speculation_with_penalties_equals_plain(tiny_checkpoint, tree):
    eager = eager_engine(tiny_checkpoint, tiny_checkpoint, 160, 6, tree_nodes=12)
    for i in range(2):
        config = GenerationConfig(max_new_tokens=N, ignore_eos=True, penalties=STRONG)
        plain = eager.generate(_prompt(i), config)
        config.speculative, config.tree = "draft", tree
        spec = eager.generate(_prompt(i), config)
        assert spec.token_ids == plain.token_ids and spec.spec.tree_nodes > 0


def test_the_batch_engine_applies_each_requests_own(tiny_batch_package, engine):
    batch = BatchEngine.load(tiny_batch_package, threads=1)
    configs = [
        GenerationConfig(
            max_new_tokens=N,
            ignore_eos=True,
            penalties=[STRONG, None, Penalties(repetition=1.2, presence=-0.5)][i % 3],
            speculative=[None, "ngram", "draft"][i // 2 % 3],
            sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i),
        )
        for i in range(6)
    ]
    prompts = [_prompt(i) for i in range(6)]
    for prompt, config, got in zip(
        prompts, configs, batch.generate_many(prompts, configs), strict=True
    ):
        assert got.token_ids == engine.generate(prompt, config).token_ids


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"repetition": 0.0}, "repetition penalty must be > 0"),
        ({"presence": 2.5}, "presence penalty"),
        ({"frequency": float("nan")}, "frequency penalty"),
        ({"logit_bias": ((3, 101.0),)}, "logit bias"),
    ],
)
def test_bad_penalties_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Penalties(**kwargs)


def test_a_bias_outside_the_vocabulary_is_refused(engine):
    config = GenerationConfig(max_new_tokens=2, penalties=Penalties(logit_bias=((10**6, 1.0),)))
    with pytest.raises(GenerationError, match="outside"):
        engine.generate([5, 6], config)


def test_run_takes_the_penalties_and_min_p(tiny_batch_package, engine):
    flags = "--max-new-tokens 12 --ignore-eos --json --threads 1".split()
    flags += "--repetition-penalty 1.5 --presence-penalty 0.6 --frequency-penalty 0.5".split()
    flags += "--temperature 1.2 --min-p 0.2 --seed 5".split()
    proc = aotgen("run", str(tiny_batch_package), "--prompt", "the cat", *flags, cwd=REPO)
    ids = engine.tokenizer.prompt_ids("the cat")
    sampling = SamplingParams(temperature=1.2, min_p=0.2, seed=5)
    config = GenerationConfig(12, sampling, ignore_eos=True, penalties=STRONG)
    assert json.loads(proc.stdout)["ids"] == engine.generate(ids, config).token_ids
