"""The C++ BatchEngine (runtime/cpp/batch_engine.cpp, driven through `aotgen-batch`) against
the Python BatchEngine: more requests than slots, of different lengths, greedy and seeded
sampling, with and without n-gram speculation, give the same ids, text, finish reasons and
speculation counts as Python's batch engine, and each the ids it gets alone. A cancelled
request frees its slot for a waiting one. On the real SmolLM2 serve package, 16 chat
prompts give Python's ids.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from reference import r1_thinking_template, with_chat_template, with_generation_config

from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.harmony import split_harmony
from aotgen.runtime.lookup_cache import LookupCache
from aotgen.runtime.reasoning import split_reasoning
from aotgen.runtime.rules import Penalties
from aotgen.runtime.sampling import SamplingParams

pytestmark = pytest.mark.cpp

PREFILL_STEP = 8  # below the tiny package's prefill chunk (16): prompts prefill over steps


def run_batch(
    binary: Path, package: Path, requests: list[dict], tmp_path: Path, *args: str, check=True
) -> subprocess.CompletedProcess:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    proc = subprocess.run(
        [str(binary), str(package), str(path), *args],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def cpp_results(proc: subprocess.CompletedProcess) -> tuple[list[dict], dict]:
    """Results in request order, and the summary line."""
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    results = sorted(lines[:-1], key=lambda r: r["request"])
    return results, lines[-1]["summary"]


def request_json(ids: list[int], config: GenerationConfig) -> dict:
    s = config.sampling
    r = {"prompt_ids": ids, "max_new_tokens": config.max_new_tokens}
    r |= {"ignore_eos": config.ignore_eos, "stop": list(config.stop)}
    r |= {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p}
    if s.seed is not None:
        r["seed"] = s.seed
    if config.uses_lookup:
        r["lookup"] = "ngram"
    if config.uses_draft:
        r["speculative"] = True
    if config.logprobs is not None:
        r["logprobs"] = config.logprobs
    if config.stop_token_ids or config.min_tokens:
        r |= {"stop_token_ids": list(config.stop_token_ids), "min_tokens": config.min_tokens}
    if (pen := config.penalties) is not None:
        r |= {"repetition_penalty": pen.repetition, "presence_penalty": pen.presence}
        r |= {"frequency_penalty": pen.frequency, "logit_bias": dict(pen.logit_bias)}
    return r


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts of 2..40 tokens; every third repeats itself, so that lookup proposes."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (n,), generator=g).tolist()
    prompts = [torch.randint(5, vocab, (m,), generator=g).tolist() for m in lengths]
    return [(p[:5] * 8)[: len(p) + 8] if i % 3 == 0 else p for i, p in enumerate(prompts)]


# Two requests in five with penalties: repetition, presence and frequency; a cycle of biased
# tokens, so that verify rows must count the proposal's own tokens (test_penalties.py).
PENALTIES = [
    None,
    Penalties(repetition=1.4, presence=0.5, frequency=0.4),
    None,
    Penalties(frequency=1.0, logit_bias=((40, 30.0), (41, 29.5), (42, 29.0))),
    None,
]


def _configs(n: int, draft: bool = False) -> list[GenerationConfig]:
    """Greedy and seeded sampling (temperature, top-k, top-p), each plain and with n-gram
    speculation, of different lengths. With `draft`, some plain ones draft with the draft
    model instead: greedy ones with "draft", sampled ones with "draft+ngram"."""
    sampled = [
        SamplingParams(temperature=0.9, seed=7),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11),
    ]
    configs = []
    for i in range(n):
        params = SamplingParams() if i % 2 == 0 else sampled[(i // 2) % 2]
        speculative = "ngram" if i % 4 in (0, 1) else None
        if draft and (i % 4 == 3 or i % 4 == 2 and i >= 4):
            speculative = "draft" if params.greedy else "draft+ngram"
        tokens = 12 + 5 * (i % 4)
        config = GenerationConfig(tokens, params, ignore_eos=True, speculative=speculative)
        config.logprobs = [None, 2, 0][i % 3]
        config.penalties = PENALTIES[i % 5]
        configs.append(config)
    return configs


@pytest.mark.parametrize("package_fixture", ["tiny_batch_package", "tiny_package"])
def test_batch_matches_python(request, batch_bin, tmp_path, package_fixture):
    """Ten requests on four slots (the batched graphs' max_batch; the package without them
    gets four slots and runs its requests one by one in each step). The package with batched
    graphs has a draft on the target's cache: there two more requests, and five draft with it
    (greedy "draft", sampled "draft+ngram"), stepping together through its batch_decode."""
    package = request.getfixturevalue(package_fixture)
    py = BatchEngine.load(package, prefill_step=PREFILL_STEP)
    draft = py.engine.draft is not None
    prompts = _prompts(12 if draft else 10, py.target.vocab_size, seed=3)
    configs = _configs(len(prompts), draft)
    # A stop string from the middle of a greedy answer: ASCII, since the two runtimes' text
    # differs where a random model's bytes are not UTF-8 (replacement characters).
    alone = Engine.load(package)
    text = alone.generate(prompts[2], configs[2]).text
    ascii_at = [i for i in range(len(text) // 3, len(text) - 1) if text[i : i + 2].isascii()]
    configs[2].stop = (text[ascii_at[0] : ascii_at[0] + 2],)
    # min_tokens: eos, favoured at every step, ends request 3 (drafting where the package has
    # a draft) only at its 7th token; a stop token from request 1's answer is held off until
    # its 5th.
    eos = Penalties(logit_bias=((min(alone.tokenizer.eos_ids), 100.0),))
    configs[3] = replace(configs[3], ignore_eos=False, penalties=eos, min_tokens=7)
    stop_id = alone.generate(prompts[1], configs[1]).token_ids[2]
    configs[1] = replace(configs[1], stop_token_ids=(stop_id,), min_tokens=5)
    want = py.generate_many(prompts, configs)
    requests = [request_json(p, c) for p, c in zip(prompts, configs, strict=True)]
    proc = run_batch(batch_bin, package, requests, tmp_path, "--prefill-step", str(PREFILL_STEP))
    got, summary = cpp_results(proc)
    assert summary["slots"] == summary["free_slots"] == 4
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["ids"] == w.token_ids, i
        assert (g["text"], g["finish_reason"]) == (w.text, w.finish_reason), i
        assert g["stop_reason"] == w.stop_reason, i
        keys = ("drafted", "accepted", "steps", "lookup_steps")
        spec = w.spec and {k: getattr(w.spec, k) for k in keys}
        assert (g["spec"] and {k: g["spec"][k] for k in keys}) == spec, i
        if w.logprobs is None:
            assert g["logprobs"] is None
            continue
        assert [x["id"] for x in g["logprobs"]] == g["ids"]
        assert [x["logprob"] for x in g["logprobs"]] == pytest.approx(
            [lp.logprob for lp in w.logprobs], abs=1e-4
        )
        assert [[t for t, _ in x["top"]] for x in g["logprobs"]] == [
            [t for t, _ in lp.top] for lp in w.logprobs
        ]
    # Batching does not change what a request gets alone (the single-sequence engine).
    for p, c, g in zip(prompts, configs, got, strict=True):
        assert g["ids"] == alone.generate(p, c).token_ids
    assert (got[2]["finish_reason"], got[2]["stop_reason"]) == ("stop", configs[2].stop[0])
    assert (len(got[3]["ids"]), got[3]["finish_reason"]) == (7, "eos")
    assert stop_id not in got[1]["ids"][:5]
    assert sum(g["spec"]["accepted"] for g in got if g["spec"]) > 0  # lookup really verified
    if draft:  # the draft model really drafted, greedy and sampled
        drafting = [(g, c) for g, c in zip(got, configs, strict=True) if c.uses_draft]
        for mode in ("draft", "draft+ngram"):  # every step proposes: lookup, else the draft
            spec = [g["spec"] for g, c in drafting if c.speculative == mode]
            assert sum(s["steps"] for s in spec) > sum(s["lookup_steps"] for s in spec), mode


def test_chat_reasoning_comes_apart(batch_bin, tiny_package, tmp_path):
    """Under DeepSeek-R1's template (the prompt opens the reasoning) a chat request's answer,
    the ids Python gets, is split as Python splits its text; a plain prompt's stays whole."""
    package = with_chat_template(tiny_package, tmp_path / "r1", r1_thinking_template())
    engine = Engine.load(package)
    request = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
    got, _ = cpp_results(
        run_batch(
            batch_bin, package, [{"chat": "Hi"} | request, {"prompt": "Hi"} | request], tmp_path
        )
    )
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert got[0]["ids"] == engine.generate(ids, GenerationConfig(6, ignore_eos=True)).token_ids
    assert (got[0]["reasoning"], got[0]["content"]) == split_reasoning(got[0]["text"], True)
    assert got[0]["reasoning"] and (got[1]["reasoning"], got[1]["content"]) == (
        None,
        got[1]["text"],
    )


