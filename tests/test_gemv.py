"""The few-token linear rewrite (passes/gemv.py): same numbers as the linears it replaces."""

import pytest
import torch
from torch import nn

from aotgen.passes.gemv import (
    amx_matmul_faster,
    int8_linears_for_gpu,
    k_chunks,
    linears_as_reductions,
    row_groups,
)

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


def test_k_chunks_keep_a_slice_of_the_rows_in_l1():
    assert k_chunks(1536, rows=7) == 3  # 43 KB of rows -> 3 slices of 512 inputs (14 KB)
    assert k_chunks(576, rows=7) == 1  # 16 KB: fits
    assert k_chunks(1536, rows=1) == 1  # decode
    assert k_chunks(1536, rows=5) == 2
    assert k_chunks(640, rows=7) == 2
    assert k_chunks(1000, rows=7) == 1  # no split into equal slices of a multiple of 64


@pytest.mark.parametrize("tokens", [1, 7])
def test_wide_input_reduced_in_slices_matches_eager(tokens):
    torch.manual_seed(0)
    model = nn.Linear(640, 40, bias=True).eval()
    x = torch.randn(1, tokens, 640)
    ep = linears_as_reductions(torch.export.export(model, (x,)))
    # 7 rows: a sum over each slice, then over the slices; 1 row: one sum per weight slice.
    sums = 2 * tokens if tokens == 7 else row_groups(40, 1)
    assert _targets(ep).count(aten.sum.dim_IntList) == sums
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.compile(ep.module())(x), model(x), rtol=1e-5, atol=1e-5)


def test_more_rows_than_the_limit_keep_blas():
    model = TwoLinears().eval()
    ep = linears_as_reductions(torch.export.export(model, (torch.randn(1, 9, 24),)))
    assert _targets(ep).count(aten.linear.default) == 2


class Int8Matmul(nn.Module):
    """The op the quantize pass emits for an int8 linear: bf16 activations, int8 weights."""

    def __init__(self, in_features: int = 64) -> None:
        super().__init__()
        w = torch.randn(40, in_features)
        w[0, :4] = torch.tensor([-1.0, 1.0, -1.0, 1.0]) * w.abs().max()  # codes -127 and 127
        self.register_buffer("scales", (w.abs().amax(1) / 127).to(torch.bfloat16))
        q = (w / self.scales.float()[:, None]).round().clamp(-128, 127).to(torch.int8)
        q[1, :8] = torch.tensor([-128, 127, -1, 0, 1, -128, 127, -2])  # every sign-extension edge
        self.register_buffer("q", q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return aten._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scales)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("in_features", [64, 62])
def test_int8_matmul_rewrite_matches_the_kernel(tokens, in_features):
    torch.manual_seed(0)
    model = Int8Matmul(in_features).eval()
    x = torch.randn(tokens, in_features)
    ep = linears_as_reductions(torch.export.export(model, (x,)))
    targets = _targets(ep)
    assert aten._weight_int8pack_mm.default not in targets
    # in_features % 4 == 0: the weight is read as 32-bit words and split into its 4 bytes.
    as_words = in_features % 4 == 0
    assert (aten.bitwise_right_shift.Tensor_Scalar in targets) == as_words
    # Exact product in float32 of what the kernel sees; outputs are bf16: one bf16 step.
    w = model.q.float() * model.scales.float()[:, None]
    ref = x.to(torch.bfloat16).float() @ w.T
    tol = {"rtol": 2**-7, "atol": ref.abs().max().item() * 2**-8}
    if in_features % 8 == 0:  # ATen's AVX2 kernel reads out of bounds otherwise (torch 2.13)
        torch.testing.assert_close(model(x).float(), ref, **tol)  # the kernel itself
    torch.testing.assert_close(ep.module()(x).float(), ref, **tol)
    torch.testing.assert_close(torch.compile(ep.module())(x).float(), ref, **tol)


class Int8MatmulToFloat(Int8Matmul):
    """As the quantize pass leaves it: the kernel's bf16 output cast back to float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).float()


@pytest.mark.parametrize("tokens, reduced", [(1, True), (8, True), (9, False)])
def test_int8_matmul_for_gpu_matches_the_dequantized_weight(tokens, reduced):
    """The CUDA form (a float32 reduction up to 8 rows, a dequantized matmul beyond), checked
    on the CPU: the rewrite is device-agnostic graph surgery; test_cuda.py runs it compiled."""
    torch.manual_seed(0)
    model = Int8MatmulToFloat(62).eval()
    x = torch.randn(tokens, 62)
    # As the quantize pass emits it: `_to_copy` casts around the kernel, no metadata asserts.
    ep = torch.export.export(model, (x,)).run_decompositions({})
    graph = ep.graph_module.graph
    for node in graph.find_nodes(op="call_function", target=aten._assert_tensor_metadata.default):
        graph.erase_node(node)
    ep = int8_linears_for_gpu(ep)
    targets = _targets(ep)
    assert aten._weight_int8pack_mm.default not in targets
    assert (aten.sum.dim_IntList in targets) == reduced
    assert (aten.mm.default in targets) == (not reduced)
    # float32 throughout (the kernel's bf16 casts in and out are gone): float32 rounding only.
    w = model.q.double() * model.scales.double()[:, None]
    ref = (x.double() @ w.T).float()
    torch.testing.assert_close(ep.module()(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5])
def test_bfloat16_rows_stay_on_the_amx_matmul(tokens):
    """bfloat16 weights with several rows keep oneDNN's matmul on a CPU with AMX tiles (else,
    and for one row, they become reductions); either way the numbers are the linear's."""
    torch.manual_seed(0)
    model = TwoLinears().to(torch.bfloat16).eval()
    x = torch.randn(1, tokens, 24, dtype=torch.bfloat16)
    ep = linears_as_reductions(torch.export.export(model, (x,)))
    kept = tokens > 1 and amx_matmul_faster(torch.bfloat16)
    assert (aten.linear.default in _targets(ep)) == kept
    assert amx_matmul_faster(torch.float32) is False
    torch.testing.assert_close(ep.module()(x), model(x), rtol=2e-2, atol=2e-2)
