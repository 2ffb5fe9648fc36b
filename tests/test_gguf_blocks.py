"""GGUF blocks kept as they are (kernels/gguf_blocks.{py,cpp}): decoding every block type gives
`gguf.quants.dequantize`'s values bit for bit, the panel layout round-trips, and the kernel on
every ISA path the CPU can run equals `F.linear` on the dequantized weights.

Blocks come from gguf's own quantizer where it has one (legacy types) and otherwise are random
bytes with sane float16 scales: any bytes are a valid block, so every code and sub-scale value
is exercised. Bound on the linear: the kernel sums over k in order, BLAS in blocks, both in
float32: below 1e-5 relative to the output's largest value (measured ~1e-6).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from aotgen.kernels import gguf_blocks as gb
from tests.test_packed import isa_library

ISAS = {  # path -> (compiler flags, CPU flags it needs)
    "avx512": (("-mavx512f", "-mavx512vl", "-mavx512bw", "-mfma"), {"avx512f", "avx512bw", "fma"}),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), {"avx2", "fma", "f16c"}),
    "portable": ((), set()),
}


def blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """gguf's quantizer on normal weights where it has one for `name`, else random blocks."""
    q = gb.QTYPES[name]
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    try:
        return quantize(w, getattr(gguf.GGMLQuantizationType, name)).reshape(n, -1)
    except NotImplementedError:
        return gb.random_blocks(q, n, k, seed)


@pytest.mark.parametrize("name", list(gb.QTYPES))
@pytest.mark.parametrize("source", ["quantizer", "random"])
def test_decode_is_bit_exact(name, source):
    n, k = 37, 512
    raw = blocks(name, n, k) if source == "quantizer" else gb.random_blocks(gb.QTYPES[name], n, k)
    expect = dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(n, k)
    dec = gb.decode(raw, name, (n, k))
    assert np.array_equal(gb.dequantize(dec), expect)
    packed = gb.pack(dec)
    back = gb.dequantize_packed(*packed, dec.qtype)
    assert torch.equal(back[:n], torch.from_numpy(expect))
    assert not back[n:].any()  # the panels' padding is zero
    assert np.array_equal(gb.unpack_codes(packed[0], dec.qtype)[:n].numpy(), dec.codes)


@pytest.mark.parametrize("name", list(gb.QTYPES))
def test_storage_is_the_files_bits(name):
    """The packed tensors hold the file's bytes; the k-quants' sub-scales (6 or 8 bits in the
    file) take 16 bits: 1.14x for Q4_K, 1.11x for Q5_K, 1.08x for Q6_K."""
    n, k = 64, 1024
    q = gb.QTYPES[name]
    raw = gb.random_blocks(q, n, k)
    packed = gb.pack(gb.decode(raw, name, (n, k)))
    stored = sum(t.numel() * t.element_size() for t in packed if t is not None)
    if q.n_supers == 0:
        assert stored == raw.nbytes
    else:
        file_sub_scales = {"Q6_K": 16, "Q4_K": 12, "Q5_K": 12}[name] * n * k // gb.SUPER
        assert stored == raw.nbytes - file_sub_scales + 2 * q.n_groups * n * k // q.group
        assert stored <= 1.14 * raw.nbytes


# (rows M, tile rows, tile panels): decode, verify, prefill-like; tiles that fit and that do not
TILES = ((1, 1, 1), (1, 1, 4), (2, 2, 3), (5, 5, 2), (7, 7, 1), (7, 4, 3), (33, 8, 2), (64, 6, 4))


@pytest.fixture(scope="module", params=list(ISAS))
def lib(request):
    return isa_library(*ISAS[request.param], gb.library)


@pytest.mark.parametrize("name", list(gb.QTYPES))
def test_kernel_equals_linear_on_dequantized(lib, name):
    q = gb.QTYPES[name]
    for n, k in ((37, 512), (16, 256), (50, 768)):
        raw = gb.random_blocks(q, n, k, seed=n)
        w = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(n, k))
        packed = gb.pack(gb.decode(raw, name, (n, k)))
        gen = torch.Generator().manual_seed(k)
        for m, rows, panels in TILES:
            x = torch.randn(m, k, generator=gen)
            out = gb.run_library(lib, x, packed, q, rows, panels)
            expect = F.linear(x.double(), w.double()).float()
            scale = expect.abs().max()
            assert (out[:, :n] - expect).abs().max() <= 1e-5 * scale, (name, n, k, m, rows, panels)
            assert not out[:, n:].any()


