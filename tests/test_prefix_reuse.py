"""Prefix reuse: a request runs only the part of its prompt that its KV-cache row does not
already hold. Every reusing run is compared with the same request run from position 0 on a
second engine of the same package (logits, and greedy ids)."""

from __future__ import annotations

import json

import pytest
import torch
from reference import check_conversation
from test_cli_help import aotgen

from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.cached_tokens import CachedTokens
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.sampling import SamplingParams

GREEDY = GenerationConfig(max_new_tokens=12, ignore_eos=True)
COLD = GenerationConfig(max_new_tokens=12, ignore_eos=True, reuse_prefix=False)


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


def test_the_record_forgets_overwritten_positions_and_gaps():
    cached = CachedTokens(2)
    cached.forget(0, 0)
    cached.wrote(0, 0, [1, 2, 3, 4])
    assert cached.prefix(0, [1, 2, 3, 9]) == 3
    assert cached.reusable(0, [1, 2, 3, 4]) == 3  # the last prompt token always runs
    cached.forget(0, 2)  # a draft's keys or a tree at 2..: forgotten, not recorded
    assert cached.rows[0] == [1, 2]
    cached.forget(0, 5)
    cached.wrote(0, 5, [7])  # positions 2..4 unknown: nothing past them is claimed
    assert cached.rows[0] == [1, 2]
    cached.forget(1, 0)
    cached.wrote(1, 0, [1, 2, 3])
    assert cached.best_slot([0, 1], [1, 2, 3, 8]) == 1
    assert cached.best_slot([0, 1], [6]) == 0  # no match: the first free slot


@pytest.fixture(scope="module")
def engines(tiny_batch_package) -> tuple[Engine, Engine]:
    """(reusing, cold): two engines of the tiny package with a draft on the target's cache."""
    return Engine.load(tiny_batch_package), Engine.load(tiny_batch_package)


def test_reused_prefix_gives_the_logits_of_a_full_prefill(engines):
    """The runner level: a prompt run from where a longer earlier one diverges scores as the
    whole prompt does on an empty cache."""
    engine, cold = engines
    vocab = engine.target.vocab_size
    first, second = _ids(1, 40, vocab), _ids(2, 30, vocab)
    engine.target.forward(first, 0)
    prompt = first[:25] + second
    start = engine.target.cached.reusable(0, prompt)
    assert start == 25
    got = engine.target.forward(prompt[start:], start, all_logits=True)
    want = cold.target.forward(prompt, 0, all_logits=True)[start:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "config",
    [
        GREEDY,
        GenerationConfig(max_new_tokens=12, ignore_eos=True, speculative="draft"),
        GenerationConfig(max_new_tokens=12, ignore_eos=True, speculative="ngram"),
        GenerationConfig(
            max_new_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=3)
        ),
    ],
    ids=["greedy", "draft", "ngram", "sampled"],
)
def test_a_conversation_reuses_each_turn_and_matches_cold_runs(engines, config):
    """Three turns, each prompt the last one + its answer + a new message: every turn after
    the first runs only what is new, and outputs what the same prompt does from scratch.
    With a draft on the target's cache (its own keys overwritten by each verify) and with
    lookup proposals (rejected ones left in the cache past the accepted tokens)."""
    engine, cold = engines
    vocab = engine.target.vocab_size
    cold_config = GenerationConfig(**{**config.__dict__, "reuse_prefix": False})
    prompt = _ids(10, 20, vocab)
    engine.target.forward(_ids(11, 8, vocab), 0)  # an unrelated earlier request
    held = 0  # prompt tokens the cache must hold: the last turn's prompt and answer
    for turn in range(3):
        result = engine.generate(prompt, config)
        want = cold.generate(prompt, cold_config)
        assert result.token_ids == want.token_ids
        assert want.cached_tokens == 0
        if turn == 0:
            assert result.cached_tokens == 0
        else:  # at least the last prompt, and the last answer but for its final token
            assert result.cached_tokens >= held
        held = len(prompt) + len(result.token_ids) - 1
        prompt = prompt + result.token_ids + _ids(20 + turn, 6, vocab)


