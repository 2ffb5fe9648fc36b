"""The int8-activation block linears on gguf_dot's panels (passes/pack.py): block_dot's int4 /
int8 weights as Q4_1 / Q8_0 blocks compute block_dot's reference up to float summation order
(same activation codes, same integer sums), on every gguf_dot ISA path the CPU runs, and the
pack pass moves the quantize pass's block ops onto them, storing the weight once.

Bound: like tests/test_gguf_dot.py, float32 sums of ~K/32 block terms in another order,
below 1e-5 relative to the output's largest value.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from aotgen.export import shims
from aotgen.kernels import block_dot as bd
from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import gguf_dot as gd
from aotgen.package.autotune import Autotune, Tile
from aotgen.passes.pack import BLOCK_BITS, BLOCK_DOT, PackLinears
from aotgen.passes.quantize import quantize_pass
from tests.test_gguf_dot import lib, libraries  # noqa: F401 (fixtures)

N, K = 37, 128  # an odd N: the last panel is padding


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _case(bits: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(bits * 100 + seed)
    w = torch.randn(N, K, generator=g) * 0.05
    scale = torch.rand(m, K // 32, 1, generator=g).repeat_interleave(32, 1).reshape(m, K)
    x = torch.randn(m, K, generator=g) * scale  # blocks of different magnitudes
    x[0, :32] = 0  # an all-zero block: scale 0
    q, s = bd.quantize_int4(w) if bits == 4 else bd.quantize_int8(w)
    return x, q, s


@pytest.mark.parametrize("bits", [4, 8])
def test_as_gguf_is_the_same_weights(bits):
    _, q, s = _case(bits, 1)
    dec = bd.as_gguf(bits, q, s)
    assert dec.qtype.name == ("Q4_1" if bits == 4 else "Q8_0")
    want = bd.dequantize_int4(q, s) if bits == 4 else bd.dequantize_int8(q, s)
    assert torch.equal(torch.from_numpy(gb.dequantize(dec)), want)
    packed = gb.pack(dec)  # and back out of the panels, padding rows past N
    assert torch.equal(gb.dequantize_packed(*packed[:2], None, dec.qtype)[:N], want)


@pytest.mark.parametrize("bits", [4, 8])
def test_panels_compute_the_block_reference(lib, bits):  # noqa: F811
    """M = 1..16 rows, tiles as the autotune picks them (all rows up to 8, several panels)."""
    for m in range(1, 17):
        x, q, s = _case(bits, m, seed=m)
        dec = bd.as_gguf(bits, q, s)
        packed = gb.pack(dec)
        want = bd.reference_linear(bits, x, q, s)
        for panels in (1, 3):
            got = gd.run_library(lib, x, packed, dec.qtype, min(m, 8), panels)[:, :N]
            assert _max_rel(got, want) < 1e-5, (m, panels)
        eager = gd.gguf_dot(x, *packed[:2], dec.qtype.index, 1, 1)[:, :N]
        assert _max_rel(eager, want) < 1e-5, m


class _Net(nn.Module):
    """Two block linears (int4, K padded 96 -> 128 for block_dot) and an int8 head, odd N."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(96, 48, bias=False)
        self.head = nn.Linear(48, 37, bias=True)

    def forward(self, x):
        return self.head(torch.relu(self.up(x))) * 2  # (not the output node: quantize pass)


QUANTIZE = {"linear": {"int4": {"groupsize": 32}}, "overrides": {"head": "int8"}}


def _block_graphs(rows: tuple[int, ...]) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    net = _Net().eval()
    qp = quantize_pass({**QUANTIZE, "activations": "int8"}, "cpu")
    graphs = [(r, qp(torch.export.export(net, (torch.randn(1, r, 96),)))) for r in rows]
    return net, graphs


def _targets(ep) -> list:
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def test_pack_pass_moves_block_linears_onto_panels():
    net, graphs = _block_graphs((1, 5))
    asked = []

    def choose(kind, n, k, rows):
        asked.append((kind, n, k, rows))
        return (min(rows, 8), 2)

    pack = PackLinears(choose, rows=(1, 5))
    packed_eps = []
    for rows, ep in graphs:
        x = torch.randn(1, rows, 96)
        with torch.no_grad():
            want = ep.module()(x)  # block_dot's reference
        new = pack(ep, rows)
        packed_eps.append(new)
        targets = _targets(new)
        assert targets.count(gd.OPS[0]) == 2 and not set(BLOCK_BITS) & set(targets)
        # block_dot's tensors are gone; the panels are there, the same objects in every graph
        assert not any(name.endswith(("b32", "b32_scales")) for name in new.state_dict)
        assert "up.weight_int4b32_gguf_codes" in new.state_dict
        assert "head.weight_int8b32_gguf_groups" in new.state_dict
        with torch.no_grad():
            got = new.module()(x)
        assert got.shape == want.shape == (1, rows, 37)
        assert _max_rel(got, want) < 1e-5
    name = "up.weight_int4b32_gguf_codes"
    assert packed_eps[0].state_dict[name] is packed_eps[1].state_dict[name]
    assert ("block-int4", 48, 128, 5) in asked and ("block-int8", 37, 64, 1) in asked
    assert pack.packed_names == {"up.weight_int4b32", "head.weight_int8b32"}


