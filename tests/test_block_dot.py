"""The int4/int8 x int8-activation block kernels (kernels/block_dot.{py,cpp}): the C++
against its torch reference, both code paths (AVX2 where the CPU has it, and the portable
loops), and the reference against plain float math.

Bounds: the kernel and the reference differ only in float summation order over ~K/32 block
terms (measured <= 7e-5 absolute on outputs of magnitude ~20), hence 1e-5 relative.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from aotgen.kernels import block_dot as bd

SHAPES = [(13, 64, 1), (576, 576, 3), (37, 1536, 5), (1024, 128, 2)]  # N, K, M


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _avx2() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f in flags.split() for f in ("avx2", "fma", "f16c"))


@pytest.fixture(scope="module", params=["avx2", "portable"])
def kernel(request, tmp_path_factory):
    """The kernel source built as a plain shared library (no AOTInductor handles)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    if request.param == "avx2" and not _avx2():
        pytest.skip("CPU without AVX2/FMA/F16C")
    flags = ["-mavx2", "-mfma", "-mf16c"] if request.param == "avx2" else []
    out = tmp_path_factory.mktemp("block_dot") / f"{request.param}.so"
    cmd = ["g++", "-shared", "-fPIC", "-std=c++17", "-O2", "-fopenmp", *flags]
    subprocess.run(
        [*cmd, "-DAOTGEN_BLOCK_DOT_STANDALONE", str(bd.SOURCE), "-o", str(out)], check=True
    )
    lib = ctypes.CDLL(str(out))

    def run(bits: int, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        (m, k), n = x.shape, w.shape[0]
        out = torch.empty(m, n)
        ptr = ctypes.c_void_p
        lib.aotgen_block_linear(
            ctypes.c_int(bits), ptr(x.data_ptr()), ctypes.c_int64(m), ctypes.c_int64(k),
            ptr(w.data_ptr()), ptr(s.data_ptr()), ctypes.c_int64(n), ptr(out.data_ptr()),
        )  # fmt: skip
        return out

    return run


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,m", SHAPES)
def test_kernel_matches_reference(kernel, bits, n, k, m):
    g = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 32, 1, generator=g).repeat_interleave(
        32, 1
    ).reshape(m, k)  # blocks of different magnitudes
    x[0, :32] = 0  # an all-zero block: scale 0
    q, s = bd.quantize_int4(w) if bits == 4 else bd.quantize_int8(w)
    assert _rel(kernel(bits, x, q, s), bd.reference_linear(bits, x, q, s)) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_reference_is_float_math_on_the_quantized_values(bits):
    """reference_linear == dequantized activations @ dequantized weights (float64)."""
    g = torch.Generator().manual_seed(bits)
    w, x = torch.randn(96, 192, generator=g), torch.randn(3, 192, generator=g)
    if bits == 4:
        q, s = bd.quantize_int4(w)
        deq = bd.dequantize_int4(q, s)
    else:
        q, s = bd.quantize_int8(w)
        deq = bd.dequantize_int8(q, s)
    codes, dx, _ = bd.quantize_activations(x)
    x_deq = (codes * dx[..., None]).reshape(3, -1)
    want = x_deq.double() @ deq.double().T
    assert _rel(bd.reference_linear(bits, x, q, s).double(), want) < 1e-6
    # and the approximation itself: ~8 % (int4) and < 1 % (int8) on Gaussian data
    assert _rel(want.float(), x @ w.T) < (0.12 if bits == 4 else 0.015)


def test_int4_recovers_weights_on_its_grid():
    """A Q4_1 GGUF's weights (q * d + m, fp16 d and m, every code used) come back exactly."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 128), generator=g)
    q[:, ::32], q[:, 1::32] = 0, 15  # each block spans 0..15
    d = (torch.rand(64, 4, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-8 * d + torch.randn(64, 4, 1, generator=g) * 1e-3).half().float()
    w = (q.reshape(64, 4, 32) * d + m).reshape(64, 128)
    packed, scales = bd.quantize_int4(w)
    assert torch.equal(bd.unpack_int4(packed).long(), q)
    assert torch.equal(bd.dequantize_int4(packed, scales), w)


def test_int8_codes_stay_in_range():
    w = torch.randn(8, 64)
    w[0, 0] = -w.abs().max() * 2  # the extreme is negative: -127, never -128
    q, s = bd.quantize_int8(w)
    assert q.min() >= -127 and q[0, 0] == -127
    assert (bd.dequantize_int8(q, s) - w).abs().max() <= s.float().max() / 2 + 1e-6


def test_in_features():
    assert bd.in_features(576, 4) == 576 and bd.in_features(96, 4) == 128
    assert bd.in_features(96, 8) == 96 and bd.in_features(100, 8) == 128