def test_reasoning_budgets_of_a_batch_equal_pythons(batch_bin, tiny_package, tmp_path):
    """Requests with their own reasoning budgets (0, 3 with a message, 5 under n-gram lookup,
    none) served together: each answer's ids are the Python engine's alone."""
    package = with_chat_template(tiny_package, tmp_path / "r1", r1_thinking_template())
    engine = Engine.load(package)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    request = {"chat": "Hi", "max_new_tokens": 20, "ignore_eos": True, "temperature": 0}
    budgets = [
        {"reasoning_budget": 0},
        {"reasoning_budget": 3, "reasoning_budget_message": "Enough."},
        {"reasoning_budget": 5, "lookup": "ngram"},
        {},
    ]
    got, _ = cpp_results(run_batch(batch_bin, package, [request | b for b in budgets], tmp_path))
    for answer, budget in zip(got, budgets, strict=True):
        config = GenerationConfig(
            20,
            ignore_eos=True,
            reasoning_budget=budget.get("reasoning_budget"),
            reasoning_budget_message=budget.get("reasoning_budget_message", ""),
            speculative=budget.get("lookup"),
        )
        assert answer["ids"] == engine.generate(ids, config).token_ids, budget
    assert "</think>" in got[1]["text"] and "</think>" not in got[3]["text"]


