"""The build's autotune: which tile of the packed-panel kernel (kernels/packed.py) runs each
linear shape fastest, measured on the build machine.

The fastest tile depends on the CPU (register file, cache sizes, 512- or 256-bit FMAs), on the
weight's shape (how many panel groups the threads share) and on the rows per step (a 7-row
verify wants a 7-row tile; decode several panels side by side to hide FMA latency), so it is
measured, not set by rule: each (weight type, N, K, rows) the pass meets is timed for the
candidate tiles with the kernel built as Inductor builds it (`-march=native`), and BLAS
(`F.linear` on the row-major weight) beside it for the report. Results are kept per CPU in
the project's cache, so a rebuild measures nothing.

Each call reads its weight from beyond the core's caches, as in a graph (where the model's other
weights pass through between two calls of one linear): the candidates take turns over enough
copies of it. With the weight hot in cache, the best tile for a 7-row step differed and was up
to 11 % slower on a cold weight.

Timing is made robust to the rest of the machine: the candidates are timed in interleaved
rounds and each keeps its fastest call (other work only ever adds time, and a burst of it lands
on every candidate instead of one). That fails where another process runs threads of its own on
the same cores (a second build measuring its tiles): a kernel's threads meet at a barrier, one of
them waits out a scheduler tick for its core, and every call takes 4-8 ms instead of 10-300 µs,
on every candidate, so the tile is picked from noise. The candidate a measurement would choose
is therefore timed again on one thread, which no barrier stalls; where it ran over CONTENDED
times slower on all threads, the candidates are measured again after a random pause (each
keeping its fastest call), up to RETRIES times. Where other processes used the CPU while the
tiles were measured (`/proc/stat`), or a measurement stayed contended, they are cached flagged
`busy`, and every build that uses them says so:
tiles picked under load cost SmolLM2's verify step a quarter of its time (docs/benchmarks.md).
A rebuild reuses them, so its graphs (and their compiles) stay the same; `retune_busy`
(`aotgen build --force`) measures them again.

The int8-activation block linears (kernels/block_dot.py, kinds `block-int4` / `block-int8`) are
timed twice: on `gguf_dot`'s panels (their Q4_1 / Q8_0 blocks, every tile) and on
`block_dot.cpp`; `choose` answers `BLOCK_DOT` where the latter was faster. bfloat16 weights are
timed against the CPU's own bfloat16 matmul (`F.linear`, oneDNN), which `choose` answers
`ROW_MAJOR` for at several rows where it was faster.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import platform
import random
import resource
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from ctypes import CDLL
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from aotgen.kernels import block_dot as bd
from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import gguf_dot
from aotgen.kernels import packed as pk
from aotgen.passes.pack import BLOCK_DOT, ROW_MAJOR  # `choose`'s answers: keep that kernel

# Each candidate runs in ROUNDS interleaved rounds, each up to ROUND_CALLS calls or
# ROUND_BUDGET_S (at least one call); its fastest call counts.
ROUNDS = 5
ROUND_CALLS = 3
ROUND_BUDGET_S = 0.004
# A call on all threads that took over CONTENDED times its time on one thread, plus
# CONTENDED_US, was contended: quiet, two threads run a call in 0.5-0.7 of one thread's time,
# and trail it by 1-3 µs on the smallest shapes; stalled at a barrier, they took 3-1000 times
# it. Under steady load from other work, about 1 times. How often to measure it again:
CONTENDED = 2.0
CONTENDED_US = 50.0
RETRIES = 3
# Other processes' CPU use while measuring, in cores, above which the tiles are flagged busy.
BUSY_CORES = 0.2
BLOCK_QTYPES = {"block-int4": "Q4_1", "block-int8": "Q8_0"}  # its weights as GGUF blocks
COLD_BYTES = 64 << 20  # copies of a weight the candidates take turns over (beyond L2)


@dataclass(frozen=True)
class Tile:
    kind: str  # float32 | bfloat16 | int8 | gguf-<type> | gguf-dot-<type> | block-int4 | -int8
    n: int
    k: int
    rows: int  # activation rows per call
    tile_rows: int
    tile_panels: int
    us: float  # the chosen tile, microseconds per call
    blas_us: float  # F.linear on the row-major weight (float32; bfloat16 for that kind)
    block_dot_us: float | None = None  # block kinds: block_dot.cpp (`us`: gguf_dot's best tile)


def fastest_us(runs: dict[Any, Callable[[], object]]) -> dict[Any, float]:
    """Each callable's fastest call in microseconds, over ROUNDS rounds that each run every
    callable in turn."""
    best = {}
    for name, fn in runs.items():
        fn()  # warm: first-touch, code and data into cache
        best[name] = float("inf")
    for _ in range(ROUNDS):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(ROUND_CALLS):
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                best[name] = min(best[name], t1 - t0)
                if t1 - start > ROUND_BUDGET_S:
                    break
    return {name: round(s * 1e6, 1) for name, s in best.items()}


@contextmanager
def one_thread(lib: CDLL) -> Iterator[None]:
    """The kernel library's OpenMP regions run on one thread (its OpenMP runtime's setting)."""
    threads = lib.omp_get_max_threads()
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(threads)


def settled_us(
    runs: dict[Any, Callable[[], object]], lib: CDLL, checked: Collection[Any]
) -> tuple[dict[Any, float], bool]:
    """`fastest_us`, measured again while the `checked` candidate it would choose (a call of
    `lib`) ran over CONTENDED times slower on all threads than on one; each candidate keeps its
    fastest call over the attempts. Also whether the last attempt was still contended. On one
    thread there is no barrier to stall, and nothing to check."""
    us = fastest_us(runs)
    if lib.omp_get_max_threads() == 1:
        return us, False
    for attempt in range(RETRIES + 1):
        name = min(checked, key=us.get)
        with one_thread(lib):
            serial = fastest_us({name: runs[name]})[name]
        if us[name] <= CONTENDED * serial + CONTENDED_US:
            return us, False
        if attempt < RETRIES:
            time.sleep(random.uniform(0.1, 0.5))  # out of step with the other process
            again = fastest_us(runs)
            us = {run: min(us[run], again[run]) for run in us}
    return us, True


def cold(weight: Tensor | tuple[Tensor | None, ...]) -> Callable[[], Any]:
    """Copies of a weight (a tensor or a tuple of them) totalling COLD_BYTES or more, handed
    out in turn: each call reads a copy the previous calls pushed out of the core's caches."""
    parts = weight if isinstance(weight, tuple) else (weight,)
    size = sum(t.numel() * t.element_size() for t in parts if t is not None)
    copies = []
    for _ in range(max(1, COLD_BYTES // max(size, 1))):
        clone = tuple(None if t is None else t.clone() for t in parts)
        copies.append(clone if isinstance(weight, tuple) else clone[0])
    turns = itertools.cycle(copies)
    return lambda: next(turns)


def _busy_jiffies() -> int | None:
    """Every CPU's non-idle time so far, in clock ticks (None where /proc/stat is absent)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return user + nice + system + irq + softirq + steal


class OthersMeter:
    """CPU seconds that processes other than this one use while measuring, summed over the
    `with` blocks it guards (None where the machine does not say)."""

    def __init__(self) -> None:
        self.others_s: float | None = 0.0
        self.wall_s = 0.0

    @contextmanager
    def measuring(self) -> Iterator[None]:
        t0, own0, all0 = time.perf_counter(), _own_cpu_s(), _busy_jiffies()
        yield
        all1 = _busy_jiffies()
        self.wall_s += time.perf_counter() - t0
        if all0 is None or all1 is None or self.others_s is None:
            self.others_s = None
        else:
            own_s = _own_cpu_s() - own0
            self.others_s += max((all1 - all0) / os.sysconf("SC_CLK_TCK") - own_s, 0.0)

    def cores(self) -> float | None:
        """Other processes' average CPU use while measuring, in cores."""
        if self.others_s is None or self.wall_s == 0:
            return None
        return round(self.others_s / self.wall_s, 2)


def _own_cpu_s() -> float:
    """This process's CPU time, with its finished children's (the compiler building a kernel)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def candidates(rows: int, max_acc: Callable[[int], int] | None = None) -> list[tuple[int, int]]:
    """Distinct tiles for `rows` rows: heights of all rows (up to 8), 4 and 6; every width
    whose accumulators fit the registers (`max_acc(lanes)` vectors, default packed.cpp's)."""
    lanes = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
    acc = max_acc(lanes) if max_acc else None
    heights = sorted({min(rows, 8), *(h for h in (4, 6) if h < rows)})
    return sorted({(h, pk.tile_panels(h, p, lanes, acc)) for h in heights for p in pk.PANELS})


class Autotune:
    """`choose(kind, n, k, rows)` -> (tile rows, tile panels); every measurement is kept in
    `tiles` for the build report and the manifest, and each new one is added to the cache."""

    def __init__(self, cache_dir: Path | None, retune_busy: bool = False):
        self.tiles: dict[tuple[str, int, int, int], Tile] = {}
        self.others = OthersMeter()
        self.retune_busy = retune_busy
        self.reused_busy = 0  # tiles taken from the cache that were measured under load
        self.contended = 0  # shapes whose timings stayed contended (`settled_us`)
        self._contended_now = False  # the shape being measured
        self._file = cache_dir / f"tiles-{_machine_key()}.json" if cache_dir else None
        self._known: dict[str, dict] = self._saved()

    def _saved(self) -> dict[str, dict]:
        """The cache file's tiles: builds sharing the cache add to it as they go."""
        if self._file and self._file.exists():
            return json.loads(self._file.read_text())
        return {}

    def _reload(self) -> None:
        self._known = {**self._known, **self._saved()}

    def _cached(self, key: tuple[str, int, int, int]) -> Tile | None:
        """The known tile, unless measured with another version of its kernel or to be
        measured again."""
        known = dict(self._known.get(repr(key), {}))
        source, busy = known.pop("source", None), known.pop("busy", False)
        if not known or source != _source_key(key[0]) or (busy and self.retune_busy):
            return None
        self.reused_busy += busy
        return Tile(**known)

    def choose(self, kind: str, n: int, k: int, rows: int) -> tuple[int, int]:
        """The fastest tile; `BLOCK_DOT` for a block kind whose own kernel was faster, and
        `ROW_MAJOR` for bfloat16 at several rows where F.linear was."""
        key = (kind, n, k, rows)
        if key not in self.tiles:
            tile = self._cached(key)
            if tile is None:  # a build sharing the cache may have measured it since
                self._reload()
                tile = self._cached(key) or self._measure_and_save(key)
            self.tiles[key] = tile
        tile = self.tiles[key]
        if tile.block_dot_us is not None and tile.block_dot_us < tile.us:
            return BLOCK_DOT
        if kind == "bfloat16" and rows > 1 and tile.blas_us < tile.us:
            return ROW_MAJOR
        return tile.tile_rows, tile.tile_panels

    @property
    def quiet(self) -> bool:
        """Whether other processes left the CPU alone while this tuner measured."""
        cores = self.others.cores()
        return cores is None or cores <= BUSY_CORES

    def _measure_and_save(self, key: tuple[str, int, int, int]) -> Tile:
        """Measure the shape's tile and save it at once, unless a build sharing the cache saved
        a usable one for it meanwhile (checked under the cache file's lock): then that one is
        used, so that their graphs, and compile-cache keys, agree."""
        this = OthersMeter()
        self._contended_now = False
        with self.others.measuring(), this.measuring():
            tile = self._measure(*key)
        self.contended += self._contended_now
        if self._file is None:
            return tile
        self._file.parent.mkdir(parents=True, exist_ok=True)
        with open(self._file.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._reload()
            if (saved := self._cached(key)) is not None:
                return saved
            busy = (this.cores() or 0.0) > BUSY_CORES or self._contended_now
            entry = {**asdict(tile), "source": _source_key(key[0]), "busy": busy}
            self._known[repr(key)] = entry
            tmp = self._file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._known, indent=0))
            tmp.replace(self._file)
        return tile

    def busy_note(self) -> str | None:
        """Why this build's tiles may not be the fastest, if they were measured under load."""
        if not self.quiet:
            return f"measured while other processes used {self.others.cores():.1f} cores"
        if self.contended:
            return f"in part ({self.contended}) measured while other processes held the cores"
        if self.reused_busy:
            return f"in part ({self.reused_busy}) measured on a busy machine by an earlier build"
        return None

    def _timed(
        self, runs: dict[Any, Callable[[], object]], lib: CDLL | None, checked: Collection[Any]
    ) -> dict[Any, float]:
        """Each run's fastest call, settled against contention where there is a kernel."""
        if lib is None or not checked:
            return fastest_us(runs)
        us, contended = settled_us(runs, lib, checked)
        self._contended_now |= contended
        return us

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
        elif kind == "bfloat16":
            w = w.bfloat16()
        packed = cold(pk.pack(w))
        out = torch.empty(rows, pk.padded_outputs(n))
        runs = {}
        if lib is not None:
            for tile in candidates(rows):
                runs[tile] = lambda t=tile: pk.run_library(lib, x, packed(), scale, *t, out=out)
        # bfloat16 against the CPU's bfloat16 matmul (the pass keeps it where it is faster)
        dense = cold(w if kind == "bfloat16" else w.float())
        x_blas = x.bfloat16() if kind == "bfloat16" else x
        runs["blas"] = lambda: F.linear(x_blas, dense())
        return _fastest_tile(kind, n, k, rows, self._timed(runs, lib, set(runs) - {"blas"}))

    def _measure_blocks(self, kind: str, n: int, k: int, rows: int) -> Tile:
        """A GGUF block kernel (kernels/gguf_blocks.py, or gguf_dot.py for integer dots) on
        random blocks of the type."""
        kernel = gguf_dot if kind.startswith("gguf-dot-") else gb
        q = gb.QTYPES[kind.split("-")[-1]]
        lib = kernel.library()
        packed = cold(gb.pack(gb.decode(gb.random_blocks(q, n, k), q.name, (n, k))))
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
        out = torch.empty(rows, pk.padded_outputs(n))
        runs = {}
        if lib is not None:
            for tile in candidates(rows, kernel.max_acc):
                runs[tile] = lambda t=tile: kernel.run_library(lib, x, packed(), q, *t, out=out)
        dense = cold(torch.randn(n, k))
        runs["blas"] = lambda: F.linear(x, dense())
        return _fastest_tile(kind, n, k, rows, self._timed(runs, lib, set(runs) - {"blas"}))

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
        weight = cold(bd.quantize_int4(w) if bits == 4 else bd.quantize_int8(w))
        out = torch.empty(rows, n)
        run = {"block_dot": lambda: bd.run_library(lib, bits, x, *weight(), out=out)}
        us = self._timed(run, lib, run)
        return replace(tile, kind=kind, block_dot_us=us["block_dot"])

    def summary(self) -> list[dict]:
        return [
            asdict(t) for t in sorted(self.tiles.values(), key=lambda t: (t.kind, t.n, t.k, t.rows))
        ]


def _fastest_tile(kind: str, n: int, k: int, rows: int, us: dict) -> Tile:
    blas_us = us.pop("blas")
    best = min(us, key=us.get) if us else (min(rows, 8), 1)
    return Tile(kind, n, k, rows, *best, us.get(best, 0.0), blas_us)


def _cpuinfo_model_line() -> str:
    """/proc/cpuinfo's `model name` line, "" where there is none."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return ""
    return next((line for line in cpuinfo.read_text().splitlines() if "model name" in line), "")


def cpu_model() -> str:
    """The CPU's model name, for the measurement scripts' headers."""
    line = _cpuinfo_model_line()
    return line.split(":", 1)[1].strip() if ":" in line else platform.processor() or "unknown CPU"


def _machine_key() -> str:
    """Tiles are only valid for the CPU and thread count they were measured with."""
    parts = (
        _cpuinfo_model_line(),
        platform.machine(),
        torch.get_num_threads(),
        torch.backends.cpu.get_cpu_capability(),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


@cache  # read once per process: every lookup asks
def _source_key(kind: str) -> str:
    """The kernel sources a kind's timings depend on: a change to one re-measures its kinds only."""
    if kind in BLOCK_QTYPES:
        sources = (gguf_dot.SOURCE, bd.SOURCE)
    elif kind.startswith("gguf-dot-"):
        sources = (gguf_dot.SOURCE,)
    elif kind.startswith("gguf-"):
        sources = (gb.SOURCE,)
    else:
        sources = (pk.SOURCE,)
    return hashlib.sha256(repr([s.read_text() for s in sources]).encode()).hexdigest()[:16]
