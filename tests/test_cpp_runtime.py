"""The C++ runtime (runtime/cpp: aotgen_runtime, aotgen-run) against the Python runtime.

Builds `aotgen-run` once per session (tests/cpp_build.py; skipped when cmake, a compiler or
torch's CMake config is missing) and runs it on the tiny package: greedy ids equal the
Python runtime's, speculative decoding (n-gram and a draft model) equals plain decoding,
seeded sampling is reproducible (and, because the C++ side uses the same ATen ops and torch
generator, equal to Python's), and bad input gives one clear message and exit status 1. The
real SmolLM2 package is checked when artifacts/smollm2-135m exists (or when a
`smollm2_package` fixture is shared through conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cpp_build import REPO_ROOT
from reference import (
    MODEL_SAMPLING,
    check_conversation,
    model_sampling_answers,
    r1_thinking_template,
    with_chat_template,
    with_generation_config,
)

from aotgen.package.manifest import PackageError
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.harmony import head_of, split_harmony
from aotgen.runtime.lookup_cache import LookupCache
from aotgen.runtime.reasoning import split_reasoning, thinking_of
from aotgen.runtime.rules import Penalties
from aotgen.runtime.sampling import SamplingParams

pytestmark = pytest.mark.cpp

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France. Berlin is the capital of",
    "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5",
    # Longer than two prefill chunks (16 tokens in the tiny recipe) plus a remainder.
    "Speculative decoding drafts tokens and verifies them in one pass. Ahead-of-time "
    "compilation turns a checkpoint into a package. The quick brown fox jumps over",
]
N_TOKENS = 32
REAL_PACKAGE = REPO_ROOT / "artifacts" / "smollm2-135m"
FRANCE_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
ANSWER = "The capital of France is Paris."


def run(binary: Path, package: Path, *args: str, check: bool = True):
    proc = subprocess.run(
        [str(binary), str(package), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check:
        assert proc.returncode == 0, f"aotgen-run {args} failed ({proc.returncode}): {proc.stderr}"
    return proc


def cpp_generate(binary: Path, package: Path, ids: list[int], *args: str) -> dict:
    proc = run(binary, package, "--prompt-ids", json.dumps(ids), "--ids", *args)
    return json.loads(proc.stdout)


def sampling_args(params: SamplingParams) -> list[str]:
    args = ["--temperature", repr(params.temperature), "--top-k", str(params.top_k)]
    args += ["--top-p", repr(params.top_p), "--min-p", repr(params.min_p)]
    return args + (["--seed", str(params.seed)] if params.seed is not None else [])


@pytest.fixture(scope="module")
def py_engine(tiny_package: Path) -> Engine:
    return Engine.load(tiny_package)


BLOCK_DRAFT = {  # the spec recipe's kind of draft: C++ kernels compiled into the package
    "quantize": {
        "linear": {"int4": {"groupsize": 32}},
        "overrides": {"lm_head": "int8"},
        "activations": "int8",
    }
}


@pytest.fixture(scope="module", params=["shared-kv", "own-kv", "block"])
def draft_package(request, tiny_checkpoint: Path, project) -> Path:
    """The tiny model with a 1-layer draft made from its own first layer, running on the
    target's KV cache or on its own, or the whole model with int4 x int8 block kernels on
    the target's cache (~1-2 min build each)."""
    from aotgen.package.build import build
    from aotgen.recipe import parse_recipe

    draft = BLOCK_DRAFT if request.param == "block" else {"layers": 1}
    share_kv = request.param != "own-kv"
    recipe = parse_recipe(
        {
            "checkpoint": str(tiny_checkpoint),
            "max_seq_len": 160,
            "prefill_chunk": 16,
            "speculative": {"draft": draft, "k": 4, "share_kv": share_kv},
        },
        f"tiny-draft-{request.param}",
        Path("."),
    )
    return build(recipe, project).path


def test_greedy_ids_match_python(run_bin, tiny_package, py_engine):
    lengths = []
    for prompt in PROMPTS:
        ids = py_engine.tokenizer.encode(prompt)
        lengths.append(len(ids))
        ref = py_engine.generate(ids, GenerationConfig(max_new_tokens=N_TOKENS, ignore_eos=True))
        got = cpp_generate(
            run_bin, tiny_package, ids, "--max-new-tokens", str(N_TOKENS), "--ignore-eos"
        )
        assert got["prompt_ids"] == ids
        assert got["ids"] == ref.token_ids, prompt
        assert got["text"] == ref.text
        assert got["finish_reason"] == "length"
    assert max(lengths) > 2 * 16, lengths  # chunked prefill: 16 + 16 + remainder