@pytest.mark.parametrize("name", list(gb.QTYPES))
def test_kernel_keeps_float_precision_for_activations_with_a_mean(lib, name):
    """Activations far from zero mean (as real hidden states often are): the error stays at
    float32's level, so a kernel that sums per group may not let its sums cancel (an offset
    or zero times sum(x) against sum(q x)). Per-weight dequantization measured 5-6e-7 here; a
    4-bit decoding to 1 + q / 128 reached 1.5e-5 (Q4_0)."""
    q = gb.QTYPES[name]
    n, k = 256, 768
    raw = gb.random_blocks(q, n, k, seed=3)
    w = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(n, k))
    packed = gb.pack(gb.decode(raw, name, (n, k)))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0)) + 3.0
    expect = F.linear(x.double(), w.double())
    for rows, panels in ((1, 1), (5, 1)):
        out = gb.run_library(lib, x[:rows], packed, q, rows, panels)[:, :n].double()
        err = ((out - expect[:rows]).norm() / expect[:rows].norm()).item()
        assert err < 1e-6, (name, rows, err)


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_ops_eager_reference(name):
    """The custom ops' eager path (what export traces) is the dequantized linear."""
    n, k = 20, 256
    raw = gb.random_blocks(gb.QTYPES[name], n, k)
    q = gb.QTYPES[name]
    codes, groups, supers = gb.pack(gb.decode(raw, name, (n, k)))
    w = torch.from_numpy(dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(n, k))
    x = torch.randn(3, k)
    if supers is None:
        out = torch.ops.aotgen.gguf_linear(x, codes, groups, q.index, 1, 1)
    else:
        out = torch.ops.aotgen.gguf_linear_k(x, codes, groups, supers, q.index, 1, 1)
    torch.testing.assert_close(out[:, :n], F.linear(x, w), rtol=1e-5, atol=1e-5)


class TableRows(torch.nn.Module):
    """`gguf_rows` on one table of each block type (a tied embedding read from its head); the
    tables are inputs (codes, groups, supers or None per type), as a package's weights are."""

    def __init__(self, names: list[str]):
        super().__init__()
        self.qtypes = [gb.QTYPES[name].index for name in names]

    def forward(self, ids: torch.Tensor, *tables: torch.Tensor | None) -> list[torch.Tensor]:
        return [
            torch.ops.aotgen.gguf_rows(ids, *tables[3 * i : 3 * i + 3], q)
            for i, q in enumerate(self.qtypes)
        ]


def test_rows_are_the_dequantized_table(compile_exported):
    """An embedding on a head's blocks: the eager op and the compiled kernel (its C shim) give
    gguf's dequantized rows bit for bit, for every type, on one id and many (repeated, in any
    panel lane, the last row of a table whose panels are padded); an id past the table fails."""
    n, k = 40, 256  # 40 rows: the third panel half padding
    raw = {name: gb.random_blocks(q, n, k, seed=q.index) for name, q in gb.QTYPES.items()}
    tables = {name: gb.pack(gb.decode(b, name, (n, k))) for name, b in raw.items()}
    gguf_types = {name: getattr(gguf.GGMLQuantizationType, name) for name in raw}
    want = {name: torch.from_numpy(dequantize(b, gguf_types[name])) for name, b in raw.items()}
    module = TableRows(list(tables))
    flat = [t for packed in tables.values() for t in packed]
    ids = torch.tensor([39, 0, 17, 17, 31, 5, 16, 38])
    for got, name in zip(module(ids, *flat), tables, strict=True):
        torch.testing.assert_close(got, want[name][ids], rtol=0, atol=0)
    length = torch.export.Dim("length", min=1, max=64)
    args = (ids, *flat)
    ep = torch.export.export(module, args, dynamic_shapes=[{0: length}, (None,) * len(flat)])
    compiled = compile_exported(ep, args)
    for chosen in (ids[:1], ids):
        for got, name in zip(compiled(chosen, *flat), tables, strict=True):
            torch.testing.assert_close(got, want[name][chosen], rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        compiled(torch.tensor([48]), *flat)  # three panels: 48 rows
