"""Batched graphs and the continuous-batching engine: the batched forward against separate
single-sequence forwards (eager, every family kind), the compiled batched graphs against
eager, and every request served in a batch against the same request served alone."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE
from families import make_family_checkpoint
from reference import EagerModel, reset_caches

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
from aotgen.package.manifest import PackageError
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationError
from aotgen.runtime.sampling import SamplingParams
from aotgen.runtime.scheduler import QueueFull

GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (n,), generator=g).tolist()
    return [torch.randint(5, vocab, (m,), generator=g).tolist() for m in lengths]


# ---- the batched forward (eager) -----------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma3", "gptneox-parallel"])
def test_batched_forward_equals_single_sequences(tmp_path, family):
    """Three sequences at different positions in slots 3, 0, 2 of a 4-slot cache give the
    logits each gets alone, for one row (decode) and three (verify); gemma3's sliding window
    (8) is shorter than the prompts."""
    ckpt = open_checkpoint(make_family_checkpoint(tmp_path / family, family))
    cfg = ModelConfig.from_hf(ckpt.config)
    model = load_model(cfg, ckpt.load_weights(), 64, torch.float32)
    prompts = _prompts(3, cfg.vocab_size, seed=1)
    slots = [3, 0, 2]
    alone = [new_kv_cache(cfg, 64) for _ in prompts]
    batch = new_kv_cache(cfg, 64, batch=4)
    with torch.no_grad():
        for p, s, cache in zip(prompts, slots, alone, strict=True):
            model(torch.tensor([p]), torch.arange(len(p)), cache)
            model(torch.tensor([p]), torch.arange(len(p)), [c[s : s + 1] for c in batch])
        for t in (1, 3, 1):
            tokens = torch.randint(5, cfg.vocab_size, (3, t))
            pos = [len(p) for p in prompts]
            positions = torch.tensor([[q + i for i in range(t)] for q in pos])
            got = model(tokens, positions, batch, None, torch.tensor(slots))
            for i, cache in enumerate(alone):
                want = model(tokens[i : i + 1], positions[i], cache)[0]
                torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
            prompts = [p + tokens[i].tolist() for i, p in enumerate(prompts)]


# ---- compiled batched graphs ---------------------------------------------------------------
@pytest.fixture(scope="module")
def batch_engine(tiny_batch_package) -> BatchEngine:
    return BatchEngine.load(tiny_batch_package)


@pytest.fixture(scope="module")
def alone(tiny_batch_package) -> Engine:
    return Engine.load(tiny_batch_package)


def test_manifest_lists_the_batched_graphs(batch_engine):
    graphs = batch_engine.engine.manifest["models"]["target"]["graphs"]
    assert graphs["batch_decode"]["batch"] == {"min": 2, "max": 4}
    assert graphs["batch_verify"]["tokens"]["max"] == TINY_RECIPE["verify_k"] + 1
    assert batch_engine.slots == 4
    assert list(batch_engine.target.caches[0].shape)[0] == 4


def batched_and_eager(
    target, checkpoint, graph: str, t: int, cache_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batched graph's logits for three sequences in slots 2, 0, 3 of the 4-slot
    `target`, and the eager model's on a cache of `cache_dtype`, after the same prompts."""
    eager = EagerModel(checkpoint, target.cache_len)
    eager.caches = new_kv_cache(eager.config, target.cache_len, cache_dtype, batch=4)
    reset_caches(target)
    prompts = _prompts(3, eager.config.vocab_size, seed=2)
    slots = [2, 0, 3]
    for p, s in zip(prompts, slots, strict=True):
        target.forward(p, 0, slot=s)
        views = [c[s : s + 1] for c in eager.caches]
        eager.model(torch.tensor([p]), torch.arange(len(p)), views)
    tokens = torch.randint(5, eager.config.vocab_size, (3, t))
    positions = torch.tensor([[len(p) + i for i in range(t)] for p in prompts])
    got = target.batch(graph, tokens, positions, torch.tensor(slots))
    with torch.no_grad():
        want = eager.model(tokens, positions, eager.caches, None, torch.tensor(slots))
    return got, want