def test_text_prompt_and_streaming_match_python(run_bin, tiny_package, py_engine):
    """--prompt encodes with the C++ tokenizer; the streamed stdout is the generated text."""
    prompt = PROMPTS[1]
    ref = py_engine.generate(
        py_engine.tokenizer.encode(prompt), GenerationConfig(max_new_tokens=20, ignore_eos=True)
    )
    proc = run(run_bin, tiny_package, "--prompt", prompt, "--max-new-tokens", "20", "--ignore-eos")
    assert proc.stdout == ref.text + "\n"
    assert "load-to-first-token" in proc.stderr and "tok/s" in proc.stderr


def test_eos_and_stop_strings_match_python(run_bin, tiny_package, py_engine):
    ids = py_engine.tokenizer.encode(PROMPTS[0])
    plain = py_engine.generate(ids, GenerationConfig(max_new_tokens=60))
    got = cpp_generate(run_bin, tiny_package, ids, "--max-new-tokens", "60")
    assert (got["ids"], got["finish_reason"]) == (plain.token_ids, plain.finish_reason)
    assert got["stop_reason"] is None
    # A stop string taken from the middle of the greedy text.
    full = py_engine.generate(ids, GenerationConfig(max_new_tokens=40, ignore_eos=True)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True, stop=(stop,))
    ref = py_engine.generate(ids, cfg)
    got = cpp_generate(
        run_bin, tiny_package, ids, "--max-new-tokens", "40", "--ignore-eos", "--stop", stop
    )
    assert (ref.finish_reason, ref.stop_reason) == ("stop", stop)
    assert (got["ids"], got["text"], got["finish_reason"]) == (ref.token_ids, ref.text, "stop")
    assert got["stop_reason"] == stop  # the stop string that ended it


def test_ngram_speculative_greedy_equals_plain(run_bin, tiny_package, py_engine):
    drafted = 0
    for prompt in PROMPTS:
        ids = py_engine.tokenizer.encode(prompt)
        common = ["--max-new-tokens", str(N_TOKENS), "--ignore-eos"]
        plain = cpp_generate(run_bin, tiny_package, ids, *common)
        for k in ("1", "4"):
            spec = cpp_generate(run_bin, tiny_package, ids, *common, "--lookup", "ngram", "--k", k)
            assert spec["ids"] == plain["ids"], (prompt, k)
            assert spec["spec"]["accepted"] <= spec["spec"]["drafted"]
            drafted += spec["spec"]["drafted"]
        ref = py_engine.generate(
            ids, GenerationConfig(max_new_tokens=N_TOKENS, ignore_eos=True, speculative="ngram")
        )
        adaptive = cpp_generate(
            run_bin, tiny_package, ids, *common, "--lookup", "ngram", "--adaptive-k"
        )
        assert adaptive["ids"] == plain["ids"]
        assert spec["spec"]["drafted"] == ref.spec.drafted
        assert spec["spec"]["accepted"] == ref.spec.accepted
    assert drafted > 0, "nothing was drafted: the test would be vacuous"


def test_ngram_match_bounds_reach_the_proposer(run_bin, tiny_package, py_engine):
    """--ngram-min / --ngram-max: ids and stats equal Python's for the same bounds, the
    bounds change what is drafted (so they are read), and an empty range is an error."""
    ids = py_engine.tokenizer.encode(PROMPTS[0])
    common = ["--max-new-tokens", str(N_TOKENS), "--ignore-eos", "--lookup", "ngram"]
    drafted = set()
    for lo, hi in ((1, 4), (2, 3), (1, 1)):  # (1, 1): only 1-grams, which need 2 occurrences
        got = cpp_generate(
            run_bin, tiny_package, ids, *common, "--ngram-min", str(lo), "--ngram-max", str(hi)
        )
        ref = py_engine.generate(
            ids,
            GenerationConfig(
                max_new_tokens=N_TOKENS,
                ignore_eos=True,
                speculative="ngram",
                ngram_min=lo,
                ngram_max=hi,
            ),
        )
        assert got["ids"] == ref.token_ids
        assert (got["spec"]["drafted"], got["spec"]["accepted"]) == (
            ref.spec.drafted,
            ref.spec.accepted,
        )
        drafted.add(ref.spec.drafted)
    assert len(drafted) > 1, drafted
    proc = run(run_bin, tiny_package, "--prompt", "hi", *common, "--ngram-min", "5", check=False)
    assert proc.returncode != 0 and "--ngram-min (5) must be <= --ngram-max" in proc.stderr


