"""GGUF blocks in integer numerics (kernels/gguf_dot.{py,cpp}): the kernel on every ISA path the
CPU can run against `reference_dot`, bit for bit where every float operation is exact, and the
numerics' error against the exact linear on the dequantized weights.

Bound on the kernel: it sums groups in another order and rounds s * (I - zero * Xq) where the
reference rounds s * I and s * zero * Xq apart; both float32, below 1e-5 relative to the
output's largest value. The libraries (one per ISA) build in parallel once per module.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cache

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize

from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import gguf_dot as gd
from tests.test_gguf_blocks import ISAS as BLOCK_ISAS
from tests.test_gguf_blocks import blocks
from tests.test_packed import CPU_FLAGS


def _with(isa: str, flag: str, cpu_flag: str) -> tuple[tuple[str, ...], set[str]]:
    flags, needs = BLOCK_ISAS[isa]
    return (*flags, flag), needs | {cpu_flag}


VNNI = _with("avx512", "-mavx512vnni", "avx512_vnni")
ISAS = {  # path -> (compiler flags, CPU flags it needs)
    "avx512vbmi": ((*VNNI[0], "-mavx512vbmi"), VNNI[1] | {"avx512vbmi"}),  # 5/6-bit multishift
    "avx512vnni": VNNI,
    "avx512": BLOCK_ISAS["avx512"],
    "avxvnni": _with("avx2", "-mavxvnni", "avx_vnni"),
    "avx2": BLOCK_ISAS["avx2"],
    "portable": BLOCK_ISAS["portable"],
}
CASES = (  # (M, rows, panels): decode, verify, prefill; tiles narrower and wider than N
    (1, 1, 1), (1, 1, 3), (1, 1, 8), (2, 2, 3), (5, 5, 2), (7, 7, 1), (7, 4, 3), (33, 8, 2),
    (64, 6, 4), (64, 2, 6),
)  # fmt: skip


@pytest.fixture(scope="module")
def libraries() -> dict:
    runnable = [isa for isa, (_, needs) in ISAS.items() if needs <= CPU_FLAGS]
    with ThreadPoolExecutor(len(runnable)) as pool:
        built = pool.map(lambda isa: gd.library(ISAS[isa][0]), runnable)
        return dict(zip(runnable, built, strict=True))


@pytest.fixture(scope="module", params=list(ISAS))
def lib(request, libraries):
    flags, needs = ISAS[request.param]
    if not needs <= CPU_FLAGS:
        pytest.skip(f"CPU without {', '.join(sorted(needs - CPU_FLAGS))}")
    if libraries[request.param] is None:
        pytest.skip("no C++ compiler")
    return libraries[request.param]


@cache
def reference_cases(name: str, n: int, k: int) -> tuple:
    """Packed blocks and per case (x, reference output), shared by every ISA's test."""
    q = gb.QTYPES[name]
    raw = gb.random_blocks(q, n, k, seed=n) if n % 2 else blocks(name, n, k, seed=n)
    packed = gb.pack(gb.decode(raw, name, (n, k)))
    gen = torch.Generator().manual_seed(k)
    cases = []
    for m, rows, panels in CASES:
        wide = torch.randn(m, k + 24, generator=gen)
        x = wide[:, :k] if m == 7 else wide[:, :k].contiguous()  # strided rows too
        cases.append((m, rows, panels, x, gd.reference_dot(x, *packed, q.index)))
    return packed, cases


@pytest.mark.parametrize("name", list(gb.QTYPES))
def test_kernel_equals_reference(lib, name):
    q = gb.QTYPES[name]
    for n, k in ((37, 512), (50, 768)):  # random blocks (every code), gguf's quantizer
        packed, cases = reference_cases(name, n, k)
        for m, rows, panels, x, expect in cases:
            out = gd.run_library(lib, x, packed, q, rows, panels)
            scale = expect.abs().max()
            assert (out - expect).abs().max() <= 1e-5 * scale, (name, n, k, m, rows, panels)
            assert not out[:, n:].any()


