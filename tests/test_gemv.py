"""The few-token linear rewrite (passes/gemv.py): same numbers as the linears it replaces."""

import pytest
import torch
from torch import nn

from aotgen.passes.gemv import linears_as_reductions, row_groups

aten = torch.ops.aten


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 40, bias=False)
        self.down = nn.Linear(40, 24, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _targets(ep) -> list:
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("tokens", [1, 5, 8])
def test_rewritten_graph_matches_eager(tokens):
    torch.manual_seed(0)
    model = TwoLinears().eval()
    x = torch.randn(1, tokens, 24)
    ep = linears_as_reductions(torch.export.export(model, (x,)))
    assert aten.linear.default not in _targets(ep)
    dots = tokens * (row_groups(40, tokens) + row_groups(24, tokens))
    assert _targets(ep).count(aten.sum.dim_IntList) == dots
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)
    compiled = torch.compile(ep.module())
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_row_groups_give_one_token_independent_chains():
    assert row_groups(960, rows=1) == 4  # four equal weight slices reduced side by side
    assert row_groups(10, rows=1) == 2  # only equal slices fuse into one loop
    assert row_groups(7, rows=1) == 1
    assert row_groups(576, rows=2) == 2
    assert row_groups(576, rows=5) == 1  # five token rows are five chains already


def test_more_rows_than_the_limit_keep_blas():
    model = TwoLinears().eval()
    ep = linears_as_reductions(torch.export.export(model, (torch.randn(1, 9, 24),)))
    assert _targets(ep).count(aten.linear.default) == 2


class Int8Matmul(nn.Module):
    """The op the quantize pass emits for an int8 linear: bf16 activations, int8 weights."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.randn(40, 64)
        self.register_buffer("scales", (w.abs().amax(1) / 127).to(torch.bfloat16))
        self.register_buffer("q", (w / self.scales.float()[:, None]).round().to(torch.int8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scales)


@pytest.mark.parametrize("tokens", [1, 5])
def test_int8_matmul_rewrite_matches_the_kernel(tokens):
    torch.manual_seed(0)
    model = Int8Matmul().eval()
    x = torch.randn(tokens, 64)
    ep = linears_as_reductions(torch.export.export(model, (x,)))
    assert aten._weight_int8pack_mm.default not in _targets(ep)
    # Exact product in float32 of what the kernel sees; outputs are bf16: one bf16 step.
    w = model.q.float() * model.scales.float()[:, None]
    ref = x.to(torch.bfloat16).float() @ w.T
    tol = {"rtol": 2**-7, "atol": ref.abs().max().item() * 2**-8}
    torch.testing.assert_close(model(x).float(), ref, **tol)  # the kernel itself
    torch.testing.assert_close(ep.module()(x).float(), ref, **tol)
    torch.testing.assert_close(torch.compile(ep.module())(x).float(), ref, **tol)