def test_lookup_cache_equals_pythons(run_bin, tiny_package, py_engine, tmp_path):
    """--lookup-cache across runs: each run's ids and drafted / accepted counts equal Python's
    engine holding the same cache, both write the same file byte for byte, and a repeated
    prompt is drafted from what the earlier runs taught. A damaged file and a cache without
    lookup are refused in one line."""
    common = ["--max-new-tokens", str(N_TOKENS), "--ignore-eos", "--lookup", "ngram"]
    cfg = GenerationConfig(max_new_tokens=N_TOKENS, ignore_eos=True, speculative="ngram")
    cpp_file = tmp_path / "cpp.bin"
    py_engine.lookup_cache = LookupCache()
    try:
        accepted = []
        for prompt in PROMPTS[:2] * 3:
            ids = py_engine.tokenizer.encode(prompt)
            got = cpp_generate(run_bin, tiny_package, ids, *common, "--lookup-cache", str(cpp_file))
            ref = py_engine.generate(ids, cfg)
            assert got["ids"] == ref.token_ids
            assert (got["spec"]["drafted"], got["spec"]["accepted"]) == (
                ref.spec.drafted,
                ref.spec.accepted,
            )
            accepted.append(ref.spec.accepted)
        py_engine.lookup_cache.save(tmp_path / "py.bin")
    finally:
        py_engine.lookup_cache = None
    assert cpp_file.read_bytes() == (tmp_path / "py.bin").read_bytes()
    assert accepted[4] > accepted[0] and accepted[5] > accepted[1], accepted
    (tmp_path / "bad.bin").write_bytes(b"\x01\x00")
    proc = run(
        run_bin,
        tiny_package,
        "--prompt",
        "hi",
        *common,
        "--lookup-cache",
        str(tmp_path / "bad.bin"),
        check=False,
    )
    assert_fails(proc, "the file ends inside an n-gram at byte 0")
    proc = run(
        run_bin, tiny_package, "--prompt", "hi", "--lookup-cache", str(cpp_file), check=False
    )
    assert_fails(proc, "--lookup-cache holds what --lookup ngram drafts from")


def test_seeded_sampling_is_reproducible(run_bin, tiny_package, py_engine):
    ids = py_engine.tokenizer.encode(PROMPTS[1])
    common = ["--max-new-tokens", str(N_TOKENS), "--ignore-eos", "--temperature", "1.0"]
    first = cpp_generate(run_bin, tiny_package, ids, *common, "--seed", "1")["ids"]
    again = cpp_generate(run_bin, tiny_package, ids, *common, "--seed", "1")["ids"]
    other = cpp_generate(run_bin, tiny_package, ids, *common, "--seed", "2")["ids"]
    greedy = cpp_generate(
        run_bin, tiny_package, ids, "--max-new-tokens", str(N_TOKENS), "--ignore-eos"
    )["ids"]
    assert first == again
    assert first != other
    assert first != greedy


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(temperature=1.0, top_k=20, seed=11),
        SamplingParams(temperature=1.2, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.8, seed=0),
        SamplingParams(temperature=1.5, top_p=0.95, min_p=0.1, seed=2),
    ],
)
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_seeded_sampling_matches_python(run_bin, tiny_package, py_engine, params, speculative):
    """Same ops, same torch CPU generator: the same seed draws the same tokens as Python."""
    ids = py_engine.tokenizer.encode(PROMPTS[2])
    cfg = GenerationConfig(
        max_new_tokens=N_TOKENS, ignore_eos=True, sampling=params, speculative=speculative
    )
    ref = py_engine.generate(ids, cfg)
    extra = ["--lookup", "ngram"] if speculative else []
    got = cpp_generate(
        run_bin,
        tiny_package,
        ids,
        "--max-new-tokens",
        str(N_TOKENS),
        "--ignore-eos",
        *sampling_args(params),
        *extra,
    )
    assert got["ids"] == ref.token_ids


@pytest.mark.parametrize(
    "mode, flags",
    [("draft", ["--speculative"]), ("draft+ngram", ["--speculative", "--lookup", "ngram"])],
)
def test_draft_model_speculation(run_bin, draft_package, mode, flags):
    """Draft-model speculation (alone, or behind n-gram lookup), on the target's KV cache or
    its own: greedy equals plain greedy; greedy and sampled ids equal Python's (same
    draft-cache catch-up, same verification rule, same random numbers)."""
    engine = Engine.load(draft_package)
    assert engine.draft is not None
    shared = engine.manifest["models"]["draft"]["kv_cache"].get("shared_with") == "target"
    assert shared == engine.draft.shares_cache == (draft_package.name != "tiny-draft-own-kv")
    drafted = lookup_steps = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        common = ["--max-new-tokens", str(N_TOKENS), "--ignore-eos"]
        plain = cpp_generate(run_bin, draft_package, ids, *common)
        for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=7)):
            cfg = GenerationConfig(
                max_new_tokens=N_TOKENS, ignore_eos=True, sampling=params, speculative=mode
            )
            ref = engine.generate(ids, cfg)
            got = cpp_generate(run_bin, draft_package, ids, *common, *sampling_args(params), *flags)
            assert got["ids"] == ref.token_ids, (prompt, params)
            assert got["spec"]["drafted"] == ref.spec.drafted
            assert got["spec"]["accepted"] == ref.spec.accepted
            assert got["spec"]["lookup_steps"] == ref.spec.lookup_steps
            if params.greedy:
                assert got["ids"] == plain["ids"], prompt
            drafted += got["spec"]["drafted"]
            lookup_steps += got["spec"]["lookup_steps"]
    assert drafted > 0
    # draft+ngram: lookup proposed in some steps (and the draft in the rest).
    assert (lookup_steps > 0) == (mode == "draft+ngram")