def test_block_dot_kept_only_where_faster_at_every_row_count():
    """One kernel per weight: block_dot.cpp faster at 1 row only -> panels in both graphs
    (the 1-row graph with the panels' own best tile); faster everywhere -> kept."""
    _, graphs = _block_graphs((1, 5))

    def one_row_prefers_block_dot(kind, n, k, rows):
        if kind.startswith("block-") and rows == 1:
            return BLOCK_DOT
        return (3, 4) if kind.startswith("gguf-dot-") else (min(rows, 8), 2)

    pack = PackLinears(one_row_prefers_block_dot, rows=(1, 5))
    for rows, ep in graphs:
        new = pack(ep, rows)
        dots = [n for n in new.graph.nodes if n.target == gd.OPS[0]]
        assert len(dots) == 2
        assert all(tuple(n.args[-2:]) == ((3, 4) if rows == 1 else (5, 2)) for n in dots)
    _, graphs = _block_graphs((1, 5))
    pack = PackLinears(lambda *_: BLOCK_DOT, rows=(1, 5))
    for rows, ep in graphs:
        new = pack(ep, rows)
        targets = _targets(new)
        assert gd.OPS[0] not in targets and len(set(BLOCK_BITS) & set(targets)) == 2
        assert "up.weight_int4b32" in new.state_dict


def test_autotune_times_both_kernels():
    """A block kind's record holds gguf_dot's best tile and block_dot.cpp's time; `choose`
    answers BLOCK_DOT only where the latter is lower."""
    tune = Autotune(None)
    tile = tune._measure("block-int4", 48, 128, 3)
    assert tile.kind == "block-int4" and tile.block_dot_us is not None and tile.us > 0
    assert 1 <= tile.tile_rows <= 3 and tile.tile_panels >= 1
    for block_dot_us, want in ((tile.us / 2, BLOCK_DOT), (tile.us * 2, tile_of(tile))):
        tune.tiles[("block-int4", 48, 128, 3)] = replace(tile, block_dot_us=block_dot_us)
        assert tune.choose("block-int4", 48, 128, 3) == want


def tile_of(tile: Tile) -> tuple[int, int]:
    return tile.tile_rows, tile.tile_panels


# ---- compiled packages (tests/test_quantize.py, tests/test_speculative.py) ---------------------
def wrapper_sources(package: Path, role: str) -> dict[str, str]:
    """Each compiled graph of `role`: the C++ of its wrapper, where AOTInductor declares and
    calls the custom ops' C shims."""
    out = {}
    with zipfile.ZipFile(package / "rank0" / "model.pt2") as z:
        for name in z.namelist():
            graph = name.split("/")[-2]
            if name.endswith(".wrapper.cpp") and graph.startswith(f"{role}_"):
                out[graph.removeprefix(f"{role}_")] = z.read(name).decode()
    return out


def links(wrapper: str, kernel: str) -> bool:
    """Whether the graph calls a shim of kernels/KERNEL.cpp (and so links its object: the
    wrapper declares, and the build links, only the kernels it calls; export/shims.py)."""
    (ops,) = [ops for source, ops in shims.KERNELS if source.stem == kernel]
    return any(f"aoti_torch_cpu_{op._opname}(" in wrapper for op in ops)


def assert_block_linears_follow_the_autotune(package: Path, role: str) -> None:
    """A block-quantized model's linears run where the build's autotune put them (its record
    in the manifest): on gguf_dot's panels unless block_dot.cpp measured faster at every row
    count of the model's graphs. Each weight is stored once, in the layout its kernel reads.
    (Which way a tiny shape goes is the measurement's call; tiles are measured, not asserted.)"""
    manifest = json.loads((package / "manifest.json").read_text())
    tiles = manifest["models"][role]["packed_linears"]["tiles"]
    # block-int4/8: both kernels timed; gguf-dot-*: the panels' own tile for a row count
    # where block_dot.cpp was faster but the weight is on panels (faster at another)
    kinds = {"block-int4", "block-int8", "gguf-dot-Q4_1", "gguf-dot-Q8_0"}
    assert tiles and {t["kind"] for t in tiles} <= kinds
    blocks_timed = [t for t in tiles if t["kind"].startswith("block-")]
    assert all(t["block_dot_us"] is not None for t in blocks_timed)
    shapes: dict[tuple, list[bool]] = {}
    for t in blocks_timed:
        shapes.setdefault((t["kind"], t["n"], t["k"]), []).append(t["block_dot_us"] < t["us"])
    kept = {shape for shape, faster in shapes.items() if all(faster)}
    on_panels = set(shapes) - kept
    wrappers = wrapper_sources(package, role)
    assert "decode" in wrappers  # a draft on the target's cache has no other graph
    for graph, source in wrappers.items():
        assert links(source, "gguf_dot") == bool(on_panels), graph
        assert ("aoti_torch_cpu_gguf_dot(" in source) == bool(on_panels), graph
        assert links(source, "block_dot") == bool(kept), graph
    with safe_open(str(package / "rank0" / f"{role}.safetensors"), "pt") as f:
        names = set(f.keys())
    panels = {n.removesuffix("_gguf_codes") for n in names if n.endswith("_gguf_codes")}
    blocks = {n for n in names if n.endswith(("int4b32", "int8b32"))}
    assert bool(panels) == bool(on_panels) and bool(blocks) == bool(kept)
    assert not panels & blocks  # stored once


def assert_block_linears_on_panels(package: Path, role: str) -> None:
    """Every block linear of `role` runs on gguf_dot (a build told to put them there): no
    block_dot code in any graph, no block_dot tensor in the package."""
    wrappers = wrapper_sources(package, role)
    assert "decode" in wrappers
    for graph, source in wrappers.items():
        assert "aoti_torch_cpu_gguf_dot(" in source, graph
        assert not links(source, "block_dot"), graph
    with safe_open(str(package / "rank0" / f"{role}.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.endswith("_int4b32_gguf_codes") for n in names)
    assert any(n.endswith("_int8b32_gguf_codes") for n in names)
    assert not any(n.endswith(("b32", "b32_scales")) for n in names)