@pytest.mark.parametrize("graph,t", [("batch_decode", 1), ("batch_verify", 5)])
def test_batched_graphs_match_eager(batch_engine, tiny_checkpoint, graph, t):
    got, want = batched_and_eager(batch_engine.target, tiny_checkpoint, graph, t)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "config",
    [
        GREEDY,
        GenerationConfig(max_new_tokens=24, ignore_eos=True, speculative="ngram"),
        GenerationConfig(
            max_new_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=0.9, seed=7)
        ),
        GenerationConfig(max_new_tokens=24, ignore_eos=True, speculative="draft"),
        GenerationConfig(
            max_new_tokens=24,
            ignore_eos=True,
            speculative="draft+ngram",
            sampling=SamplingParams(temperature=0.9, seed=11),
        ),
    ],
    ids=["greedy", "ngram", "seeded-sampling", "draft", "draft+ngram-sampled"],
)
def test_batch_equals_each_request_alone(batch_engine, alone, config):
    """Ten requests on four slots: they queue, join and leave; each output is the
    single-request engine's (same graphs for one sequence, batched ones for several)."""
    prompts = _prompts(10, alone.target.vocab_size, seed=3)
    want = [alone.generate(p, config).token_ids for p in prompts]
    got = batch_engine.generate_many(prompts, config)
    assert [r.token_ids for r in got] == want
    assert all(r.finish_reason == "length" for r in got)
    if config.speculative:  # proposals were verified in the batch
        assert sum(r.spec.accepted for r in got) > 0


def test_repetitive_prompts_verify_in_one_batched_call(batch_engine, alone, monkeypatch):
    """Prompts that repeat themselves make lookup propose for several requests in the same
    step: the batch_verify graph runs, and the outputs still equal the requests alone."""
    calls = []
    batch = batch_engine.target.batch
    monkeypatch.setattr(batch_engine.target, "batch", lambda g, *a: calls.append(g) or batch(g, *a))
    base = _prompts(4, alone.target.vocab_size, seed=4)
    prompts = [(p[:6] * 5)[:28] for p in base]
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True, speculative="ngram")
    want = [alone.generate(p, config).token_ids for p in prompts]
    assert [r.token_ids for r in batch_engine.generate_many(prompts, config)] == want
    assert "batch_verify" in calls and "batch_decode" in calls


def test_drafts_step_together_through_the_drafts_batched_graph(batch_engine, alone, monkeypatch):
    """The draft on the target's cache drafts for all requests in one batch_decode call
    per draft step; greedy and sampled outputs still equal each request alone."""
    draft = batch_engine.engine.draft
    assert draft.shares_cache and "batch_decode" in draft.graphs
    calls = []
    batch = draft.batch
    monkeypatch.setattr(draft, "batch", lambda g, *a: calls.append(g) or batch(g, *a))
    prompts = _prompts(4, alone.target.vocab_size, seed=12)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=5)):
        config = GenerationConfig(
            max_new_tokens=20, ignore_eos=True, speculative="draft", sampling=sampling
        )
        want = [alone.generate(p, config).token_ids for p in prompts]
        assert [r.token_ids for r in batch_engine.generate_many(prompts, config)] == want
    assert "batch_decode" in calls


def test_streamed_text_and_stop_strings(batch_engine, alone):
    prompts = _prompts(3, alone.target.vocab_size, seed=5)
    texts = [alone.generate(p, GREEDY).text for p in prompts]
    stop = texts[1][5:8]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True, stop=(stop,))
    streamed = [[] for _ in prompts]
    results = {}
    for i, p in enumerate(prompts):
        batch_engine.submit(
            p, config, on_text=streamed[i].append, on_done=lambda r, i=i: results.update({i: r})
        )
    while batch_engine.step():
        pass
    for i, p in enumerate(prompts):
        want = alone.generate(p, config)
        assert results[i].text == want.text == "".join(streamed[i])
        assert results[i].finish_reason == want.finish_reason
    assert results[1].finish_reason == "stop"


def test_cancel_frees_the_slot_and_spares_the_others(batch_engine, alone):
    prompts = _prompts(5, alone.target.vocab_size, seed=6)
    results = {}
    ids = [
        batch_engine.submit(p, GREEDY, on_done=lambda r, i=i: results.update({i: r}))
        for i, p in enumerate(prompts)
    ]
    for _ in range(4):
        batch_engine.step()
    batch_engine.cancel(ids[0])  # running
    batch_engine.cancel(ids[4])  # still waiting: four slots
    while batch_engine.step():
        pass
    assert results[0].finish_reason == results[4].finish_reason == "cancelled"
    assert results[4].token_ids == []
    for i in (1, 2, 3):
        assert results[i].token_ids == alone.generate(prompts[i], GREEDY).token_ids
    assert sorted(batch_engine.scheduler.free) == [0, 1, 2, 3]


