"""The build's autotune: which tile of the packed-panel kernel (kernels/packed.py) runs each
linear shape fastest, measured on the build machine.

The fastest tile depends on the CPU (register file, cache sizes, 512- or 256-bit FMAs), on the
weight's shape (how many panel groups the threads share) and on the rows per step (a 7-row
verify wants a 7-row tile; decode several panels side by side to hide FMA latency), so it is
measured, not set by rule: each (weight type, N, K, rows) the pass meets is timed for the
candidate tiles with the kernel built as Inductor builds it (`-march=native`), and BLAS
(`F.linear` on the row-major weight) beside it for the report. Results are kept per CPU in
the project's cache, so a rebuild measures nothing.

The int8-activation block linears (kernels/block_dot.py, kinds `block-int4` / `block-int8`) are
timed twice: on `gguf_dot`'s panels (their Q4_1 / Q8_0 blocks, every tile) and on
`block_dot.cpp`; `choose` answers `BLOCK_DOT` where the latter was faster.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from aotgen.kernels import block_dot as bd
from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import gguf_dot
from aotgen.kernels import packed as pk
from aotgen.passes.pack import BLOCK_DOT  # `choose` for a block linear faster on block_dot.cpp

# Time spent per candidate, at least one call; the median of the calls counts.
BUDGET_S = 0.02
MAX_CALLS = 9
BLOCK_QTYPES = {"block-int4": "Q4_1", "block-int8": "Q8_0"}  # its weights as GGUF blocks


@dataclass(frozen=True)
class Tile:
    kind: str  # "float32" | "int8" | "gguf-<block type>" | "gguf-dot-<block type>" | "block-int4|8"
    n: int
    k: int
    rows: int  # activation rows per call
    tile_rows: int
    tile_panels: int
    us: float  # the chosen tile, microseconds per call
    blas_us: float  # F.linear on the row-major float32 weight, for comparison
    block_dot_us: float | None = None  # block kinds: block_dot.cpp (`us`: gguf_dot's best tile)


def _median_us(fn, budget_s: float = BUDGET_S) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MAX_CALLS and (not times or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6


def candidates(rows: int, max_acc: Callable[[int], int] | None = None) -> list[tuple[int, int]]:
    """Distinct tiles for `rows` rows: heights of all rows (up to 8), 4 and 6; every width
    whose accumulators fit the registers (`max_acc(lanes)` vectors, default packed.cpp's)."""
    lanes = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
    acc = max_acc(lanes) if max_acc else None
    heights = sorted({min(rows, 8), *(h for h in (4, 6) if h < rows)})
    return sorted({(h, pk.tile_panels(h, p, lanes, acc)) for h in heights for p in pk.PANELS})


class Autotune:
    """`choose(kind, n, k, rows)` -> (tile rows, tile panels); every measurement is kept in
    `tiles` for the build report and the manifest."""

    def __init__(self, cache_dir: Path | None):
        self.tiles: dict[tuple[str, int, int, int], Tile] = {}
        self._file = cache_dir / f"tiles-{_machine_key()}.json" if cache_dir else None
        self._known: dict[str, dict] = {}
        if self._file and self._file.exists():
            self._known = json.loads(self._file.read_text())

    def choose(self, kind: str, n: int, k: int, rows: int) -> tuple[int, int]:
        """The fastest tile, or `BLOCK_DOT` for a block kind whose own kernel was faster."""
        key = (kind, n, k, rows)
        if key not in self.tiles:
            known = self._known.get(repr(key))
            self.tiles[key] = Tile(**known) if known else self._measure(*key)
            if not known and self._file:
                self._known[repr(key)] = asdict(self.tiles[key])
                self._file.parent.mkdir(parents=True, exist_ok=True)
                tmp = self._file.with_suffix(".tmp")
                tmp.write_text(json.dumps(self._known, indent=0))
                tmp.replace(self._file)
        tile = self.tiles[key]
        if tile.block_dot_us is not None and tile.block_dot_us < tile.us:
            return BLOCK_DOT
        return tile.tile_rows, tile.tile_panels

    def _measure(self, kind: str, n: int, k: int, rows: int) -> Tile:
        if kind in BLOCK_QTYPES:
            return self._measure_block_dot(kind, n, k, rows)
        if kind.startswith("gguf-"):
            return self._measure_blocks(kind, n, k, rows)
        lib = pk.library()
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(rows, k, generator=gen)
        scale = None
        if kind == "int8":
            scale = torch.full((pk.padded_outputs(n),), 0.01)
            w = w.mul(20).clamp(-127, 127).to(torch.int8)
        packed = pk.pack(w)
        out = torch.empty(rows, pk.padded_outputs(n))
        timed = []
        if lib is not None:
            for tile in candidates(rows):
                run = lambda t=tile: pk.run_library(lib, x, packed, scale, *t, out=out)  # noqa: E731
                timed.append((_median_us(run), tile))
        dense = w.float()
        blas_us = _median_us(lambda: F.linear(x, dense))
        us, (tile_rows, tile_panels) = min(timed) if timed else (0.0, (min(rows, 8), 1))
        return Tile(kind, n, k, rows, tile_rows, tile_panels, round(us, 1), round(blas_us, 1))

    def _measure_blocks(self, kind: str, n: int, k: int, rows: int) -> Tile:
        """A GGUF block kernel (kernels/gguf_blocks.py, or gguf_dot.py for integer dots) on
        random blocks of the type."""
        kernel = gguf_dot if kind.startswith("gguf-dot-") else gb
        q = gb.QTYPES[kind.split("-")[-1]]
        lib = kernel.library()
        packed = gb.pack(gb.decode(gb.random_blocks(q, n, k), q.name, (n, k)))
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
        out = torch.empty(rows, pk.padded_outputs(n))
        timed = []
        if lib is not None:
            for tile in candidates(rows, kernel.max_acc):
                run = lambda t=tile: kernel.run_library(lib, x, packed, q, *t, out=out)  # noqa: E731
                timed.append((_median_us(run), tile))
        dense = torch.randn(n, k)
        blas_us = _median_us(lambda: F.linear(x, dense))
        us, (tile_rows, tile_panels) = min(timed) if timed else (0.0, (min(rows, 8), 1))
        return Tile(kind, n, k, rows, tile_rows, tile_panels, round(us, 1), round(blas_us, 1))

    def _measure_block_dot(self, kind: str, n: int, k: int, rows: int) -> Tile:
        """A block linear on gguf_dot's panels (every tile) and on block_dot.cpp, both built
        as Inductor builds them."""
        tile = self._measure_blocks(f"gguf-dot-{BLOCK_QTYPES[kind]}", n, k, rows)
        lib = bd.library()
        if lib is None:
            return replace(tile, kind=kind)
        bits = 4 if kind == "block-int4" else 8
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
        q, s = bd.quantize_int4(w) if bits == 4 else bd.quantize_int8(w)
        out = torch.empty(rows, n)
        us = _median_us(lambda: bd.run_library(lib, bits, x, q, s, out=out))
        return replace(tile, kind=kind, block_dot_us=round(us, 1))

    def summary(self) -> list[dict]:
        return [
            asdict(t) for t in sorted(self.tiles.values(), key=lambda t: (t.kind, t.n, t.k, t.rows))
        ]


def _machine_key() -> str:
    """Tiles are only valid for the CPU, thread count and kernel they were measured with."""
    cpu = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line for line in cpuinfo.read_text().splitlines() if "model name" in line), "")
    parts = (
        cpu,
        platform.machine(),
        torch.get_num_threads(),
        torch.backends.cpu.get_cpu_capability(),
        pk.SOURCE.read_text(),
        gb.SOURCE.read_text(),
        gguf_dot.SOURCE.read_text(),
        bd.SOURCE.read_text(),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
