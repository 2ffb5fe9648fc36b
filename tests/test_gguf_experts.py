"""A mixture of experts' experts on GGUF blocks (`moe_experts_gguf`, `quantize: {gguf: keep}`):
the op's eager definition against the routed loop on `gguf.quants.dequantize`'s weights, and the
kernel (moe.cpp through gguf_blocks.cpp, in an AOTInductor graph) against the eager op, on
few rows (decode: experts one after another, each threaded over its panels) and many
(prefill: experts in parallel, panels dequantized once per call), with gpt-oss's biases and
clamped activation. The package built from a GGUF is tested in test_gguf_keep.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import Tensor

from aotgen.kernels import gguf_blocks as gb
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
    def __init__(self, gate_up_qtype: int, down_qtype: int):
        super().__init__()
        self.qtypes = gate_up_qtype, down_qtype

    def forward(self, x, weights, ids, gu_codes, gu_groups, gu_supers, d_codes, d_groups,
                d_supers, gu_bias, d_bias):  # fmt: skip
        gate_up, down = (gu_codes, gu_groups, gu_supers), (d_codes, d_groups, d_supers)
        run = torch.ops.aotgen.moe_experts_gguf
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
    got = torch.ops.aotgen.moe_experts_gguf(x, weights, ids, *gu[:3], gu[3], *dn[:3], dn[3])
    torch.testing.assert_close(got, moe_experts(x, weights, ids, gu_w, dn_w), rtol=0, atol=0)


@pytest.mark.parametrize("types", [TYPES[0], TYPES[2]], ids=lambda t: "+".join(t))
def test_kernel_equals_the_eager_op(project, tmp_path, types):
    """The compiled graph (the kernel's C shim) against the eager op, on 1 and 2 rows (decode:
    the routed experts one after another, each threaded over its panels) and 40 (prefill: in
    parallel, on panels dequantized once), plain and biased / clamped: float32 rounding only
    (sums in another order)."""
    from torch._inductor.package import load_package

    from aotgen.export.aoti import compile_graph, package_graphs

    (gu, _), (dn, _) = _stack(types[0], 2 * F, D, 0), _stack(types[1], D, F, 100)
    g = torch.Generator().manual_seed(1)
    biases = (torch.randn(E, 2 * F, generator=g), torch.randn(E, D, generator=g) * 0.1)
    module = BlockExperts(gu[3], dn[3])
    x, weights, ids = _routed(40)
    args = (x, weights, ids, *gu[:3], *dn[:3], *biases)
    rows = torch.export.Dim("rows", min=1, max=64)
    ep = torch.export.export(module, args, dynamic_shapes=[{0: rows}] * 3 + [None] * 8)
    files, _ = compile_graph(ep, args, max_autotune=False, cache=project.cache_dir / "graphs")
    package_graphs(tmp_path / "experts.pt2", {"model": files})
    compiled = load_package(str(tmp_path / "experts.pt2"), "model")
    for n in (1, 2, 40):
        inputs = (x[:n], weights[:n], ids[:n], *args[3:])
        for got, want in zip(compiled(*inputs), module(*inputs), strict=True):
            assert ((got - want).norm() / want.norm()).item() < 1e-5, n