def test_chat_harmony_comes_apart(batch_bin, tiny_package, tmp_path):
    """Under a harmony template a chat request's answer is split as Python's `split_harmony`
    splits its text, the reasoning a string (empty: the random model writes no harmony); a
    plain prompt's stays whole."""
    package = with_chat_template(tiny_package, tmp_path / "harmony", "compact-harmony.jinja")
    request = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
    got, _ = cpp_results(
        run_batch(
            batch_bin, package, [{"chat": "Hi"} | request, {"prompt": "Hi"} | request], tmp_path
        )
    )
    split = split_harmony(got[0]["text"])
    assert (got[0]["reasoning"], got[0]["content"]) == (split.reasoning, split.content)
    assert (got[1]["reasoning"], got[1]["content"]) == (None, got[1]["text"])


def test_template_variables_and_the_models_sampling(batch_bin, tiny_package, tmp_path):
    """Under Qwen3's template, `--chat-template-kwargs` and a request's own
    `chat_template_kwargs` (over it) give the prompt ids the Python engine gives; a request
    that leaves out temperature and top_k samples with the model's (generation_config.json:
    the Python engine's seeded sample with them), unless `--generation-config none`."""
    qwen3 = with_chat_template(tiny_package, tmp_path / "qwen3", "Qwen-Qwen3-0.6B.jinja")
    model = {"do_sample": True, "temperature": 0.8, "top_k": 3}
    package = with_generation_config(qwen3, tmp_path / "pkg", model)
    engine = Engine.load(package)
    off, on = (
        engine.chat_ids("Hi", template_kwargs={"enable_thinking": False}),
        engine.chat_ids("Hi"),
    )
    assert off != on
    request = {"chat": "Hi", "max_new_tokens": 8, "ignore_eos": True, "seed": 5}
    requests = [request, request | {"chat_template_kwargs": {"enable_thinking": True}}]
    kwargs = ["--chat-template-kwargs", '{"enable_thinking": false}']
    proc = run_batch(batch_bin, package, requests, tmp_path, *kwargs)
    got, _ = cpp_results(proc)
    assert [r["prompt_ids"] for r in got] == [off, on]

    def want(sampling: SamplingParams) -> list[int]:
        config = GenerationConfig(8, sampling, ignore_eos=True)
        return engine.generate(off, config).token_ids

    sampled, greedy = want(SamplingParams(0.8, top_k=3, seed=5)), want(SamplingParams())
    assert sampled not in (greedy, want(SamplingParams(0.8, seed=5)))
    assert got[0]["ids"] == sampled
    assert "temperature=0.8, top_k=3;" in proc.stderr
    none = run_batch(
        batch_bin, package, requests[:1], tmp_path, *kwargs, "--generation-config", "none"
    )
    assert cpp_results(none)[0][0]["ids"] == greedy