def test_the_same_prompt_again_runs_one_token(engines):
    engine, cold = engines
    prompt = _ids(30, 24, engine.target.vocab_size)
    engine.generate(prompt, GREEDY)
    again = engine.generate(prompt, GREEDY)
    assert again.cached_tokens == len(prompt) - 1
    assert again.token_ids == cold.generate(prompt, COLD).token_ids


def test_reuse_off_runs_the_whole_prompt(engines):
    engine, _ = engines
    prompt = _ids(31, 24, engine.target.vocab_size)
    engine.generate(prompt, GREEDY)
    assert engine.generate(prompt, COLD).cached_tokens == 0


@pytest.fixture(scope="module")
def own_draft_package(tiny_checkpoint, project, tmp_path_factory):
    """The tiny target with a draft from another checkpoint, which keeps its own cache."""
    from conftest import TINY_RECIPE
    from tiny import make_tiny_checkpoint

    from aotgen.package.build import build
    from aotgen.recipe import parse_recipe

    tmp = tmp_path_factory.mktemp("own-draft")
    draft = make_tiny_checkpoint(tmp / "draft", seed=7, layers=1)
    data = {"checkpoint": str(tiny_checkpoint), **TINY_RECIPE}
    data["speculative"] = {"draft": {"checkpoint": str(draft)}}
    return build(parse_recipe(data, "tiny-own-draft", tmp), project).path


def test_a_draft_with_its_own_cache_reuses_its_rows(own_draft_package):
    """A draft from another checkpoint keeps its own cache: its record too lets the next turn
    run only what is new, and the output equals a cold run."""
    engine, cold = Engine.load(own_draft_package), Engine.load(own_draft_package)
    assert not engine.draft.shares_cache
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, speculative="draft")
    prompt = _ids(40, 20, engine.target.vocab_size)
    first = engine.generate(prompt, config)
    prompt += first.token_ids + _ids(41, 5, engine.target.vocab_size)
    assert engine.draft.cached.prefix(0, prompt) >= len(prompt) - 5 - 1
    result = engine.generate(prompt, config)
    want = cold.generate(prompt, GenerationConfig(**{**config.__dict__, "reuse_prefix": False}))
    assert result.cached_tokens > 0
    assert result.token_ids == want.token_ids


SYSTEM = 30  # tokens of the system prompt the requests below share


@pytest.mark.parametrize("speculative", [None, "draft"])
def test_requests_running_at_once_share_their_system_prompt(tiny_batch_package, speculative):
    """Three requests with one system prompt, submitted together: the first runs it, each
    later one copies it from the row of a request still running; ids equal cold runs (the
    draft reads the target's cache, so it reads the copied rows too)."""
    batch, cold = BatchEngine.load(tiny_batch_package), Engine.load(tiny_batch_package)
    vocab = batch.target.vocab_size
    system = _ids(60, SYSTEM, vocab)
    prompts = [system + _ids(61 + i, 4 + i, vocab) for i in range(3)]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, speculative=speculative)
    results = batch.generate_many(prompts, config)
    assert [r.cached_tokens for r in results] == [0, SYSTEM, SYSTEM]
    cold_config = GenerationConfig(**{**config.__dict__, "reuse_prefix": False})
    assert [r.token_ids for r in results] == [
        cold.generate(p, cold_config).token_ids for p in prompts
    ]


def test_a_failed_prefix_copy_ends_its_request_only(tiny_batch_package, monkeypatch):
    """A prefix copy that fails ends that request with the error; the engine goes on and the
    requests beside it answer as cold runs do."""
    batch, cold = BatchEngine.load(tiny_batch_package), Engine.load(tiny_batch_package)
    vocab = batch.target.vocab_size
    prompts = [_ids(70 + i, 6 + i, vocab) for i in range(3)]
    share = batch.target.share_prefix

    def failing(slot, prompt):
        if prompt == prompts[1][:-1]:  # the engine asks for all but the last token
            raise RuntimeError("copy failed")
        return share(slot, prompt)

    monkeypatch.setattr(batch.target, "share_prefix", failing)
    results = batch.generate_many(prompts, GREEDY)
    assert [r.finish_reason for r in results] == ["length", "error", "length"]
    assert results[1].error == "RuntimeError: copy failed" and not results[1].token_ids
    for i in (0, 2):
        assert results[i].token_ids == cold.generate(prompts[i], COLD).token_ids