# Repetition, presence and frequency penalties, as `aotgen-run` flags and as Python's.
PENALTIES = Penalties(repetition=1.4, presence=0.5, frequency=0.4)
PENALTY_FLAGS = ["--repetition-penalty", "1.4", "--presence-penalty", "0.5"]
PENALTY_FLAGS += ["--frequency-penalty", "0.4"]


@pytest.mark.parametrize(
    "mode, flags",
    [
        (None, []),
        ("ngram", ["--lookup", "ngram"]),
        ("draft+ngram", ["--speculative", "--lookup", "ngram"]),
    ],
)
def test_penalties_equal_pythons(run_bin, draft_package, mode, flags):
    """Penalties: greedy and sampled ids and counts equal Python's, plain, n-gram and drafted
    (the draft drafts under them and rolls back; each verify row takes them as they stand
    after the proposal tokens before it), on a draft with the target's cache and its own."""
    engine = Engine.load(draft_package)
    changed = 0
    for prompt in PROMPTS[:2]:
        ids = engine.tokenizer.encode(prompt)
        common = ["--max-new-tokens", str(N_TOKENS), "--ignore-eos", *PENALTY_FLAGS]
        for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=7)):
            cfg = GenerationConfig(
                N_TOKENS, params, ignore_eos=True, speculative=mode, penalties=PENALTIES
            )
            ref = engine.generate(ids, cfg)
            got = cpp_generate(run_bin, draft_package, ids, *common, *sampling_args(params), *flags)
            assert got["ids"] == ref.token_ids, (prompt, params)
            if mode is not None:
                assert got["spec"]["accepted"] == ref.spec.accepted
            changed += ref.token_ids != engine.generate(ids, replace(cfg, penalties=None)).token_ids
    assert changed


def test_min_tokens_and_stop_token_ids_equal_pythons(run_bin, tiny_package, py_engine):
    """`--stop-token-id` ends the answer as at eos, and `--min-tokens` holds it off: ids and
    finish reason equal Python's, plain and n-gram (each verify row holds the end off as the
    answer stands after the tokens before it). (aotgen-batch: test_cpp_batch.py, with eos.)"""
    ids = py_engine.tokenizer.encode(PROMPTS[2])
    free = py_engine.generate(ids, GenerationConfig(N_TOKENS, ignore_eos=True)).token_ids
    stop = free[3]
    common = ["--max-new-tokens", str(N_TOKENS), "--ignore-eos", "--stop-token-id", str(stop)]
    for min_tokens in (0, 6):
        for mode, mode_flags in ((None, []), ("ngram", ["--lookup", "ngram"])):
            config = GenerationConfig(
                N_TOKENS, ignore_eos=True, stop_token_ids=(stop,), min_tokens=min_tokens
            )
            ref = py_engine.generate(ids, replace(config, speculative=mode))
            args = [*common, "--min-tokens", str(min_tokens), *mode_flags]
            got = cpp_generate(run_bin, tiny_package, ids, *args)
            assert (got["ids"], got["finish_reason"]) == (ref.token_ids, ref.finish_reason)
            stopped = ref.finish_reason == "stop"
            assert got["stop_reason"] == ref.stop_reason == (stop if stopped else None)
        if min_tokens:
            assert len(ref.token_ids) >= 6 and stop not in ref.token_ids[:6]
        else:
            assert (ref.token_ids, ref.finish_reason) == (free[: free.index(stop)], "stop")