def _both_runtimes(
    binary: Path, package: Path, prompts: list[list[int]], configs: list, tmp_path: Path
) -> tuple[list[dict], list]:
    """The requests served by aotgen-batch and by the Python batch engine, in order."""
    want = BatchEngine.load(package, prefill_step=PREFILL_STEP).generate_many(prompts, configs)
    requests = [request_json(p, c) for p, c in zip(prompts, configs, strict=True)]
    proc = run_batch(binary, package, requests, tmp_path, "--prefill-step", str(PREFILL_STEP))
    return cpp_results(proc)[0], want


def test_a_follow_up_takes_the_slot_holding_its_prefix(batch_bin, tiny_batch_package, tmp_path):
    """Four requests fill the slots; the one that ends first frees its slot for a follow-up
    that extends its prompt, which runs only the new tokens; a repeat of another prompt runs
    one. Slots, cached counts and ids equal the Python batch engine's; ids a cold run's."""
    cold = Engine.load(tiny_batch_package)
    prompts = _prompts(4, cold.target.vocab_size, seed=8)
    prompts += [prompts[1] + [7, 8, 9], list(prompts[3])]
    lengths = [30, 4, 30, 8, 30, 10]  # request 1 ends first, then 3 (4 still runs)
    configs = [GenerationConfig(n, ignore_eos=True) for n in lengths]
    got, want = _both_runtimes(batch_bin, tiny_batch_package, prompts, configs, tmp_path)
    assert [g["cached_tokens"] for g in got] == [w.cached_tokens for w in want]
    assert [w.cached_tokens for w in want] == [0, 0, 0, 0, len(prompts[1]), len(prompts[3]) - 1]
    for p, c, g, w in zip(prompts, configs, got, want, strict=True):
        assert g["ids"] == w.token_ids == cold.generate(p, replace(c, reuse_prefix=False)).token_ids


def test_requests_running_at_once_share_their_system_prompt(
    batch_bin, tiny_batch_package, tmp_path
):
    """Three requests with one 30-token system prompt, one of them drafting: the later two
    copy it from the first's row while it runs. Cached counts and ids equal the Python batch
    engine's; ids a cold run's."""
    cold = Engine.load(tiny_batch_package)
    system = list(range(40, 70))
    prompts = [system + p[:6] for p in _prompts(3, cold.target.vocab_size, seed=10)]
    configs = [GenerationConfig(12, ignore_eos=True, speculative=s) for s in (None, "draft", None)]
    got, want = _both_runtimes(batch_bin, tiny_batch_package, prompts, configs, tmp_path)
    assert [g["cached_tokens"] for g in got] == [w.cached_tokens for w in want] == [0, 30, 30]
    for p, c, g, w in zip(prompts, configs, got, want, strict=True):
        assert g["ids"] == w.token_ids == cold.generate(p, replace(c, reuse_prefix=False)).token_ids


def test_lookup_cache_equals_pythons(batch_bin, tiny_batch_package, tmp_path):
    """Six n-gram requests (three prompts, each twice), served twice with --lookup-cache: the
    second batch drafts from what the first taught; ids, drafted and accepted counts equal the
    Python batch engine's with the same cache, and the two write the same file."""
    engine = BatchEngine.load(tiny_batch_package, prefill_step=PREFILL_STEP)
    engine.engine.lookup_cache = LookupCache()
    prompts = _prompts(3, engine.engine.target.vocab_size, seed=12) * 2
    configs = [GenerationConfig(20, ignore_eos=True, speculative="ngram")] * 6
    requests = [request_json(p, c) for p, c in zip(prompts, configs, strict=True)]
    args = ["--prefill-step", str(PREFILL_STEP), "--lookup-cache", str(tmp_path / "cpp.bin")]
    rounds = []
    for _ in range(2):
        want = engine.generate_many(prompts, configs)
        got = cpp_results(run_batch(batch_bin, tiny_batch_package, requests, tmp_path, *args))[0]
        for g, w in zip(got, want, strict=True):
            assert g["ids"] == w.token_ids
            assert (g["spec"]["drafted"], g["spec"]["accepted"]) == (
                w.spec.drafted,
                w.spec.accepted,
            )
        rounds.append(sum(w.spec.accepted for w in want))
    engine.engine.lookup_cache.save(tmp_path / "py.bin")
    assert (tmp_path / "cpp.bin").read_bytes() == (tmp_path / "py.bin").read_bytes()
    assert rounds[1] > rounds[0], rounds