def test_background_thread_serves_concurrent_submitters(batch_engine, alone):
    prompts = _prompts(6, alone.target.vocab_size, seed=8)
    want = [alone.generate(p, GREEDY).text for p in prompts]
    got: dict[int, str] = {}

    def client(i: int) -> None:
        done = threading.Event()
        batch_engine.submit(
            prompts[i], GREEDY, on_done=lambda r: (got.update({i: r.text}), done.set())
        )
        done.wait(60)

    batch_engine.start()
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        batch_engine.close()
    assert [got[i] for i in range(len(prompts))] == want


def test_full_queue_and_bad_requests_are_refused(tiny_batch_package):
    """`max_queue` counts requests beyond the free slots: with no step run yet, 4 slots and a
    queue of 2 take 6 requests (the refusal must not depend on when the next step admits)."""
    engine = BatchEngine.load(tiny_batch_package, max_queue=2)
    for _ in range(4 + 2):
        engine.submit([5, 6], GREEDY)
    with pytest.raises(QueueFull, match="2 requests are already waiting for a slot .max_queue=2"):
        engine.submit([5, 6], GREEDY)
    with pytest.raises(GenerationError, match="exceeds the package context"):
        engine.submit([5] * 150, GREEDY)
    with pytest.raises(GenerationError, match="tree drafting and adaptive k"):
        engine.submit([5, 6], GenerationConfig(max_new_tokens=8, adaptive_k=True))
    with pytest.raises(PackageError, match="serve a cache of 4 slots"):
        BatchEngine.load(tiny_batch_package, slots=3)


def test_package_without_batched_graphs_serves_in_turns(tiny_package):
    """Without batched graphs each request decodes through the single-sequence graph on its
    own slot: the same outputs, one request after another within a step."""
    engine = BatchEngine.load(tiny_package)
    alone = Engine.load(tiny_package)
    prompts = _prompts(6, alone.target.vocab_size, seed=9)
    want = [alone.generate(p, GREEDY).token_ids for p in prompts]
    assert [r.token_ids for r in engine.generate_many(prompts, GREEDY)] == want


@pytest.mark.parametrize(
    "extra,message",
    [({"max_batch": 1}, "max_batch must be 0"), ({"max_batch": "8"}, "max_batch must be 0")],
)
def test_bad_max_batch_is_a_recipe_error(tiny_checkpoint, extra, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({"checkpoint": str(tiny_checkpoint), **extra}, "x", Path("."))


# ---- the real package ------------------------------------------------------------------------
def test_sixteen_concurrent_chat_requests_equal_each_alone(smollm2_serve_package):
    """16 chat requests of different lengths at once on SmolLM2: every answer's text is the
    text the request gets alone (batched fp32 graphs may round differently from the
    single-sequence ones; greedy text must not change)."""
    engine = BatchEngine.load(smollm2_serve_package)
    alone = Engine.load(smollm2_serve_package, slots=1)
    questions = [
        "What is the capital of France?",
        "Name three colors.",
        "Write a haiku about the sea.",
        "What is 12 times 12?",
        "Who wrote Romeo and Juliet?",
        "Give me a synonym for happy.",
        "What is the boiling point of water?",
        "List two planets.",
        "Translate 'thank you' to Spanish.",
        "What do bees make?",
        "How many legs does a spider have?",
        "Say hello in French.",
        "What is the largest ocean?",
        "Name a famous painter.",
        "What color is the sky on a clear day?",
        "What is the opposite of cold?",
    ]
    prompts = [alone.chat_ids(q) for q in questions]
    configs = [GenerationConfig(max_new_tokens=8 + 3 * i) for i in range(len(prompts))]
    want = [alone.generate(p, c).text for p, c in zip(prompts, configs, strict=True)]
    got = engine.generate_many(prompts, configs)
    assert [r.text for r in got] == want
    assert got[0].text == "The capital of France is Paris."