@pytest.mark.parametrize(
    "flags", [[], ["--lookup", "ngram"], ["--temperature", "0.8", "--seed", "3"]]
)
def test_logprobs_equal_pythons(run_bin, tiny_package, py_engine, flags):
    """`--json --logprobs 3`: each token's logprob and alternatives equal Python's (plain,
    n-gram verify rows, sampled)."""
    ids = py_engine.tokenizer.encode(PROMPTS[1])
    got = cpp_generate(
        run_bin,
        tiny_package,
        ids,
        "--max-new-tokens",
        "20",
        "--ignore-eos",
        "--logprobs",
        "3",
        *flags,
    )
    params = SamplingParams(temperature=0.8, seed=3) if "--seed" in flags else SamplingParams()
    ref = py_engine.generate(
        ids,
        GenerationConfig(
            max_new_tokens=20,
            ignore_eos=True,
            sampling=params,
            logprobs=3,
            speculative="ngram" if "--lookup" in flags else None,
        ),
    )
    assert got["ids"] == ref.token_ids
    assert [x["id"] for x in got["logprobs"]] == ref.token_ids
    assert [x["logprob"] for x in got["logprobs"]] == pytest.approx(
        [lp.logprob for lp in ref.logprobs], abs=1e-5
    )
    for x, lp in zip(got["logprobs"], ref.logprobs, strict=True):
        assert [t for t, _ in x["top"]] == [t for t, _ in lp.top]
    assert cpp_generate(run_bin, tiny_package, ids, "--max-new-tokens", "2")["logprobs"] is None
    proc = run(run_bin, tiny_package, "--prompt", "hi", "--logprobs", "2", check=False)
    assert proc.returncode == 1 and "--logprobs N goes with --json" in proc.stderr


@pytest.mark.parametrize("long", [False, True], ids=["short", "past-the-context"])
def test_interactive_conversation_reuses_the_cache_like_python(run_bin, tiny_package, long):
    """`--interactive`: each stdin line is a turn of one chat; each turn's prompt, cached count
    and ids equal the Python engine's on the same chat, and its ids a cold run's. A chat past
    the context drops its oldest turns as Python's does."""
    from test_prefix_reuse import LONG_CHAT

    lines = LONG_CHAT if long else ["The quick brown fox", "and then?", "1 2 3 4 5 6 7 8"]
    printed = run_interactive(run_bin, tiny_package, lines, 12)
    check_conversation(printed, tiny_package, lines, GenerationConfig(12, ignore_eos=True))