def test_cancel_frees_the_slot(batch_bin, tiny_batch_package, tmp_path):
    """Four long requests fill the slots; cancelling one after 3 steps lets the waiting
    short one in, which finishes long before the others, with its own ids. A request
    cancelled while it waits ends with no tokens."""
    alone = Engine.load(tiny_batch_package)
    prompts = _prompts(6, alone.target.vocab_size, seed=6)
    long = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    short = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    requests = [request_json(p, long) for p in prompts[:4]]
    requests += [request_json(prompts[4], short), request_json(prompts[5], short)]
    requests[0]["cancel_after"] = 3
    requests[5]["cancel_after"] = 1
    got, summary = cpp_results(run_batch(batch_bin, tiny_batch_package, requests, tmp_path))
    assert got[0]["finish_reason"] == got[5]["finish_reason"] == "cancelled"
    assert 0 < len(got[0]["ids"]) < 60 and got[5]["ids"] == []
    assert got[4]["ids"] == alone.generate(prompts[4], short).token_ids
    assert got[4]["step"] < min(got[i]["step"] for i in (1, 2, 3))
    for i in (1, 2, 3):
        assert got[i]["ids"] == alone.generate(prompts[i], long).token_ids
    assert summary["free_slots"] == 4


def test_bad_requests(batch_bin, tiny_batch_package, tmp_path):
    cases = [
        ({"prompt_ids": [1, 2], "max_new_tokens": 500}, "request 1: prompt (2 tokens)"),
        ({"prompt_ids": [1, 2], "colour": "red"}, "line 1: unknown field 'colour'"),
        ({"prompt_ids": [1, 2], "temperature": -1}, "request 1: temperature"),
        ({"chat": "hi", "chat_template_kwargs": [1]}, "line 1: chat_template_kwargs must be a"),
        (
            {"chat": "hi", "chat_template_kwargs": {"messages": []}},
            "line 1: chat_template_kwargs sets 'messages', which the chat itself gives",
        ),
    ]
    for request, message in cases:
        proc = run_batch(batch_bin, tiny_batch_package, [request], tmp_path, check=False)
        assert proc.returncode == 1, proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr
    args = ["--chat-template-kwargs", "[1]"]
    proc = run_batch(batch_bin, tiny_batch_package, [{"chat": "hi"}], tmp_path, *args, check=False)
    assert proc.returncode == 1
    assert proc.stderr == "aotgen-batch: error: --chat-template-kwargs must be a JSON object\n"


# ---- the real model -------------------------------------------------------------------------
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Count from 1 to 10.",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is the largest planet in the solar system?",
    "List the days of the week.",
    "Who wrote Romeo and Juliet?",
    "What does a CPU do?",
    "Suggest a name for a cat.",
    "What is the boiling point of water?",
    "Describe a rainbow in one sentence.",
    "How many legs does a spider have?",
]


def check_real_package(binary: Path, package: Path, tmp_path: Path) -> None:
    """16 chat prompts at once, greedy (two with n-gram speculation): Python's ids."""
    py = BatchEngine.load(package, threads=2)
    prompts = [py.engine.chat_ids(q) for q in CHATS]
    configs = [
        GenerationConfig(max_new_tokens=32, speculative="ngram" if i % 8 == 2 else None)
        for i in range(len(prompts))
    ]
    want = py.generate_many(prompts, configs)
    requests = [{"chat": q, "max_new_tokens": 32} for q in CHATS]
    for i in (2, 10):
        requests[i]["lookup"] = "ngram"
    got, summary = cpp_results(run_batch(binary, package, requests, tmp_path, "--threads", "2"))
    assert [g["prompt_ids"] for g in got] == prompts
    assert [g["ids"] for g in got] == [w.token_ids for w in want]
    assert [g["text"] for g in got] == [w.text for w in want]
    assert got[0]["text"] == "The capital of France is Paris."
    assert summary["slots"] == 16


def test_real_serve_package(batch_bin, smollm2_serve_package, tmp_path):
    check_real_package(batch_bin, smollm2_serve_package, tmp_path)