def test_requests_found_whole_in_the_cache_start_in_one_step(tiny_batch_package):
    """Four requests with one 24-token prompt: the first runs it in two prefill chunks (16,
    then 8); the next step the other three copy all but its last token, which they run
    together in that step's decode: all three first tokens in one step. Ids equal cold."""
    batch, cold = BatchEngine.load(tiny_batch_package), Engine.load(tiny_batch_package)
    prompt = _ids(80, 24, batch.target.vocab_size)
    results = []
    for _ in range(4):
        batch.submit(prompt, GREEDY, on_done=results.append)
    seqs = list(batch.scheduler.waiting)
    first_step, step = {}, 0
    while batch.step():
        step += 1
        first_step |= {s.id: step for s in seqs if s.first_token and s.id not in first_step}
    assert [first_step[s.id] for s in seqs] == [2, 3, 3, 3]
    assert sorted(r.cached_tokens for r in results) == [0, 23, 23, 23]
    assert [r.token_ids for r in results] == [cold.generate(prompt, COLD).token_ids] * 4


def test_a_draft_with_its_own_cache_shares_rows_too(own_draft_package, monkeypatch):
    """With its own cache, the draft copies the shared prefix into the new request's row as
    the target does: every row whose record claims the system prompt holds the keys and
    values a cold draft computes for it."""
    batch, cold = BatchEngine.load(own_draft_package), Engine.load(own_draft_package)
    vocab = batch.target.vocab_size
    system = _ids(70, SYSTEM, vocab)
    prompts = [system + _ids(71 + i, 5, vocab) for i in range(2)]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, speculative="draft")
    draft = batch.engine.draft
    runs, forward = [], draft.forward
    monkeypatch.setattr(
        draft,
        "forward",
        lambda tokens, start, **kw: runs.append(start) or forward(tokens, start, **kw),
    )
    results = batch.generate_many(prompts, config)
    assert [r.cached_tokens for r in results] == [0, SYSTEM]
    assert runs.count(0) == 1  # the second request's draft prompt starts past the system
    cold_config = GenerationConfig(**{**config.__dict__, "reuse_prefix": False})
    assert [r.token_ids for r in results] == [
        cold.generate(p, cold_config).token_ids for p in prompts
    ]
    holding = [s for s in range(batch.slots) if draft.cached.prefix(s, system) == SYSTEM]
    assert len(holding) == 2
    cold.draft.forward(system, 0)
    for mine, theirs in zip(draft.caches, cold.draft.caches, strict=True):
        for slot in holding:
            torch.testing.assert_close(mine[slot, :, :SYSTEM], theirs[0, :, :SYSTEM])


def test_batch_engine_gives_a_request_the_slot_holding_its_conversation(tiny_batch_package):
    """Two conversations in a 4-slot engine: each next turn takes the slot of its first turn
    and runs only what is new; outputs equal cold single-request runs."""
    batch = BatchEngine.load(tiny_batch_package)
    cold = Engine.load(tiny_batch_package)
    vocab = batch.target.vocab_size
    prompts = [_ids(50, 18, vocab), _ids(51, 22, vocab)]
    firsts = batch.generate_many(prompts, GREEDY)
    assert [r.cached_tokens for r in firsts] == [0, 0]
    turns = [
        p + r.token_ids + _ids(52 + i, 4, vocab)
        for i, (p, r) in enumerate(zip(prompts, firsts, strict=True))
    ]
    seconds = batch.generate_many(turns[::-1], GREEDY)[::-1]
    for prompt, first, second in zip(prompts, firsts, seconds, strict=True):
        assert second.cached_tokens >= len(prompt) + len(first.token_ids) - 1
    assert [r.token_ids for r in seconds] == [cold.generate(t, COLD).token_ids for t in turns]


CHAT = ["The quick brown fox", "and then?", "1 2 3 4 5 6 7 8"]