def run_interactive(run_bin: Path, package: Path, lines: list[str], tokens: int) -> list[dict]:
    """`aotgen-run --interactive --json`, a chat turn per line: the turns it printed."""
    proc = subprocess.run(
        [str(run_bin), str(package), "--interactive", "--json", "--ignore-eos"]
        + ["--max-new-tokens", str(tokens)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_killed_runtime_leaves_no_extracted_graphs(run_bin, tiny_package, tmp_path):
    """torch's loader extracts each graph's library into the temp dir: `aotgen-run` killed with
    its package loaded (here after its first turn) leaves none of them there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(
        [str(run_bin), str(tiny_package), "--interactive", "--json", "--max-new-tokens", "4"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        proc.stdin.write("The quick brown fox\n")
        proc.stdin.flush()
        assert len(json.loads(proc.stdout.readline())["ids"]) > 0
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert sorted(p.name for p in tmp.iterdir()) == []


@pytest.fixture(scope="module")
def gemma_chat_package(tiny_package: Path, tmp_path_factory) -> Path:
    """The tiny package with Gemma 2's chat template (not ChatML)."""
    dest = tmp_path_factory.mktemp("gemma") / "pkg"
    return with_chat_template(tiny_package, dest, "google-gemma-2-2b-it.jinja")


def test_chat_template_of_another_family(run_bin, gemma_chat_package):
    """--chat renders the package's own template (Gemma's, not ChatML) in C++: the prompt ids
    and the answer equal the Python engine's, and --interactive turns reuse the cache as
    Python's do. A template that raises (Gemma has no system role) is a one-line error."""
    engine = Engine.load(gemma_chat_package)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert "<start_of_turn>user" in engine.tokenizer.decode(ids)
    proc = run(
        run_bin,
        gemma_chat_package,
        "--chat",
        "Hi",
        "--ids",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
    )
    got = json.loads(proc.stdout)
    assert got["prompt_ids"] == ids
    assert got["ids"] == engine.generate(ids, GenerationConfig(8, ignore_eos=True)).token_ids
    proc = run(run_bin, gemma_chat_package, "--chat", "Hi", "--system", "Be brief.", check=False)
    assert_fails(proc, "the chat template failed: System role not supported")

    lines = ["The quick brown fox", "and then?", "1 2 3"]
    printed = run_interactive(run_bin, gemma_chat_package, lines, 8)
    check_conversation(printed, gemma_chat_package, lines, GenerationConfig(8, ignore_eos=True))


@pytest.fixture(scope="module")
def qwen3_chat_package(tiny_package: Path, tmp_path_factory) -> Path:
    """The tiny package with Qwen3's chat template (its `enable_thinking` switch)."""
    dest = tmp_path_factory.mktemp("qwen3") / "pkg"
    return with_chat_template(tiny_package, dest, "Qwen-Qwen3-0.6B.jinja")


def test_chat_template_kwargs_reach_the_template_like_python(run_bin, qwen3_chat_package):
    """--chat-template-kwargs '{"enable_thinking": false}': both CLIs render Qwen3's prompt
    with the empty reasoning block that switch writes, the ids the Python engine gives."""
    engine = Engine.load(qwen3_chat_package)
    off = {"enable_thinking": False}
    ids = engine.chat_ids("Hi", template_kwargs=off)
    assert engine.tokenizer.decode(ids).endswith("<think>\n\n</think>\n\n")
    assert ids != engine.chat_ids("Hi")
    args = ["--chat", "Hi", "--chat-template-kwargs", json.dumps(off), "--max-new-tokens", "4"]
    cpp = json.loads(run(run_bin, qwen3_chat_package, *args, "--ids").stdout)
    python = subprocess.run(
        [sys.executable, "-m", "aotgen", "run", str(qwen3_chat_package), *args, "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert cpp["prompt_ids"] == json.loads(python.stdout)["prompt_ids"] == ids


def test_the_models_sampling_values_are_taken_like_python(
    run_bin, tiny_package, py_engine, tmp_path
):
    """generation_config.json's temperature, top_k and repetition penalty sample the answer
    where the command line gives none (the Python engine's seeded sample with them), a value
    given wins, `--generation-config none` is greedy, and a value the runtime refuses (top_p 2)
    is left out with a warning naming it."""
    package = with_generation_config(
        tiny_package, tmp_path / "pkg", MODEL_SAMPLING | {"top_p": 2.0}
    )
    ids = py_engine.tokenizer.prompt_ids("the cat")
    model, own_top_k, greedy = model_sampling_answers(py_engine, ids)
    common = ["--max-new-tokens", "12", "--ignore-eos", "--seed", "5"]
    proc = run(run_bin, package, "--prompt-ids", json.dumps(ids), "--ids", *common)
    assert json.loads(proc.stdout)["ids"] == model
    assert "temperature=0.8, top_k=3, repetition_penalty=1.5;" in proc.stderr
    assert "generation_config.json's top_p=2.0 (top_p must be in (0, 1]" in proc.stderr
    assert cpp_generate(run_bin, package, ids, *common, "--top-k", "0")["ids"] == own_top_k
    none = cpp_generate(run_bin, package, ids, *common, "--generation-config", "none")
    assert none["ids"] == greedy


@pytest.fixture(scope="module")
def r1_chat_package(tiny_package: Path, tmp_path_factory) -> Path:
    """The tiny package with DeepSeek-R1's chat template: the prompt opens the reasoning."""
    dest = tmp_path_factory.mktemp("r1") / "pkg"
    return with_chat_template(tiny_package, dest, r1_thinking_template())


def test_reasoning_comes_apart_from_the_answer_like_python(run_bin, r1_chat_package, tiny_package):
    """A chat answer's reasoning (the prompt opened `<think>`, the tiny model never closes it)
    goes to stderr and the JSON's `reasoning`, the answer alone to stdout and `content`, as
    Python's split of Python's answer; `--interactive` sends each answer back without its
    reasoning, as Python's does. A template without reasoning keeps the answer whole."""
    engine = Engine.load(r1_chat_package)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert thinking_of(engine.tokenizer, ids) is True
    args = ["--chat", "Hi", "--max-new-tokens", "8", "--ignore-eos"]
    got = json.loads(run(run_bin, r1_chat_package, *args, "--json").stdout)
    assert got["ids"] == engine.generate(ids, GenerationConfig(8, ignore_eos=True)).token_ids
    # C++'s own text: a random model's stray bytes decode differently in the two runtimes.
    reasoning, content = split_reasoning(got["text"], True)
    assert (got["reasoning"], got["content"]) == (reasoning, content) and reasoning
    proc = run(run_bin, r1_chat_package, *args)
    assert proc.stdout == content + "\n" and proc.stderr.startswith(reasoning + "\n")

    plain = json.loads(run(run_bin, tiny_package, *args, "--json").stdout)
    assert (plain["reasoning"], plain["content"]) == (None, plain["text"])

    lines = ["Hi", "and?", "1 2"]  # three turns in the context: R1's tags take ~20 tokens each
    printed = run_interactive(run_bin, r1_chat_package, lines, 4)
    check_conversation(printed, r1_chat_package, lines, GenerationConfig(4, ignore_eos=True))


@pytest.fixture(scope="module")
def harmony_chat_package(tiny_package: Path, tmp_path_factory) -> Path:
    """The tiny package with a compact gpt-oss (harmony) template: the answer's head is
    `assistant`."""
    dest = tmp_path_factory.mktemp("harmony") / "pkg"
    return with_chat_template(tiny_package, dest, "compact-harmony.jinja")


def test_harmony_answer_comes_apart_like_python(run_bin, harmony_chat_package):
    """Under a harmony template a chat answer is split as Python's `split_harmony` splits
    C++'s text: the JSON's `reasoning` (a string) and `content`, the streamed content alone on
    stdout, any reasoning on stderr before the stats. The C++ tool takes no grammar, so the
    random model writes no harmony of its own: test_cpp_tokenizer.py's
    test_harmony_split_equals_pythons checks the split on harmony answers."""
    engine = Engine.load(harmony_chat_package)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    head = head_of(engine.tokenizer, ids)
    assert head == "assistant"
    args = ["--chat", "Hi", "--max-new-tokens", "8", "--ignore-eos"]
    got = json.loads(run(run_bin, harmony_chat_package, *args, "--json").stdout)
    assert got["prompt_ids"] == ids
    split = split_harmony(got["text"], head)
    assert (got["reasoning"], got["content"]) == (split.reasoning, split.content)
    proc = run(run_bin, harmony_chat_package, *args)
    assert proc.stdout == split.content + "\n"
    assert proc.stderr.startswith(f"{split.reasoning}\n" if split.reasoning else "load ")


def test_reasoning_budget_closes_the_reasoning_like_python(
    run_bin, r1_chat_package, harmony_chat_package
):
    """--reasoning-budget (and its message): the ids are the Python engine's, plain and n-gram
    (a lookup proposal is cut where it misses the forced close), after `<think>` opened by
    DeepSeek-R1's prompt and inside a harmony analysis message (--prompt-ids)."""
    engine = Engine.load(r1_chat_package)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    for budget, message, lookup in ((0, None, False), (4, "Enough.", False), (6, None, True)):
        args = ["--chat", "Hi", "--max-new-tokens", "24", "--ignore-eos", "--json"]
        args += ["--reasoning-budget", str(budget)]
        args += ["--reasoning-budget-message", message] if message else []
        args += ["--lookup", "ngram"] if lookup else []
        got = json.loads(run(run_bin, r1_chat_package, *args).stdout)
        config = GenerationConfig(
            24,
            ignore_eos=True,
            reasoning_budget=budget,
            reasoning_budget_message=message or "",
            speculative="ngram" if lookup else None,
        )
        want = engine.generate(ids, config)
        assert got["ids"] == want.token_ids and "</think>" in want.text, (budget, lookup)
        assert got["content"] == split_reasoning(got["text"], True)[1]

    harmony = Engine.load(harmony_chat_package)
    chat = harmony.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    analysis = chat + harmony.tokenizer.encode("<|channel|>analysis<|message|>")
    args = ["--prompt-ids", json.dumps(analysis), "--max-new-tokens", "60", "--ignore-eos"]
    got = json.loads(
        run(run_bin, harmony_chat_package, *args, "--reasoning-budget", "3", "--json").stdout
    )
    want = harmony.generate(analysis, GenerationConfig(60, ignore_eos=True, reasoning_budget=3))
    assert got["ids"] == want.token_ids and "<|channel|>final<|message|>" in want.text


# ---- bad input: one clear message, exit status 1, no crash -------------------------------


def assert_fails(proc: subprocess.CompletedProcess, message: str, status: int = 1) -> None:
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert message in proc.stderr, proc.stderr
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") <= (1 if status == 1 else 40), proc.stderr


def edit_manifest(package: Path, fn) -> None:
    manifest = json.loads((package / "manifest.json").read_text())
    fn(manifest)
    (package / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def package_copy(tiny_package: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_package, tmp_path / "pkg"))


def test_missing_package(run_bin, tmp_path):
    proc = run(run_bin, tmp_path / "nope", "--prompt", "hi", check=False)
    assert_fails(proc, "is not an aotgen package (no manifest.json)")


def test_hash_mismatch_refused_before_loading(run_bin, package_copy):
    # Corrupt the native code itself: a loader that ran first would crash or fail otherwise.
    pt2 = package_copy / "rank0" / "model.pt2"
    data = bytearray(pt2.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pt2.write_bytes(bytes(data))
    proc = run(run_bin, package_copy, "--prompt", "hi", check=False)
    assert_fails(proc, "rank0/model.pt2 does not match its sha256")
    with pytest.raises(PackageError, match="does not match its sha256"):
        Engine.load(package_copy)  # the Python side agrees


def test_unlisted_file_refused(run_bin, package_copy):
    (package_copy / "rank0" / "extra.so").write_bytes(b"\x7fELF")
    proc = run(run_bin, package_copy, "--prompt", "hi", check=False)
    assert_fails(proc, "unexpected file rank0/extra.so not in the manifest")


def test_other_torch_version_refused(run_bin, package_copy):
    edit_manifest(package_copy, lambda m: m.update(torch_version="2.0.0+cpu"))
    proc = run(run_bin, package_copy, "--prompt", "hi", check=False)
    assert_fails(proc, "was built with torch 2.0.0+cpu but this runtime links libtorch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_package_refused_without_cuda(run_bin, package_copy):
    cuda = {"device": "cuda", "gpu": "NVIDIA H100", "compute_capability": "9.0", "cuda": "13.0"}
    edit_manifest(package_copy, lambda m: m["target"].update(cuda))
    proc = run(run_bin, package_copy, "--prompt", "hi", check=False)
    assert_fails(proc, "was built for a CUDA GPU (NVIDIA H100) but this runtime was built against")


def test_other_isa_and_format_refused(run_bin, package_copy):
    edit_manifest(package_copy, lambda m: m["target"].update(isa="AMX_FP16"))
    assert_fails(run(run_bin, package_copy, "--prompt", "hi", check=False), "compiled for AMX_FP16")
    edit_manifest(package_copy, lambda m: m.update(format_version=99))
    assert_fails(run(run_bin, package_copy, "--prompt", "hi", check=False), "package format 99")
    (package_copy / "manifest.json").write_text("{ not json")
    assert_fails(run(run_bin, package_copy, "--prompt", "hi", check=False), "is corrupt")


def test_overlong_prompt_and_bad_requests(run_bin, tiny_package):
    proc = run(
        run_bin,
        tiny_package,
        "--prompt-ids",
        json.dumps([5] * 150),
        "--max-new-tokens",
        "20",
        check=False,
    )
    assert_fails(proc, "exceeds the package context of 160 tokens")
    proc = run(
        run_bin,
        tiny_package,
        "--prompt",
        "hi",
        "--speculative",
        "--max-new-tokens",
        "8",
        check=False,
    )
    assert_fails(proc, "has no draft model")
    proc = run(
        run_bin, tiny_package, "--prompt-ids", "[1, 99999]", "--max-new-tokens", "8", check=False
    )
    assert_fails(proc, "outside the model's vocabulary")
    proc = run(
        run_bin,
        tiny_package,
        "--prompt",
        "hi",
        "--top-p",
        "0",
        "--max-new-tokens",
        "8",
        check=False,
    )
    assert_fails(proc, "top_p must be in (0, 1]")
    proc = run(run_bin, tiny_package, "--prompt", "hi", "--min-p", "2", check=False)
    assert_fails(proc, "min_p must be in [0, 1]")
    proc = run(run_bin, tiny_package, "--prompt", "hi", "--presence-penalty", "3", check=False)
    assert_fails(proc, "presence penalty must be in -2..2")
    proc = run(run_bin, tiny_package, "--prompt", "hi", "--max-new-tokens", "x", check=False)
    assert_fails(proc, "--max-new-tokens: not a valid number", status=2)
    proc = run(run_bin, tiny_package, check=False)
    assert_fails(proc, "give exactly one of --chat, --prompt", status=2)


# ---- the real model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_package(request) -> Path:
    if (REAL_PACKAGE / "manifest.json").is_file():
        return REAL_PACKAGE
    try:  # conftest.py builds it in the background when the GGUF is installed (CI)
        return request.getfixturevalue("smollm2_package")
    except pytest.FixtureLookupError:
        pytest.skip(f"{REAL_PACKAGE.relative_to(REPO_ROOT)} not built (aotgen build)")


def test_real_model_france_answer(run_bin, real_package):
    try:
        engine = Engine.load(real_package)
    except PackageError as e:
        pytest.skip(f"{real_package} cannot be loaded here: {e}")
    question = "What is the capital of France?"
    proc = run(run_bin, real_package, "--chat", question)
    assert proc.stdout.strip() == ANSWER
    assert "decode" in proc.stderr and "tok/s" in proc.stderr
    got = json.loads(run(run_bin, real_package, "--chat", question, "--ids").stdout)
    assert got["prompt_ids"] == engine.chat_ids(question) == FRANCE_IDS
    ref = engine.generate(FRANCE_IDS, GenerationConfig(max_new_tokens=256))
    assert got["ids"] == ref.token_ids
    assert got["text"] == ref.text == ANSWER
    assert got["finish_reason"] == "eos"
