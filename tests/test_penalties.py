"""Penalties, logit bias and min_tokens (runtime/rules.py): greedy decoding against a reference
loop that applies them as their definitions read (test_structured.penalized) to the package's
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
from aotgen.runtime.grammar import Grammar
from aotgen.runtime.rules import Penalties
from aotgen.runtime.sampling import SamplingParams
from aotgen.runtime.tokenizer import StreamDecoder

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


def _reference_min_tokens(
    engine: Engine, prompt: list[int], ends: set[int], min_tokens: int, bias: Penalties
) -> list[int]:
    """Greedy over the package's logits (with `bias`), the ending tokens at -inf while the
    answer is shorter than min_tokens; the answer stops before the first ending token."""
    out: list[int] = []
    reset_caches(engine.target)
    while len(out) < N:
        row = penalized(engine.target.forward(prompt + out, 0), prompt, out, bias)
        if len(out) < min_tokens:
            row[list(ends)] = -float("inf")
        tok = int(row.argmax())
        if tok in ends:
            break
        out.append(tok)
    return out


MODES = [None, "ngram", "draft", "draft+ngram"]


@pytest.mark.parametrize("mode", MODES)
def test_min_tokens_holds_eos_and_stop_tokens_off(engine, mode):
    """vLLM's min_tokens: eos (here favoured by a bias at every step) and stop token ids cannot
    end the answer before it has min_tokens tokens; after that they end it as usual."""
    eos = min(engine.tokenizer.eos_ids)
    favour_eos = Penalties(logit_bias=((eos, 100.0),))
    for i, min_tokens in enumerate((1, 5, N)):
        config = GenerationConfig(
            N, penalties=favour_eos, min_tokens=min_tokens, speculative=mode, reuse_prefix=False
        )
        got = engine.generate(_prompt(i), config)
        assert got.token_ids == _reference_min_tokens(
            engine, _prompt(i), engine.tokenizer.eos_ids, min_tokens, favour_eos
        )
        assert len(got.token_ids) == min_tokens
        assert got.finish_reason == ("eos" if min_tokens < N else "length")
    free = engine.generate(_prompt(1), GenerationConfig(N, ignore_eos=True)).token_ids
    stop = free[2]
    config = GenerationConfig(
        N, ignore_eos=True, stop_token_ids=(stop,), min_tokens=8, speculative=mode
    )
    got = engine.generate(_prompt(1), config)
    assert got.token_ids == _reference_min_tokens(engine, _prompt(1), {stop}, 8, Penalties())
    assert stop not in got.token_ids[:8] and len(got.token_ids) >= 8


@pytest.mark.parametrize("tree", TREES, ids=["p-split", "best-first"])
def test_tree_speculation_with_min_tokens_equals_plain(tiny_checkpoint, tree):
    eager = eager_engine(tiny_checkpoint, tiny_checkpoint, 160, 6, tree_nodes=12)
    eos = min(eager.tokenizer.eos_ids)
    config = GenerationConfig(N, penalties=Penalties(logit_bias=((eos, 100.0),)), min_tokens=9)
    plain = eager.generate(_prompt(0), config)
    config.speculative, config.tree = "draft", tree
    spec = eager.generate(_prompt(0), config)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 9


def test_stop_strings_count_from_the_min_tokens_text_on(engine):
    """As in vLLM: a stop string that ends within the first min_tokens tokens' text does not
    stop the answer; the first one ending after it does."""
    config = GenerationConfig(N, ignore_eos=True)
    free = engine.generate(_prompt(2), config)
    min_tokens = 6
    stream = StreamDecoder(engine.tokenizer)  # the text as streamed: partial bytes held back
    armed = len("".join(stream.put(t) for t in free.token_ids[:min_tokens]))
    early = free.text[:armed]
    stop = next(c for c in early if c.isalpha() and free.text.find(c, armed) >= 0)
    config = GenerationConfig(N, ignore_eos=True, stop=(stop,), min_tokens=min_tokens)
    got = engine.generate(_prompt(2), config)
    assert got.finish_reason == "stop" and got.text == free.text[: free.text.find(stop, armed)]
    config.min_tokens = 0
    assert engine.generate(_prompt(2), config).text == free.text[: free.text.find(stop)]


def test_a_complete_grammar_still_ends_the_answer(engine):
    """Where the grammar allows nothing but eos, min_tokens does not hold it off."""
    config = GenerationConfig(N, grammar=Grammar("regex", "ab"), min_tokens=N)
    got = engine.generate(_prompt(0), config)
    assert got.text == "ab" and got.finish_reason == "eos"


def test_the_batch_engine_holds_each_requests_own_end_off(tiny_batch_package, engine):
    batch = BatchEngine.load(tiny_batch_package, threads=1)
    eos = min(engine.tokenizer.eos_ids)
    configs = [
        GenerationConfig(
            N,
            penalties=Penalties(logit_bias=((eos, 100.0),)),
            min_tokens=2 + 3 * i,
            speculative=MODES[i % 4],
            sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i),
        )
        for i in range(6)
    ]
    prompts = [_prompt(i) for i in range(6)]
    for prompt, config, got in zip(
        prompts, configs, batch.generate_many(prompts, configs), strict=True
    ):
        assert len(got.token_ids) == config.min_tokens
        assert got.token_ids == engine.generate(prompt, config).token_ids


@pytest.mark.parametrize("min_tokens", [-1, N + 1, 2.5, True])
def test_bad_min_tokens_are_refused(engine, min_tokens):
    with pytest.raises(GenerationError, match="min_tokens must be a whole number in 0..max_new"):
        engine.generate([5, 6], GenerationConfig(N, min_tokens=min_tokens))
