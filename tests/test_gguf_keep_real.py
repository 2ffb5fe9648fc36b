"""The real SmolLM2 Q4_1 GGUF kept as it is (recipes/smollm2-135m-q4_1.yaml): the same model
as the fp32 package at the file's size, answering as llama.cpp does, in both runtimes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cpp_runtime import ANSWER, FRANCE_IDS, run

from aotgen.checkpoint.gguf import find_smollm2_gguf
from aotgen.runtime.engine import Engine, GenerationConfig

PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def engine(smollm2_q4_1_package: Path) -> Engine:
    return Engine.load(smollm2_q4_1_package)


def test_weights_are_the_files_size(smollm2_q4_1_package: Path):
    manifest = json.loads((smollm2_q4_1_package / "manifest.json").read_text())
    weights = smollm2_q4_1_package / manifest["models"]["target"]["weights"]["file"]
    gguf_bytes = find_smollm2_gguf().stat().st_size
    assert weights.stat().st_size <= 1.05 * gguf_bytes
    kept = manifest["models"]["target"]["quantization"]
    assert set(kept["weights"].values()) == {"Q4_1", "Q8_0"}  # every matrix on its blocks
    assert kept["perplexity"]["package"] == pytest.approx(kept["perplexity"]["reference"], 1e-3)


def test_france_answer_in_both_runtimes(engine, smollm2_q4_1_package, run_bin):
    result = engine.generate(FRANCE_IDS, GenerationConfig(max_new_tokens=64))
    assert result.text == ANSWER  # llama.cpp's greedy answer on the same file
    got = json.loads(
        run(
            run_bin, smollm2_q4_1_package, "--chat", "What is the capital of France?", "--ids"
        ).stdout
    )
    assert got["ids"] == result.token_ids


def test_greedy_equals_the_fp32_package(engine, smollm2_package):
    """The blocks dequantize to the fp32 package's weights, and both kernels sum in the same
    order: the same tokens."""
    fp32 = Engine.load(smollm2_package)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
        assert engine.generate(ids, config).token_ids == fp32.generate(ids, config).token_ids
