"""A mixture of experts' experts on GGUF blocks (kernels/moe_gguf.py, `quantize: {gguf: keep}`):
the exact op's eager definition against the routed loop on `gguf.quants.dequantize`'s weights,
the integer one near it (activations rounded to int8), and the kernels (moe.cpp through
gguf_blocks.cpp / gguf_dot.cpp, in an AOTInductor graph) against the eager ops, on few rows
(decode: experts one after another, each threaded over its panels) and many (prefill: experts
in parallel), with gpt-oss's biases and clamped activation. The package built from a GGUF is
tested in test_gguf_keep.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import Tensor

from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import moe_gguf
from aotgen.kernels.moe import moe_experts

E, K, D, F = 6, 2, 256, 256  # experts, per token, hidden, expert width (k-quants: 256 inputs)


def _stack(qtype: str, rows: int, cols: int, seed: int) -> tuple[tuple, Tensor]:
    """E experts' random blocks of `qtype` [rows, cols]: packed and stacked for the op, and
    their weights as gguf dequantizes them [E, rows, cols]."""
    q = gb.QTYPES[qtype]
    packed, weights = [], []
    for e in range(E):
        raw = gb.random_blocks(q, rows, cols, seed=seed + e, scale=0.05)
        packed.append(gb.pack(gb.decode(raw, qtype, (rows, cols))))
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        weights.append(torch.from_numpy(np.ascontiguousarray(values)).reshape(rows, cols))
    codes, groups, supers = (
        None if p[0] is None else torch.stack(p) for p in zip(*packed, strict=True)
    )
    return (codes, groups, supers, q.index), torch.stack(weights)


def _routed(tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, D, generator=g)
    weights, ids = torch.randn(tokens, E, generator=g).softmax(-1).topk(K, dim=-1)
    return x, weights, ids


TYPES = [("Q4_K", "Q6_K"), ("Q5_K", "Q4_0"), ("Q8_0", "Q4_1"), ("Q5_0", "Q5_1")]


class BlockExperts(torch.nn.Module):
    def __init__(self, gate_up_qtype: int, down_qtype: int, integer: bool):
        super().__init__()
        self.qtypes, self.integer = (gate_up_qtype, down_qtype), integer

    def forward(self, x, weights, ids, gu_codes, gu_groups, gu_supers, d_codes, d_groups,
                d_supers, gu_bias, d_bias):  # fmt: skip
        gate_up, down = (gu_codes, gu_groups, gu_supers), (d_codes, d_groups, d_supers)
        run = moe_gguf.moe_experts_gguf_dot if self.integer else moe_gguf.moe_experts_gguf
        plain = run(x, weights, ids, *gate_up, self.qtypes[0], *down, self.qtypes[1])
        clamped = run(
            x, weights, ids, *gate_up, self.qtypes[0], *down, self.qtypes[1], gu_bias, d_bias,
            1.0, 1.702,
        )  # fmt: skip
        return plain, clamped


@pytest.mark.parametrize("types", TYPES, ids=lambda t: "+".join(t))
def test_eager_op_is_the_routed_loop_on_gguf_weights(types):
    """The op's definition: `moe_experts` on the weights gguf dequantizes, exactly."""
    (gu, gu_w), (dn, dn_w) = _stack(types[0], 2 * F, D, 0), _stack(types[1], D, F, 100)
    x, weights, ids = _routed(9)
    got = moe_gguf.moe_experts_gguf(x, weights, ids, *gu[:3], gu[3], *dn[:3], dn[3])
    torch.testing.assert_close(got, moe_experts(x, weights, ids, gu_w, dn_w), rtol=0, atol=0)
    # llama.cpp's numerics: the activations rounded to int8 per block of 32 (test_gguf_dot
    # holds each projection to its reference)
    rounded = moe_gguf.moe_experts_gguf_dot(x, weights, ids, *gu[:3], gu[3], *dn[:3], dn[3])
    assert 0 < ((rounded - got).norm() / got.norm()).item() < 2e-2


@pytest.mark.parametrize("integer", [False, True], ids=["exact", "integer"])
@pytest.mark.parametrize("types", [TYPES[0], TYPES[2]], ids=lambda t: "+".join(t))
def test_kernel_equals_the_eager_op(compile_exported, types, integer):
    """The compiled graph (the kernel's C shim) against the eager op, on 1 and 2 rows (decode:
    the routed experts one after another, each threaded over its panels) and 40 (prefill: in
    parallel; exact: on panels dequantized once), plain and biased / clamped: float32 rounding
    only (sums in another order)."""
    (gu, _), (dn, _) = _stack(types[0], 2 * F, D, 0), _stack(types[1], D, F, 100)
    g = torch.Generator().manual_seed(1)
    biases = (torch.randn(E, 2 * F, generator=g), torch.randn(E, D, generator=g) * 0.1)
    module = BlockExperts(gu[3], dn[3], integer)
    x, weights, ids = _routed(40)
    args = (x, weights, ids, *gu[:3], *dn[:3], *biases)
    rows = torch.export.Dim("rows", min=1, max=64)
    ep = torch.export.export(module, args, dynamic_shapes=[{0: rows}] * 3 + [None] * 8)
    compiled = compile_exported(ep, args)
    for n in (1, 2, 40):
        inputs = (x[:n], weights[:n], ids[:n], *args[3:])
        for got, want in zip(compiled(*inputs), module(*inputs), strict=True):
            assert ((got - want).norm() / want.norm()).item() < 1e-5, n


def test_model_experts_swapped_for_their_blocks(tmp_path):
    """A Qwen3-MoE GGUF whose experts llama.cpp would store as k-quant and legacy blocks,
    imported: `keep_experts` swaps every layer's experts for their blocks, and the eager
    model gives the dequantized checkpoint's logits (float activations: float32 rounding; int8
    ones: near them)."""
    from test_gguf_families import _checkpoint, _write_gguf

    from aotgen.checkpoint.gguf import import_gguf
    from aotgen.checkpoint.hf import open_checkpoint
    from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
    from aotgen.passes.gguf_keep import BlockIndex, KeepGGUF
    from aotgen.passes.keep_experts import GGUFExperts, keep_experts

    sizes = dict(hidden_size=256, moe_intermediate_size=256)
    ckpt = _checkpoint(tmp_path / "hf", "qwen3moe", **sizes)
    _write_gguf(ckpt, tmp_path / "m.gguf", "qwen3moe", qtypes=("Q4_K", "Q6_K", "Q8_0", "Q4_1"))
    imported = open_checkpoint(import_gguf(tmp_path / "m.gguf", tmp_path / "imported"))
    cfg = ModelConfig.from_hf(imported.config)
    index = BlockIndex(imported.load_gguf_blocks(), imported.block_input_orders())
    ids, pos = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]]), torch.arange(8)

    def logits(integer: bool | None) -> Tensor:
        model = load_model(cfg, imported.load_weights(), 16, torch.float32)
        if integer is not None:
            keep = KeepGGUF(index, integer_dot=integer)
            assert keep_experts(model, keep) == cfg.num_hidden_layers
            assert sum(isinstance(m, GGUFExperts) for m in model.modules()) == cfg.num_hidden_layers
            assert len(set(keep.kept.values())) > 1 and not keep.left_float
        with torch.no_grad():
            return model(ids, pos, new_kv_cache(cfg, 16, torch.float32))

    want = logits(None)
    assert ((logits(False) - want).norm() / want.norm()).item() < 1e-6
    assert 0 < ((logits(True) - want).norm() / want.norm()).item() < 5e-2