def test_a_warmed_cache_holds_nothing_to_reuse(tiny_batch_package):
    """`warm_cache` (what `serve` does before serving) writes every row, so it forgets what
    they held: a request after it finds nothing, and equals a cold run."""
    batch, cold = BatchEngine.load(tiny_batch_package), Engine.load(tiny_batch_package)
    prompt = _ids(90, 20, batch.target.vocab_size)
    batch.generate_many([prompt], GREEDY)
    batch.warm_cache()
    assert all(not row for row in batch.target.cached.rows)
    assert all(not c.any() for c in batch.target.caches)
    again = batch.generate_many([prompt], GREEDY)[0]
    assert again.cached_tokens == 0
    assert again.token_ids == cold.generate(prompt, COLD).token_ids


def test_run_interactive_is_one_conversation(tiny_package, tmp_path):
    """`aotgen run --interactive`: each stdin line a turn; each turn's prompt, cached count and
    ids equal the Python engine's on the same chat, and its ids a cold run's."""
    args = ["run", str(tiny_package), "--interactive", "--json", "--max-new-tokens", "12"]
    proc = aotgen(*args, "--ignore-eos", cwd=tmp_path, stdin="\n".join(CHAT) + "\n")
    printed = [json.loads(line) for line in proc.stdout.splitlines()]
    check_conversation(printed, tiny_package, CHAT, GREEDY)


# Long enough that the chat outgrows the tiny package's context (160 positions).
LONG_CHAT = [f"turn {i}: " + "the quick brown fox jumps over the lazy dog " * 3 for i in range(6)]


def test_run_interactive_drops_the_oldest_turns_past_the_context(tiny_package, tmp_path):
    """A chat longer than the context goes on: each turn that would not fit drops the oldest
    turns, as the Python engine's reference does; ids equal cold runs."""
    args = ["run", str(tiny_package), "--interactive", "--json", "--max-new-tokens", "12"]
    proc = aotgen(*args, "--ignore-eos", cwd=tmp_path, stdin="\n".join(LONG_CHAT) + "\n")
    printed = [json.loads(line) for line in proc.stdout.splitlines()]
    check_conversation(printed, tiny_package, LONG_CHAT, GREEDY)
    assert all(len(p["prompt_ids"]) + 12 <= 160 for p in printed)
    first, last = printed[0]["prompt_ids"], printed[-1]["prompt_ids"]
    assert last[: len(first)] != first  # the first turn was dropped


def test_bench_turns_reports_reuse_and_equal_answers(tiny_package):
    """`aotgen bench --turns`: from the second turn on, the chat so far is found in the cache,
    and the reusing engine answers as the one that runs every prompt whole."""
    from aotgen.bench_chat import bench_chat

    # Two turns: the tiny tokenizer spends many tokens on the shipped prompts (160 in all).
    rows = bench_chat(tiny_package, turns=2, gen_tokens=8, runs=1, threads=None)
    assert [r.turn for r in rows] == [1, 2]
    assert rows[0].cached_tokens == 0
    # At least the first prompt (a random model's answer may encode back to other ids).
    assert rows[0].prompt_tokens <= rows[1].cached_tokens < rows[1].prompt_tokens
    assert all(r.same_text for r in rows)


def test_bench_shared_prompt_finds_the_prompt_in_the_cache(tiny_batch_package, tmp_path):
    """`aotgen bench --concurrency --shared-prompt`: in the shared runs every request but the
    first finds all of the prompt but its last token, in the others none; the same answers."""
    from aotgen.bench_serving import _one_level

    batch = BatchEngine.load(tiny_batch_package)
    shared = _one_level(batch, 3, 20, 6, 0, shared=True).results
    alone = _one_level(batch, 3, 20, 6, 0, shared=False).results[:1]
    assert sorted(r.cached_tokens for r in shared) == [0, 19, 19]
    assert [r.token_ids for r in shared] == [alone[0].token_ids] * 3
    args = ["--concurrency", "1,3", "--shared-prompt", "--prompt-len", "20", "--gen-tokens", "4"]
    proc = aotgen("bench", str(tiny_batch_package), *args, "--runs", "1", "--json", cwd=tmp_path)
    rows = json.loads(proc.stdout)["concurrency"]
    name = tiny_batch_package.name
    assert [(r["name"], r["concurrency"]) for r in rows] == [
        (f"{name} {mode}", level) for level in (1, 3) for mode in ("shared", "per request")
    ]
    assert all(r["aggregate_tok_s"] > 0 and r["all_first_ms"] > 0 for r in rows)
