"""Qwen3.5 (linear attention by the gated delta rule beside gated full attention) against
transformers: the compiled graphs' logits, greedy text plain and speculative (rejected rows
left in the rings), the next chat turn reusing the row, a branch from further back than the
rings hold, batched sequences in their own slots, and the C++ runtime; and the recipes such
a model refuses. The tiny checkpoint is tests/families.py's `qwen3_5`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import stop_warming
from families import RECIPE, load_reference, make_family_checkpoint, reference_greedy
from families import reference_logits as _reference_logits
from reference import EagerModel, reset_caches
from test_cpp_batch import cpp_results, request_json, run_batch
from test_cpp_runtime import cpp_generate
from test_families import cpp_matches_python_on_a_ring

from aotgen.bench import package_kv_bytes
from aotgen.checkpoint.hf import open_checkpoint
from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
from aotgen.package.build import build
from aotgen.package.manifest import kv_position_bytes
from aotgen.package.models import prepare_models
from aotgen.passes.tp import parse_parallel, resolve_plan
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig

pytest.importorskip("transformers")

FP32_TOL = 1e-4  # as test_families.py: compiled fp32 against transformers' eager fp32
# Batched graphs, and a draft of the first two layers on a ring of its own.
EXTRA = {"max_batch": 2, "speculative": {"draft": {"layers": 2}, "k": 4, "share_kv": False}}
# The packages this module builds (tests/real_builds.py compiles them ahead: `qwen3_5_build`).
PACKAGES = {"qwen3_5": {**RECIPE, **EXTRA}, "qwen3_5-bf16": {**RECIPE, "dtype": "bfloat16"}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_family_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


@pytest.fixture(scope="module")
def qwen3_5_build(request, checkpoint, project) -> Callable[[str], Engine]:
    """One of PACKAGES, built and loaded; the builds take what the background compiled."""
    stop_warming(request, "qwen3_5")

    def build_package(name: str) -> Engine:
        data = {"checkpoint": str(checkpoint), **PACKAGES[name]}
        return Engine.load(build(parse_recipe(data, name, Path(".")), project).path)

    return build_package


@pytest.fixture(scope="module")
def engine(qwen3_5_build) -> Engine:
    return qwen3_5_build("qwen3_5")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_manifest_records_the_rings(engine):
    """Linear-attention layers keep 12 cells (the 8-row verify room + the 4-wide
    convolution) of convolution inputs and of states; the attention layer every position."""
    kv = engine.manifest["models"]["target"]["kv_cache"]
    assert kv["ring"] == {"cells": 12, "window": 4}
    assert kv["shapes"][:2] == [[1, 1, 12, 2 * 2 * 16 + 4 * 16], [1, 4, 12, 16 * 16]]
    assert kv["shapes"][4] == [1, 2, kv["cache_len"], 32]


def test_bench_counts_one_state_per_linear_layer(engine):
    """A decode step reads one state (and a few convolution inputs) of each linear-attention
    layer however long the context: 100 more positions add only the attention layer's keys
    and values."""
    entry = engine.manifest["models"]["target"]
    per_position = kv_position_bytes(entry["kv_cache"])
    grown = package_kv_bytes(entry, 200, 10) - package_kv_bytes(entry, 100, 10)
    assert grown == 100 * per_position[2]  # layer 2 attends


@pytest.mark.parametrize(
    "graph,start,length",
    [("prefill", 0, 14), ("prefill", 7, 16), ("decode", 21, 1), ("verify", 17, 5)],
)
def test_graph_logits_match_transformers(engine, reference, graph, start, length):
    """Each graph after the package's own prefill of the prefix: transformers' logits. The
    16-row prefill is longer than the rings (12 cells), so its first rows' states are not
    kept and the next call still reads the right ones."""
    got, want = _graph_and_reference(engine.target, reference, graph, start, length)
    assert got.shape == want.shape
    assert _rel_err(got, want) < FP32_TOL


def _graph_and_reference(runner, reference, graph: str, start: int, length: int):
    """One graph's logits on random tokens after the package's own prefill of `start` of
    them, and transformers' logits of the same rows (the prefill graph's last row)."""
    g = torch.Generator().manual_seed(start + length)
    history = torch.randint(0, runner.vocab_size, (start + length,), generator=g).tolist()
    want = _reference_logits(reference, history)[start:]
    reset_caches(runner)
    if start:
        runner.forward(history[:start], 0)
    tokens = torch.tensor([history[start:]])
    got = runner.graphs[graph](tokens, torch.arange(start, start + length), runner.caches)[0]
    return got, want[-1:] if graph == "prefill" else want


def test_generates_and_reuses_like_transformers(engine, reference):
    """Greedy text, plain, with n-gram speculation and with the draft (rejected rows'
    states left in the rings) equals transformers'; the next chat turn reuses the row; a
    prompt that branches further back than the rings hold runs from the start."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, engine.target.vocab_size, (30,), generator=g).tolist()
    prompt += prompt[:12]  # something for n-gram proposals to find
    want = reference_greedy(reference, prompt, 40)
    accepted = 0
    for lookup in (None, "ngram", "draft"):
        cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True, speculative=lookup)
        got = engine.generate(prompt, cfg)
        assert got.token_ids == want, lookup
        accepted += got.spec.accepted if lookup else 0
        turn = [*prompt, *want, 5, 6, 7]
        got = engine.generate(turn, replace(cfg, max_new_tokens=8))
        assert got.cached_tokens >= len(prompt) + len(want) - 1
        assert got.token_ids == reference_greedy(reference, turn, 8)
        branch = prompt[:20] + [9]
        got = engine.generate(branch, replace(cfg, max_new_tokens=8))
        assert got.cached_tokens == 0  # the rings no longer hold positions 17..19
        assert got.token_ids == reference_greedy(reference, branch, 8)
    assert accepted > 0  # speculation did run, rows were accepted


