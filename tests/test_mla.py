"""Multi-head latent attention (model/mla.py): both ways it attends (the queries absorbed into
the latent, and the latent expanded into every head's keys and values) against transformers,
chunked and batched over the latent cache, with `kv_b_proj` float or int8 rows. The families'
logits and greedy tokens over a history are in test_families.py (EAGER_PARITY); a compiled
package in PARITY."""

from __future__ import annotations

import pytest
import torch
from families import load_reference, make_family_checkpoint, reference_logits
from reference import EagerModel

from aotgen.model import mla
from aotgen.model.llama import cache_shapes
from aotgen.passes.quantize_latent import Int8LatentExpansion, quantize_latent

LATENT_FAMILIES = [
    *("deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "glm4-moe-lite", "youtu", "minicpm3")
]
FP32_TOL = 1e-4


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def latent_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("latent")
    return {f: make_family_checkpoint(root / f, f, seed=i) for i, f in enumerate(LATENT_FAMILIES)}


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("family", LATENT_FAMILIES)
def test_both_ways_match_transformers(latent_checkpoints, monkeypatch, family, absorbed):
    """A 30-token history in chunks of 16, 9, 4 and 1 rows over the latent cache: every row's
    logits equal transformers' whichever way the layers attend."""
    if not absorbed:  # the way of prefill graphs and of graphs the kernel does not run
        monkeypatch.setattr(mla.attention, "applies", lambda *_: False)
    model = EagerModel(latent_checkpoints[family], 48)
    history = _history(model)
    want = reference_logits(load_reference(latent_checkpoints[family]), history)
    assert _rel_err(_chunked_logits(model, history), want) < FP32_TOL


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("family", ["deepseek-v3", "minicpm3"])
def test_int8_expansion_matches_transformers_on_its_weights(
    latent_checkpoints, monkeypatch, family, absorbed
):
    """`kv_b_proj` as int8 rows (passes/quantize_latent.py): few-row chunks (reductions) and
    many-row ones (matmuls) give transformers' logits on the same rounded weights, and differ
    from the float model's by the rounding."""
    if not absorbed:
        monkeypatch.setattr(mla.attention, "applies", lambda *_: False)
    model = EagerModel(latent_checkpoints[family], 48)
    history = _history(model)
    float_logits = _chunked_logits(model, history)
    assert set(quantize_latent(model.model).values()) == {None}
    model.reset()
    got = _chunked_logits(model, history)
    reference = load_reference(latent_checkpoints[family])
    layers = [m for m in model.model.modules() if isinstance(m, Int8LatentExpansion)]
    for layer, hf_layer in zip(layers, reference.model.layers, strict=True):
        rounded = layer.codes.float() * layer.scale[:, None]
        hf_layer.self_attn.kv_b_proj.weight.data.copy_(rounded)
    assert _rel_err(got, reference_logits(reference, history)) < FP32_TOL
    assert _rel_err(got, float_logits) > FP32_TOL


def test_skip_pattern_keeps_an_expansion_float(latent_checkpoints):
    """A `quantize.skip` glob on kv_b_proj's module path keeps it float, and says which."""
    model = EagerModel(latent_checkpoints["deepseek-v3"], 48).model
    outcomes = quantize_latent(model, ("model.layers.0.*",))
    layers = len(model.model.layers)
    assert outcomes == {
        f"model.layers.{i}.self_attn.kv_b_proj": "model.layers.0.*" if i == 0 else None
        for i in range(layers)
    }
    kinds = [type(layer.self_attn.kv_b_proj) for layer in model.model.layers]
    assert kinds == [mla.LatentExpansion] + [Int8LatentExpansion] * (layers - 1)


def _history(model: EagerModel) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (30,), generator=gen).tolist()


def _chunked_logits(model: EagerModel, history: list[int]) -> torch.Tensor:
    """Logits of a 30-token history fed in chunks of 16, 9, 4 and 1 rows."""
    got, start = [], 0
    for rows in (16, 9, 4, 1):
        got.append(model.forward(history[start : start + rows], start))
        start += rows
    return torch.cat(got)


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
def test_batched_rows_match_one_sequence_at_a_time(latent_checkpoints, monkeypatch, absorbed):
    """Two sequences at different positions in cache rows 1 and 0 of a slotted latent cache
    give each sequence's own logits."""
    if not absorbed:
        monkeypatch.setattr(mla.attention, "applies", lambda *_: False)
    model = EagerModel(latent_checkpoints["deepseek-v3"], 48)
    cfg, net = model.config, model.model
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (20, 13)]
    alone = []
    for seq in seqs:
        model.reset()
        alone.append(model.forward(seq, 0)[-3:])
    caches = [torch.zeros(s) for s in cache_shapes(cfg, 48, batch=2)]
    slots = torch.tensor([1, 0])
    with torch.no_grad():
        for seq, slot in zip(seqs, slots, strict=True):  # each prefix, then 3 rows of both
            net(
                torch.tensor([seq[:-3]]),
                torch.arange(len(seq) - 3),
                [c[slot : slot + 1] for c in caches],
            )
        tokens = torch.tensor([seq[-3:] for seq in seqs])
        positions = torch.stack([torch.arange(len(s) - 3, len(s)) for s in seqs])
        both = net(tokens, positions, caches, None, slots)
    assert max(_rel_err(both[i], alone[i]) for i in range(2)) < FP32_TOL


def test_cache_holds_one_latent_row_a_position(latent_checkpoints):
    """A latent layer caches `kv_lora_rank + qk_rope_head_dim` values a position as one KV
    head, and no values: DeepSeek-V3's 576 against its 128 heads' 32,768 keys and values."""
    cfg = EagerModel(latent_checkpoints["deepseek-v3"], 48).config
    keys, values = cache_shapes(cfg, 48)[:2]
    assert keys == [1, 1, 48, 32 + 16] and values == [1, 1, 48, 0]
