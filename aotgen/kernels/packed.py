"""Linears on weights packed in panels of 16 outputs, register-tiled over several rows.

A verify step (k + 1 rows), a prefill chunk or a batch multiplies every weight by several
activation rows. Inductor's reductions (passes/gemv.py) re-read each weight element from
memory per row, and BLAS copies (packs) the whole weight on every call; `packed.cpp` keeps a
tile of rows x 16-output panels of accumulators in registers, so each weight vector is loaded
once per step and multiplied into every row (layout and tiling: packed.cpp's header). The
weight is packed once, at build time, into the package's safetensors; the same layout serves
one row (decode) as well.

The ops are `torch.library` custom ops with an eager reference, so they export; AOTInductor
links `packed.cpp` into each graph's `.so` as their C shims (export/shims.py; nothing extra
at run time).
The tile (`rows` x `panels`) is an argument of the op, chosen per shape by the build's
autotune (package/autotune.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from aotgen.tempdirs import private_dir

PANEL = 16
SOURCE = Path(__file__).with_name("packed.cpp")
ROWS = (1, 2, 3, 4, 5, 6, 7, 8)  # the tile heights packed.cpp instantiates
PANELS = (1, 2, 3, 4, 6, 8)  # and widths, in panels


def tile_panels(rows: int, panels: int, lanes: int, max_acc: int | None = None) -> int:
    """The tile width packed.cpp runs for a requested `rows` x `panels` (`tile_panels` there):
    the widest instantiated one whose accumulators fit the registers (`max_acc` vectors,
    default packed.cpp's)."""
    vecs = PANEL // lanes
    max_acc = max_acc or (28 if lanes == 16 else 14)
    fits = max(1, max_acc // (rows * vecs))
    return max(p for p in PANELS if p <= panels and p <= fits) if panels >= 1 else 1


def padded_outputs(n: int) -> int:
    return -(-n // PANEL) * PANEL


def slot(outputs: Tensor) -> Tensor:
    """Where output `n % 16` sits in a bfloat16 panel row: outputs 0-7 in the even slots, 8-15
    in the odd ones (packed.cpp widens a row's two halves with one shift and one mask)."""
    return outputs % 8 * 2 + outputs // 8


def pack(w: Tensor) -> Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: panel p holds outputs 16p..16p+15, input-major (for
    bfloat16 in `slot` order). Outputs past N are zero."""
    n, k = w.shape
    padded = torch.zeros(padded_outputs(n), k, dtype=w.dtype, device=w.device)
    padded[:n] = w
    packed = padded.reshape(-1, PANEL, k).transpose(1, 2)
    if w.dtype == torch.bfloat16:
        packed = packed[..., torch.argsort(slot(torch.arange(PANEL)))]
    return packed.contiguous()


def unpack(packed: Tensor) -> Tensor:
    """[P, K, 16] -> [16 P, K] (padding included)."""
    p, k, _ = packed.shape
    if packed.dtype == torch.bfloat16:
        packed = packed[..., slot(torch.arange(PANEL))]
    return packed.transpose(1, 2).reshape(p * PANEL, k)


def gather_rows(packed: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` of the unpacked weight ([*ids.shape, K]), read from the panels: an embedding
    that shares its table with a packed head needs no second copy."""
    lo = ids % PANEL
    if packed.dtype == torch.bfloat16:
        lo = slot(lo)
    return torch.ops.aten.index.Tensor(packed, [ids // PANEL, None, lo])


@torch.library.custom_op("aotgen::packed_linear", mutates_args=())
def packed_linear(x: Tensor, weight: Tensor, rows: int, panels: int) -> Tensor:
    """x [M, K] float32 @ unpack(weight)^T -> [M, 16 P]."""
    return x @ unpack(weight).T


@torch.library.custom_op("aotgen::packed_linear_bf16", mutates_args=())
def packed_linear_bf16(x: Tensor, weight: Tensor, rows: int, panels: int) -> Tensor:
    """x [M, K] float32 @ unpack(weight bfloat16)^T, summed in float32 -> [M, 16 P]."""
    return x @ unpack(weight).float().T


@torch.library.custom_op("aotgen::packed_linear_int8", mutates_args=())
def packed_linear_int8(x: Tensor, weight: Tensor, scale: Tensor, rows: int, panels: int) -> Tensor:
    """x [M, K] float32 @ (unpack(weight int8) * scale[:, None])^T -> [M, 16 P]."""
    return (x @ unpack(weight).float().T) * scale


@packed_linear.register_fake
def _(x: Tensor, weight: Tensor, rows: int, panels: int) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] * PANEL)


@packed_linear_bf16.register_fake
def _(x: Tensor, weight: Tensor, rows: int, panels: int) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] * PANEL)


@packed_linear_int8.register_fake
def _(x: Tensor, weight: Tensor, scale: Tensor, rows: int, panels: int) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] * PANEL)


OP_FOR = {  # the weight's dtype -> its op
    torch.float32: torch.ops.aotgen.packed_linear.default,
    torch.bfloat16: torch.ops.aotgen.packed_linear_bf16.default,
    torch.int8: torch.ops.aotgen.packed_linear_int8.default,
}
OPS = tuple(OP_FOR.values())


# ---- the kernel as a plain shared library: tests and the build's autotune ---------------------
@cache
def library(
    arch_flags: tuple[str, ...] = ("-march=native",),
    source: Path = SOURCE,
    define: str = "AOTGEN_PACKED_STANDALONE",
) -> ctypes.CDLL | None:
    """A kernel source (packed.cpp by default) built with `arch_flags` and its standalone
    `define` (None without a C++ compiler). Cached by source and flags in this user's private
    temp dir, where no one else can plant a library: a build's autotune and the tests share it."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None
    key = hashlib.sha256(source.read_bytes() + repr(arch_flags).encode()).hexdigest()[:16]
    out = private_dir() / f"{source.stem}-{key}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{id(out)}.tmp")
        cmd = [compiler, "-shared", "-fPIC", "-std=c++17", "-O2", "-fopenmp", *arch_flags]
        subprocess.run(
            [*cmd, f"-D{define}", str(source), "-o", str(tmp)], check=True, capture_output=True
        )
        tmp.replace(out)
    return ctypes.CDLL(str(out))


def run_library(
    lib: ctypes.CDLL,
    x: Tensor,
    weight: Tensor,
    scale: Tensor | None,
    rows: int,
    panels: int,
    out: Tensor | None = None,
) -> Tensor:
    """The C++ kernel on contiguous CPU tensors (x float32 [M, K]; the weight float32,
    bfloat16, or int8 with `scale`)."""
    (m, k), n = x.shape, weight.shape[0] * PANEL
    out = torch.empty(m, n) if out is None else out
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.aotgen_packed_linear(
        ctypes.c_int(weight.element_size() * 8), ptr(x.data_ptr()), i64(m), i64(k),
        ptr(weight.data_ptr()), ptr(scale.data_ptr() if scale is not None else 0), i64(n),
        ptr(out.data_ptr()), ctypes.c_int(rows), ctypes.c_int(panels),
    )  # fmt: skip
    return out
