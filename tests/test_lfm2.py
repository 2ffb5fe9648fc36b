"""LFM2's convolution layers against transformers where the cache matters: a token tree
(each node's earlier positions are its ancestors, not the rows before it), batch slots, and a
compiled package speculating (draft on the shared cache, n-gram, trees), batching and reusing
prefixes. The convolutions' inputs are cached by position like keys and values, so each of
these must give the plain, cold, single-sequence answer.

Graph-by-graph parity, greedy, ONNX and C++: tests/test_families.py ("lfm2")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from families import load_reference, make_family_checkpoint, reference_greedy, reference_logits
from test_kv_dtype import EagerOnCache
from test_tree import SHAPES, make_tree, path_to

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
from aotgen.package.build import build
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.tree import commit_path
from aotgen.runtime.tree_draft import TreeParams

pytest.importorskip("transformers")

CACHE_LEN = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_family_checkpoint(tmp_path_factory.mktemp("lfm2") / "lfm2", "lfm2")


@pytest.fixture(scope="module")
def eager(checkpoint):
    ckpt = open_checkpoint(checkpoint)
    cfg = ModelConfig.from_hf(ckpt.config)
    return load_model(cfg, ckpt.load_weights(), CACHE_LEN, torch.float32), cfg


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(5, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_rows_read_their_ancestors(checkpoint, eager, shape):
    """Each node's logits are transformers' for the prompt and its root-to-node path; after
    `commit_path` the cache holds what running the path alone writes (convolution inputs
    included)."""
    model, cfg = eager
    reference = load_reference(checkpoint)
    prompt = _ids(0, 9, cfg.vocab_size)
    start = len(prompt)
    tree = make_tree(SHAPES[shape], seed=1, vocab=cfg.vocab_size)
    caches = new_kv_cache(cfg, CACHE_LEN)
    model(torch.tensor([prompt]), torch.arange(start), caches)
    depths = torch.tensor(tree.depths)
    logits = model(torch.tensor([tree.tokens]), start + depths, caches, tree.mask())[0]
    for node in range(len(tree)):
        path = path_to(tree, node)
        want = reference_logits(reference, prompt + [tree.tokens[i] for i in path])[-1]
        torch.testing.assert_close(logits[node], want, rtol=1e-4, atol=1e-4)
        if tree.children(node):
            continue
        ref_caches = new_kv_cache(cfg, CACHE_LEN)
        model(
            torch.tensor([prompt + [tree.tokens[i] for i in path]]),
            torch.arange(start + len(path)),
            ref_caches,
        )
        committed = [c.clone() for c in caches]
        commit_path(committed, start, path)
        end = start + len(path)
        for got, want_cache in zip(committed, ref_caches, strict=True):
            torch.testing.assert_close(
                got[:, :, :end], want_cache[:, :, :end], rtol=1e-5, atol=1e-5
            )


@torch.no_grad()
def test_batch_rows_read_their_own_slots(eager):
    """Three sequences at different positions in slots 3, 0, 2 of a 4-slot cache give the
    logits each gets alone, one row and three at a time."""
    model, cfg = eager
    prompts = [_ids(s, n, cfg.vocab_size) for s, n in ((1, 5), (2, 11), (3, 2))]
    slots = [3, 0, 2]
    alone = [new_kv_cache(cfg, CACHE_LEN) for _ in prompts]
    batch = new_kv_cache(cfg, CACHE_LEN, batch=4)
    for p, s, cache in zip(prompts, slots, alone, strict=True):
        model(torch.tensor([p]), torch.arange(len(p)), cache)
        model(torch.tensor([p]), torch.arange(len(p)), [c[s : s + 1] for c in batch])
    for t in (1, 3, 1):
        tokens = torch.randint(5, cfg.vocab_size, (3, t))
        positions = torch.tensor([[len(p) + i for i in range(t)] for p in prompts])
        got = model(tokens, positions, batch, None, torch.tensor(slots))
        for i, cache in enumerate(alone):
            want = model(tokens[i : i + 1], positions[i], cache)[0]
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
        prompts = [p + tokens[i].tolist() for i, p in enumerate(prompts)]


def test_conv_layers_refuse_tensor_parallel(checkpoint, project):
    data = {"checkpoint": str(checkpoint), "max_seq_len": 64, "parallel": {"tensor": 2}}
    with pytest.raises(RecipeError, match="convolution"):
        build(parse_recipe(data, "lfm2-tp", Path(".")), project)


# ---- a compiled package: speculation, trees, batches, prefixes --------------------------------
@pytest.fixture(scope="module")
def package(checkpoint, project) -> Path:
    """Its first two layers (a convolution, then attention) as a draft on the target's cache,
    an 8-row tree graph and batched graphs for 3 sequences."""
    data = {
        "checkpoint": str(checkpoint),
        "max_seq_len": 96,
        "prefill_chunk": 16,
        "verify_k": 4,
        "tree_nodes": 8,
        "max_batch": 3,
        "speculative": {"draft": {"layers": 2}},
    }
    return build(parse_recipe(data, "lfm2-spec", Path(".")), project).path


GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)
# Repetitive prompts give n-gram lookup something to propose.
PROMPTS = [[7, 8, 9, 10, 11] * 4, [20, 21, 22] * 5 + [23], [30 + i % 7 for i in range(26)]]


def test_speculation_and_trees_give_transformers_greedy(checkpoint, package):
    engine = Engine.load(package)
    reference = load_reference(checkpoint)
    for ids in PROMPTS:
        want = reference_greedy(reference, ids, 24)
        assert engine.generate(ids, GREEDY).token_ids == want
        for mode in ("draft", "ngram", "draft+ngram"):
            for tree in (None, TreeParams(4, 0.1)):
                config = GenerationConfig(
                    max_new_tokens=24, ignore_eos=True, speculative=mode, k=4, tree=tree
                )
                result = engine.generate(ids, config)
                assert result.token_ids == want, (ids, mode, tree)


def test_int8_cache_codes_the_convolution_inputs_too(checkpoint, project):
    """`kv_cache_dtype: int8` stores the convolution layers' cached inputs as coded rows like
    keys and values: greedy, plain and speculating, equals the eager model's on such a cache."""
    data = {"checkpoint": str(checkpoint), "max_seq_len": 96, "prefill_chunk": 16}
    data |= {"kv_cache_dtype": "int8", "speculative": {"draft": {"layers": 2}}}
    engine = Engine.load(build(parse_recipe(data, "lfm2-int8-kv", Path(".")), project).path)
    hidden = engine.target.config["hidden_size"]
    assert engine.target.caches[0].shape[-1] == hidden // 2 + 4  # layer 0: a convolution
    eager = EagerOnCache(checkpoint, engine.target.cache_len, torch.int8)
    for ids in PROMPTS:
        want = eager.greedy(ids, 24)
        for mode in (None, "draft", "ngram"):
            config = GenerationConfig(max_new_tokens=24, ignore_eos=True, speculative=mode)
            assert engine.generate(ids, config).token_ids == want, (ids, mode)


