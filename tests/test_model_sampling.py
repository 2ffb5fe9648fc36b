"""A model's own sampling values (its generation_config.json) as `aotgen run`'s defaults,
read as transformers reads them, against the engine given the same values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reference import MODEL_SAMPLING, model_sampling_answers, with_generation_config
from test_cli_help import aotgen

from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.model_sampling import generation_defaults
from aotgen.runtime.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPT = "the cat"
FLAGS = ["--prompt", PROMPT, "--max-new-tokens", "12", "--ignore-eos", "--json", "--threads", "1"]


@pytest.mark.parametrize(
    "config, want",
    [
        ({"temperature": 0.6, "top_k": 20, "top_p": 0.95}, {"temperature": 0.6, "top_k": 20}),
        ({"do_sample": True, "top_k": 64}, {"temperature": 1.0, "top_k": 64}),  # Gemma 3's
        ({"do_sample": False, "temperature": 0.7}, {}),  # greedy, as transformers decodes
        ({"min_p": 0.05, "repetition_penalty": 1.1}, {"min_p": 0.05, "repetition_penalty": 1.1}),
        ({"max_new_tokens": 32768, "eos_token_id": 2}, {}),  # the length stays the command's
    ],
)
def test_generation_defaults_read_the_config_as_transformers(config, want):
    defaults, refused = generation_defaults(config)
    assert refused == []
    assert {k: defaults[k] for k in want} == want and set(defaults) - set(want) <= {"top_p"}


def test_values_the_runtime_refuses_are_left_out_by_name():
    config = {
        "temperature": -1,
        "top_p": 2.0,
        "top_k": 2.5,
        "min_p": "0.1",
        "repetition_penalty": 0,
    }
    defaults, refused = generation_defaults(config)
    assert defaults == {}
    assert sorted(r.split("=")[0] for r in refused) == sorted(config)


@pytest.fixture(scope="module")
def engine(tiny_batch_package) -> Engine:
    return Engine.load(tiny_batch_package, threads=1)


def _run(package: Path, *flags: str) -> tuple[list[int], str]:
    proc = aotgen("run", str(package), *FLAGS, *flags, cwd=REPO)
    return json.loads(proc.stdout)["ids"], proc.stderr


def test_run_samples_with_the_models_values(tiny_batch_package, engine, tmp_path):
    """Every value the command line leaves out is the model's (the seeded sample at its
    temperature and top_k); one it gives wins (top_k 0: the sample over every token, under the
    model's repetition penalty); `--generation-config none` is greedy; a value the runtime
    refuses (top_p 2) is left out with a warning naming it."""
    package = with_generation_config(
        tiny_batch_package, tmp_path / "pkg", MODEL_SAMPLING | {"top_p": 2.0}
    )
    model, own_top_k, greedy = model_sampling_answers(engine, engine.tokenizer.prompt_ids(PROMPT))
    got, log = _run(package, "--seed", "5")
    assert got == model
    assert "temperature=0.8, top_k=3, repetition_penalty=1.5;" in log
    assert "generation_config.json's top_p=2.0 (top_p must be in (0, 1]" in log
    assert _run(package, "--seed", "5", "--top-k", "0")[0] == own_top_k
    assert _run(package, "--seed", "5", "--generation-config", "none")[0] == greedy


def test_do_sample_false_keeps_run_greedy(tiny_batch_package, engine, tmp_path):
    package = with_generation_config(
        tiny_batch_package, tmp_path / "pkg", {"do_sample": False, "temperature": 1.5}
    )
    ids = engine.tokenizer.prompt_ids(PROMPT)
    sampled = GenerationConfig(12, SamplingParams(temperature=1.5, seed=5), ignore_eos=True)
    greedy = engine.generate(ids, GenerationConfig(12, ignore_eos=True)).token_ids
    assert engine.generate(ids, sampled).token_ids != greedy
    got, log = _run(package, "--seed", "5")
    assert got == greedy and "model's sampling" not in log
