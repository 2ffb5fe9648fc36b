"""The few-token linear rewrite (passes/gemv.py): same numbers as the linears it replaces."""

import pytest
import torch
from torch import nn

from aotgen.passes.gemv import linears_as_reductions

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
    assert _targets(ep).count(aten.sum.dim_IntList) == 2 * tokens
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)
    compiled = torch.compile(ep.module())
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_more_rows_than_the_limit_keep_blas():
    model = TwoLinears().eval()
    ep = linears_as_reductions(torch.export.export(model, (torch.randn(1, 9, 24),)))
    assert _targets(ep).count(aten.linear.default) == 2