def test_batch_and_reused_prefixes_equal_cold_runs(package):
    """Five requests on three slots (draft speculation in the batch), then a conversation whose
    every turn runs only what is new: the ids of cold single-sequence runs."""
    batch, cold = BatchEngine.load(package), Engine.load(package)
    vocab = cold.target.vocab_size
    prompts = [_ids(40 + i, 6 + 5 * i, vocab) for i in range(5)]
    cold_config = GenerationConfig(max_new_tokens=16, ignore_eos=True, reuse_prefix=False)
    for speculative in (None, "draft"):
        config = GenerationConfig(max_new_tokens=16, ignore_eos=True, speculative=speculative)
        got = [r.token_ids for r in batch.generate_many(prompts, config)]
        assert got == [cold.generate(p, cold_config).token_ids for p in prompts]
    engine = Engine.load(package)
    prompt = _ids(50, 12, vocab)
    for turn in range(3):
        result = engine.generate(prompt, GREEDY)
        assert (
            result.token_ids
            == cold.generate(
                prompt, GenerationConfig(**{**GREEDY.__dict__, "reuse_prefix": False})
            ).token_ids
        )
        assert (result.cached_tokens > 0) == (turn > 0)
        prompt = prompt + result.token_ids + _ids(51 + turn, 5, vocab)


@pytest.mark.cpp
def test_cpp_runtime_speculates_on_convolution_caches(run_bin, package):
    """aotgen-run on the same package: draft, n-gram and tree speculation give the Python
    runtime's ids and acceptance counts (and so transformers' greedy tokens)."""
    from test_cpp_runtime import cpp_generate

    engine = Engine.load(package)
    modes = {
        "draft": ["--speculative"],
        "ngram": ["--lookup", "ngram"],
        "tree": ["--speculative", "--draft-parallel", "4", "--p-split", "0.1"],
    }
    for ids in PROMPTS:
        for mode, flags in modes.items():
            tree = TreeParams(4, 0.1) if mode == "tree" else None
            speculative = "ngram" if mode == "ngram" else "draft"
            config = GenerationConfig(
                max_new_tokens=24, ignore_eos=True, speculative=speculative, k=4, tree=tree
            )
            want = engine.generate(ids, config)
            args = ["--max-new-tokens", "24", "--ignore-eos", "--k", "4", *flags]
            got = cpp_generate(run_bin, package, ids, *args)
            assert got["ids"] == want.token_ids, (ids, mode)
            assert got["spec"]["accepted"] == want.spec.accepted, (ids, mode)
