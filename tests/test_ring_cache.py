"""Sliding-window layers in a ring cache (model/layers.py `_ring`, runtime/cached_tokens.py):
the eager model on ring caches against the same model on full-length caches, in every kind of
call, with the ring wrapped many times; and the prefix-reuse record that decides where a row
can go on. The packages (compiled graphs, both runtimes) are checked in test_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from families import make_family_checkpoint

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.cached_tokens import CachedTokens
from aotgen.runtime.tree import commit_path

pytest.importorskip("transformers")

CACHE_LEN, CHUNK = 104, 16
# A tree of 4 nodes (depths 0, 1, 1, 2): each node sees its ancestors and itself.
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def model(request, tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    ckpt = open_checkpoint(path)
    cfg = ModelConfig.from_hf(ckpt.config)
    return load_model(cfg, ckpt.load_weights(), CACHE_LEN, torch.float32)


def _calls(vocab: int) -> list[tuple]:
    """(tokens, input_pos, tree_mask) of one sequence's life: prefill chunks, then verify
    blocks that accept 1..5 of their rows (the rest stay written until overwritten), each
    followed by a decode, then a tree: 90 positions, the ring's 24 cells wrapped 3 times."""
    ids = torch.randint(0, vocab, (1, 100), generator=torch.Generator().manual_seed(0))
    calls = [(ids[:, s : s + CHUNK], torch.arange(s, s + CHUNK), None) for s in (0, 16, 32)]
    pos = 48
    for step in range(9):
        calls.append((ids[:, pos : pos + 5], torch.arange(pos, pos + 5), None))
        pos += step % 5 + 1
        calls.append((ids[:, pos : pos + 1], torch.arange(pos, pos + 1), None))
        pos += 1
    depths = torch.tensor([0, 1, 1, 2])
    return [*calls, (ids[:, :4], pos + depths, TREE)]


@torch.no_grad()
def _diffs(model, cells: int) -> list[float]:
    """Each call's largest logit difference, ring of `cells` against a full cache."""
    cfg = model.config
    full, ring = new_kv_cache(cfg, CACHE_LEN), new_kv_cache(cfg, CACHE_LEN, ring_cells=cells)
    out = []
    for tokens, pos, tree in _calls(cfg.vocab_size):
        want = model(tokens, pos, full, tree)
        out.append((model(tokens, pos, ring, tree) - want).abs().max().item() / want.abs().max())
    return out


def test_ring_attends_as_a_full_cache(model):
    """A ring of window + the widest call's cells gives the full cache's logits in every
    call; one too short for a prefill chunk does not (the test sees a lost key)."""
    window = model.config.sliding_window
    assert max(_diffs(model, window + CHUNK)) < 1e-5
    assert any(not d <= 1e-3 for d in _diffs(model, window + 4))  # larger, or NaN


@torch.no_grad()
def test_batched_rows_each_see_their_own_ring(model):
    """Two sequences at different positions in one batched call: each row's ring cells
    hold its own positions (the mask is per sequence)."""
    cfg = model.config
    window = cfg.sliding_window
    full = new_kv_cache(cfg, CACHE_LEN, batch=2)
    ring = new_kv_cache(cfg, CACHE_LEN, batch=2, ring_cells=window + CHUNK)
    ids = torch.randint(0, cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(1))
    for slot, n in ((0, 40), (1, 20)):
        for s in range(0, n, CHUNK):
            tokens, pos = (
                ids[slot : slot + 1, s : min(n, s + CHUNK)],
                torch.arange(s, min(n, s + CHUNK)),
            )
            model(tokens, pos, [c[slot : slot + 1] for c in full])
            model(tokens, pos, [c[slot : slot + 1] for c in ring])
    pos = torch.tensor([[40, 41, 42], [20, 21, 22]])
    for _ in range(12):
        tokens = torch.stack([ids[0, pos[0]], ids[1, pos[1]]])
        slots = torch.tensor([0, 1])
        want = model(tokens, pos, full, None, slots)
        assert (model(tokens, pos, ring, None, slots) - want).abs().max() < 1e-5 * want.abs().max()
        pos = pos + torch.tensor([[2], [3]])


def test_a_row_goes_on_only_where_the_ring_holds_the_window():
    """24 cells, window 8: after positions 0..39, a row can go on at 40 or at any point whose
    7 earlier positions are still in their cells (33..40), not at 20 (its window's cells
    hold 37..39 now): there the prompt runs from the start."""
    cached = CachedTokens(2, ring=(24, 8))
    tokens = list(range(100, 140))
    cached.wrote(0, 0, tokens)
    assert cached.prefix(0, tokens) == 40
    assert cached.prefix(0, tokens[:35] + [1, 2]) == 35
    assert cached.prefix(0, tokens[:20] + [1]) == 0
    assert cached.reusable(0, tokens) == 39
    # A tree's nodes, or a draft's keys in the target's layers: forgotten, cells unknown.
    cached.overwrote(0, 38, 2)
    assert cached.prefix(0, tokens) == 38
    assert cached.cells[0][38 % 24] == cached.cells[0][39 % 24] == -1
    # A short row keeps every position: any prefix goes on.
    cached.wrote(1, 0, tokens[:12])
    assert cached.prefix(1, tokens[:5] + [7]) == 5
    # A copy of the donor's ring makes the row hold what the donor's cells hold.
    cached.wrote(0, 0, tokens)
    cached.forget(1, 12)
    cached.wrote(1, 12, tokens[12:40])
    cached.copy_cells(0, 1)
    assert cached.prefix(1, tokens) == 40


def test_sliding_cache_recipe_key():
    """`sliding_cache`: ring by default on CPU packages (their ONNX graphs too), full where
    asked or where the graphs cannot take a ring (CUDA); ring there is a one-line error."""
    base = {"checkpoint": "ckpt", "max_seq_len": 96, "prefill_chunk": 16}
    assert parse_recipe(base, "r", Path(".")).ring_cells(8) == 8 + 16
    assert parse_recipe({**base, "sliding_cache": "full"}, "r", Path(".")).ring_cells(8) is None
    onnx = parse_recipe({**base, "formats": ["aoti", "onnx"]}, "r", Path("."))
    assert onnx.ring_cells(8) == 8 + 16
    assert parse_recipe({**base, "max_seq_len": 16}, "r", Path(".")).ring_cells(8) is None
    with pytest.raises(RecipeError, match="sliding_cache ring is for CPU packages"):
        parse_recipe({**base, "device": "cuda", "sliding_cache": "ring"}, "r", Path("."))
    with pytest.raises(RecipeError, match="sliding_cache 'rolling'; valid: ring, full"):
        parse_recipe({**base, "sliding_cache": "rolling"}, "r", Path("."))


def test_a_trees_accepted_path_moves_into_ring_cells():
    """`commit_path` moves the accepted nodes' keys from slot start + node to start + depth:
    in a ring layer between the cells of those slots, in a full-length layer as before."""
    start, path = 21, [0, 2, 3]  # nodes at slots 21, 23, 24 become positions 21, 22, 23
    ring = torch.arange(10.0).reshape(1, 1, 10, 1).repeat(1, 1, 1, 2)  # cell c holds c
    full = torch.arange(30.0).reshape(1, 1, 30, 1).repeat(1, 1, 1, 2)
    assert commit_path([ring, full], start, path) == 2
    assert ring[0, 0, :, 0].tolist() == [0, 1, 3, 4, 4, 5, 6, 7, 8, 9]  # cells 2, 3 <- 3, 4
    assert full[0, 0, 21:25, 0].tolist() == [21, 23, 24, 24]
