"""The packed-panel linear kernels (kernels/packed.{py,cpp}) against `F.linear` on the same
(dequantized) weights: every ISA path the CPU can run, every tile shape, M = 1..64, K and N
that are not multiples of the vector width or the panel.

Bound: the kernel sums over k in order per output, BLAS in blocks; both in float32. Over K
<= 1536 products of unit-normal values the difference stays below 1e-4 relative to the
output's norm (measured ~1e-6).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aotgen.kernels import packed as pk

CPU_FLAGS = (
    set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
)
AVX512 = ("avx512f", "avx512vl", "avx512bw", "fma")
ISAS = {  # path -> (compiler flags, CPU flags it needs)
    "avx512": (tuple(f"-m{f}" for f in AVX512), set(AVX512)),
    "avx2": (("-mavx2", "-mfma"), {"avx2", "fma"}),
    "portable": ((), set()),
}


def isa_library(flags: tuple[str, ...], needs: set[str], build: Callable) -> ctypes.CDLL:
    """A kernel's test library (`build(flags)`) for one ISA path; skips where this CPU lacks
    the path's `needs` or there is no C++ compiler."""
    if not needs <= CPU_FLAGS:
        pytest.skip(f"CPU without {', '.join(sorted(needs - CPU_FLAGS))}")
    library = build(flags)
    if library is None:
        pytest.skip("no C++ compiler")
    return library


@pytest.fixture(scope="module", params=list(ISAS))
def lib(request):
    return isa_library(*ISAS[request.param], pk.library)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1) / 127
    return (w / scale[:, None]).round().to(torch.int8), scale


@pytest.mark.parametrize("n,k", [(48, 64), (37, 131), (576, 576), (200, 1536)])
@pytest.mark.parametrize("bits", [32, 16, 8])
def test_kernel_matches_linear(lib, n, k, bits):
    torch.manual_seed(n * k + bits)
    w = torch.randn(n, k)
    if bits == 8:
        q, scale = _int8(w)
        dense, weight = q.float() * scale[:, None], pk.pack(q)
        scale = torch.cat([scale, torch.zeros(pk.padded_outputs(n) - n)])
    elif bits == 16:
        dense, weight, scale = w.bfloat16().float(), pk.pack(w.bfloat16()), None
    else:
        dense, weight, scale = w, pk.pack(w), None
    for m in (1, 2, 3, 5, 7, 8, 9, 16, 33, 64):
        x = torch.randn(m, k)
        ref = F.linear(x, dense)
        for rows in pk.ROWS:
            for panels in pk.PANELS:
                out = pk.run_library(lib, x, weight, scale, rows, panels)[:, :n]
                assert _rel(out, ref) < 1e-4, (m, rows, panels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pack_round_trip_and_gather(dtype):
    w = (torch.randn(37, 11) * 20).to(dtype)
    packed = pk.pack(w)
    assert packed.shape == (3, 11, 16)
    assert torch.equal(pk.unpack(packed)[:37], w)
    assert not pk.unpack(packed)[37:].any()
    ids = torch.tensor([[0, 36, 17], [5, 5, 16]])
    assert torch.equal(pk.gather_rows(packed, ids), F.embedding(ids, w))


def test_bfloat16_panel_rows_hold_outputs_in_slot_order():
    """The kernel reads a bfloat16 row's outputs 0-7 from the even slots, 8-15 from the odd."""
    w = torch.arange(16, dtype=torch.bfloat16)[:, None]  # output n's weight is n
    row = pk.pack(w)[0, 0].tolist()
    assert row[0::2] == list(range(8)) and row[1::2] == list(range(8, 16))


def test_reference_ops_match_linear():
    w, x = torch.randn(40, 24), torch.randn(3, 24)
    out = torch.ops.aotgen.packed_linear(x, pk.pack(w), 3, 2)
    assert _rel(out[:, :40], F.linear(x, w)) < 1e-6
    q, scale = _int8(w)
    padded = torch.cat([scale, torch.zeros(8)])
    out = torch.ops.aotgen.packed_linear_int8(x, pk.pack(q), padded, 3, 2)
    assert _rel(out[:, :40], F.linear(x, q.float() * scale[:, None])) < 1e-6
    out = torch.ops.aotgen.packed_linear_bf16(x, pk.pack(w.bfloat16()), 3, 2)
    assert _rel(out[:, :40], F.linear(x, w.bfloat16().float())) < 1e-6


def _bf16_graphs(rows: tuple[int, ...]):
    from aotgen.passes.pack import PackLinears

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.SiLU(), torch.nn.Linear(48, 37))
    net = net.to(torch.bfloat16).eval()
    graphs = [
        (r, torch.export.export(net, (torch.randn(r, 24, dtype=torch.bfloat16),))) for r in rows
    ]
    return PackLinears, graphs


def test_pack_pass_runs_bfloat16_linears_on_panels():
    """bfloat16 linears onto `packed_linear_bf16` (float32 sums, the result rounded to
    bfloat16 once, as F.linear's), the packed weights shared by both graphs."""
    pack_linears, graphs = _bf16_graphs((1, 5))
    pack = pack_linears(lambda kind, n, k, rows: (min(rows, 8), 2), rows=(1, 5))
    for rows, ep in graphs:
        x = torch.randn(rows, 24, dtype=torch.bfloat16)
        with torch.no_grad():
            want = ep.module()(x).float()
        new = pack(ep, rows)
        targets = [n.target for n in new.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.aotgen.packed_linear_bf16.default) == 2
        assert torch.ops.aten.linear.default not in targets
        with torch.no_grad():
            got = new.module()(x)
        assert got.dtype == torch.bfloat16
        assert _rel(got.float(), want) < 1e-2  # bfloat16 rounding of the outputs: ~4e-3


def test_bfloat16_weights_stay_row_major_where_blas_is_faster():
    """One decision per weight: F.linear faster at a row count above one -> every graph keeps
    `aten.linear`; faster at one row only -> panels everywhere."""
    from aotgen.passes.pack import ROW_MAJOR

    for slow_rows, packed in ((5, False), (1, True)):
        pack_linears, graphs = _bf16_graphs((1, 5))

        def choose(kind, n, k, rows, slow_rows=slow_rows):
            return ROW_MAJOR if rows == slow_rows and rows > 1 else (min(rows, 8), 1)

        pack = pack_linears(choose, rows=(1, 5))
        for rows, ep in graphs:
            targets = [n.target for n in pack(ep, rows).graph.nodes]
            assert (torch.ops.aotgen.packed_linear_bf16.default in targets) == packed, rows
            assert (torch.ops.aten.linear.default in targets) != packed, rows


def test_tied_bfloat16_embedding_gathers_from_the_head_panels():
    """An embedding tied to a packed bfloat16 head reads its rows from the panels (in their
    slot order): the same values as the embedding, one stored weight."""
    from aotgen.passes.pack import PackLinears

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(37, 24)
            self.head = torch.nn.Linear(24, 37, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids) * 2)

    net = Tied().to(torch.bfloat16).eval()
    ids = torch.tensor([[0, 36, 17, 8, 9]])
    ep = torch.export.export(net, (ids,))
    with torch.no_grad():
        want = ep.module()(ids).float()
    new = PackLinears(lambda kind, n, k, rows: (min(rows, 8), 1), rows=(5,))(ep, 5)
    assert list(new.state_dict) == ["head.weight_packed"]
    with torch.no_grad():
        got = new.module()(ids).float()
    assert _rel(got, want) < 1e-2