def test_batch_engine_matches_transformers(engine, reference):
    """Three requests through the batched graphs, two slots: each sequence's rings in its
    own row; the second request shares the first's prefix, copied with its rings."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, engine.target.vocab_size, (26,), generator=g).tolist()
    prompts = [prompt, prompt[:18], prompt[5:]]
    batch = BatchEngine.load(engine.root)
    results = batch.generate_many(prompts, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == [reference_greedy(reference, p, 24) for p in prompts]
    assert results[1].cached_tokens == 17  # copied from the first request's row, rings too


@pytest.mark.cpp
def test_cpp_runtime_matches_python(run_bin, batch_bin, engine, tmp_path):  # noqa: F811
    """As on Gemma 3's ring (test_families' `cpp_matches_python_on_a_ring`), and aotgen-batch
    on two slots, a prefix copied from a running request's row, gets Python's ids and cached
    counts."""
    cpp_matches_python_on_a_ring(run_bin, batch_bin, engine, tmp_path)
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, engine.target.vocab_size, (30,), generator=g).tolist()
    # Two slots, the batched graphs: the second request copies the first one's row.
    prompts = [prompt[:26], prompt[:18], prompt[5:26]]
    config = GenerationConfig(24, ignore_eos=True)
    want = BatchEngine.load(engine.root).generate_many(prompts, config)
    requests = [request_json(p, config) for p in prompts]
    got = cpp_results(run_batch(batch_bin, engine.root, requests, tmp_path, "--slots", "2"))[0]
    assert [r["ids"] for r in got] == [w.token_ids for w in want]
    assert [r["cached_tokens"] for r in got] == [w.cached_tokens for w in want]
    assert want[1].cached_tokens == 17


@pytest.fixture(scope="module")
def bf16_engine(qwen3_5_build) -> Engine:
    return qwen3_5_build("qwen3_5-bf16")


BF16_TOL = 2e-2  # as test_moe.py's bfloat16 package against the float32 model


def test_bfloat16_package_keeps_float32_states(bf16_engine, reference):
    """A bfloat16 package: weights, keys, values and convolution inputs in bfloat16, the
    recurrent states float32 (the manifest's `dtypes`, the runtime's caches). Each graph
    within bfloat16 rounding of transformers' float32 logits; n-gram speculation gives the
    package's own greedy text."""
    runner = bf16_engine.target
    kv = bf16_engine.manifest["models"]["target"]["kv_cache"]
    state = [i % 2 == 1 and i != 5 for i in range(8)]  # layer 2 attends
    assert kv["dtypes"] == ["float32" if s else "bfloat16" for s in state]
    assert [c.dtype for c in runner.caches] == [
        torch.float32 if s else torch.bfloat16 for s in state
    ]
    for graph, start, length in [("prefill", 0, 14), ("decode", 21, 1), ("verify", 17, 5)]:
        got, want = _graph_and_reference(runner, reference, graph, start, length)
        assert _rel_err(got.float(), want) < BF16_TOL, graph
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, runner.vocab_size, (30,), generator=g).tolist()
    plain = bf16_engine.generate(prompt, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True, speculative="ngram")
    assert bf16_engine.generate(prompt, cfg).token_ids == plain.token_ids