def exact_blocks(q: gb.QType, n: int, k: int, seed: int = 0) -> gb.Decoded:
    """Blocks on which every float operation of both numerics is exact: codes within 4 of the
    zero (0..7 with an offset), scales and super-block scales powers of two in 1/4..1, small
    integer sub-scales and offsets in quarters. Outputs are multiples of 1/4 below 2^22."""
    rng = np.random.default_rng(seed)
    if q.zero:
        codes = q.zero + rng.integers(-4, 4, size=(n, k))
    else:
        codes = rng.integers(0, 8, size=(n, k))
    per_group = (n, k // q.group)

    def pow2(shape: tuple[int, ...]) -> np.ndarray:
        return rng.choice([-1, 1], shape) * 2.0 ** rng.integers(-2, 1, shape)

    if q.n_supers:
        low = -4 if q.name == "Q6_K" else 0  # Q6_K's sub-scales are signed
        groups = rng.integers(low, 4, size=(*per_group, q.n_groups)).astype(np.float64)
        supers = pow2((n, k // gb.SUPER, q.n_supers))
    else:
        groups = pow2((*per_group, q.n_groups))
        if q.n_groups == 2:
            groups[..., 1] = rng.integers(-4, 5, size=per_group) / 4
        supers = None
    f16 = np.float16
    return gb.Decoded(
        q,
        codes.astype(np.uint8),
        groups.astype(f16),
        None if supers is None else supers.astype(f16),
    )


def exact_activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Integers in -127..127 with max |x| = 127 in every block of 32: dx = 1, xq = x."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (m, k), generator=gen).float()
    x[:, ::32] = 127 * torch.where(torch.rand(m, k // 32, generator=gen) < 0.5, -1.0, 1.0)
    return x


@pytest.mark.parametrize("name", list(gb.QTYPES))
def test_exact_inputs_give_the_integer_product(lib, name):
    """Where rounding cannot happen the kernel, the reference and an int64 product of the
    dequantized weights agree bit for bit."""
    q = gb.QTYPES[name]
    n, k = 37, 512
    dec = exact_blocks(q, n, k, seed=q.index)
    w = gb.dequantize(dec)
    w4 = (w * 4).astype(np.int64)
    assert np.array_equal(w4, w * 4)
    packed = gb.pack(dec)
    for m, rows, panels in ((1, 1, 8), (5, 5, 2), (33, 8, 1)):
        x = exact_activations(m, k, seed=m)
        ints = x.numpy().astype(np.int64) @ w4.T
        assert np.abs(ints).max() < 2**24
        expect = torch.from_numpy((ints / 4).astype(np.float32))
        reference = gd.reference_dot(x, *packed, q.index)
        assert torch.equal(reference[:, :n], expect)
        assert torch.equal(gd.run_library(lib, x, packed, q, rows, panels), reference)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_ops_eager_and_error(name):
    """The ops' eager path (what export traces) is `reference_dot`; against the exact linear on
    the dequantized weights the int8 activations cost well under 2% of the output's scale."""
    q = gb.QTYPES[name]
    n, k = 64, 1024
    raw = blocks(name, n, k)  # gguf's quantizer on normal weights where it has one
    codes, groups, supers = gb.pack(gb.decode(raw, name, (n, k)))
    w = torch.from_numpy(dequantize(raw, getattr(gguf.GGMLQuantizationType, name)).reshape(n, k))
    x = torch.randn(8, k + 8, generator=torch.Generator().manual_seed(0))[:, :k]
    if supers is None:
        out = torch.ops.aotgen.gguf_dot(x, codes, groups, q.index, 1, 1)
    else:
        out = torch.ops.aotgen.gguf_dot_k(x, codes, groups, supers, q.index, 1, 1)
    assert torch.equal(out, gd.reference_dot(x, codes, groups, supers, q.index))
    exact = F.linear(x.double(), w.double())
    err = (out[:, :n].double() - exact).abs().max() / exact.abs().max()
    rms = (out[:, :n].double() - exact).norm() / exact.norm()
    print(f"{name}: max error {err:.2e} of max |out|, relative rms {rms:.2e}")
    assert err < 2e-2