@torch.no_grad()
def test_bfloat16_cache_of_a_float32_model(checkpoint, reference):
    """`kv_cache_dtype: bfloat16` on a float32 model: keys, values and convolution inputs
    rounded to bfloat16, the states float32; logits within bfloat16 rounding of
    transformers'."""
    ckpt = open_checkpoint(checkpoint)
    cfg = ModelConfig.from_hf(ckpt.config)
    model = load_model(cfg, ckpt.load_weights(), 96, torch.float32)
    caches = new_kv_cache(cfg, 96, torch.bfloat16, ring_cells=12)
    assert [c.dtype for c in caches][:2] == [torch.bfloat16, torch.float32]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()
    want = _reference_logits(reference, ids)
    got = [model(torch.tensor([ids[:32]]), torch.arange(32), caches)[0]]
    got += [model(torch.tensor([[t]]), torch.tensor([32 + i]), caches)[0] for i, t in
            enumerate(ids[32:])]  # fmt: skip
    assert _rel_err(torch.cat(got), want) < BF16_TOL


@pytest.mark.cpp
def test_cpp_runtime_runs_a_bfloat16_package(run_bin, bf16_engine):  # noqa: F811
    """aotgen-run allocates each cache tensor in its manifest dtype: its greedy and n-gram
    ids on the bfloat16 package equal Python's."""
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(3, bf16_engine.target.vocab_size, (30,), generator=g).tolist()
    for args in ([], ["--lookup", "ngram"]):
        cfg = GenerationConfig(
            max_new_tokens=24, ignore_eos=True, speculative="ngram" if args else None
        )
        got = cpp_generate(
            run_bin, bf16_engine.root, prompt, "--max-new-tokens", "24", "--ignore-eos", *args
        )
        want = bf16_engine.generate(prompt, replace(cfg, reuse_prefix=False)).token_ids
        assert got["ids"] == want, args


@torch.no_grad()
def test_eager_batch_keeps_each_sequence_in_its_row(checkpoint):
    """An eager forward of two sequences (distillation's batches) reads and writes each one's
    rings in its own cache row: a second call, which reads what the first left there, gives
    each row the logits of its sequence run alone."""
    eager = EagerModel(checkpoint, 96)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, eager.config.vocab_size, (2, 24), generator=g)
    caches = new_kv_cache(eager.config, 96, batch=2)
    eager.model(tokens[:, :20], torch.arange(20), caches)
    both = eager.model(tokens[:, 20:], torch.arange(20, 24), caches)
    for i in range(2):
        eager.reset()
        eager.model(tokens[i : i + 1, :20], torch.arange(20), eager.caches)
        alone = eager.model(tokens[i : i + 1, 20:], torch.arange(20, 24), eager.caches)[0]
        assert torch.allclose(both[i], alone, atol=1e-5)


@pytest.mark.parametrize(
    "extra,named",
    [
        ({"formats": ["aoti", "onnx"]}, "ONNX"),
        ({"tree_nodes": 4}, "tree"),
        ({"kv_cache_dtype": "int8"}, "int8 cache"),
        ({"speculative": {"draft": {"layers": 2}}}, "share_kv: false"),
    ],
)
def test_refused_recipes_name_the_fix(checkpoint, extra, named):
    """What the rings cannot serve is one line naming it and what to change."""
    data = {"checkpoint": str(checkpoint), **RECIPE, **extra}
    with pytest.raises(RecipeError, match=named) as err:
        prepare_models(
            parse_recipe(data, "qwen3_5-refused", Path(".")), open_checkpoint(checkpoint)
        )
    assert "\n" not in str(err.value)


def test_tensor_parallel_is_refused(checkpoint):
    model = prepare_models(
        parse_recipe({"checkpoint": str(checkpoint), **RECIPE}, "q", Path(".")),
        open_checkpoint(checkpoint),
    )[0].model
    with pytest.raises(RecipeError, match="not sharded"):
        resolve_plan(model, parse_parallel({"tensor": 2}))
