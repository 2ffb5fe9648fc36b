"""The build's autotune (aotgen/package/autotune.py): each candidate's fastest call over
interleaved rounds on cold weights, timings contended by another process's threads measured
again, tiles measured under load flagged, a kernel change re-measuring only the kinds that run
it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch

from aotgen.package import autotune
from aotgen.package.autotune import Autotune, OthersMeter, cold, fastest_us, settled_us

KEY = ("float32", 48, 64, 3)


def test_fastest_call_wins_over_a_slow_burst():
    """A candidate slowed for its first rounds still counts at its fast speed, and the order
    of the answers follows the real costs."""
    calls = {"bursty": 0}

    def bursty():
        calls["bursty"] += 1
        time.sleep(0.02 if calls["bursty"] <= 4 else 0.001)

    us = fastest_us({"bursty": bursty, "slow": lambda: time.sleep(0.005)})
    assert us["bursty"] < 4000 < us["slow"], us
    assert calls["bursty"] > 4


class FakeOpenMP:
    """A kernel library's OpenMP thread setting, as `one_thread` drives it."""

    def __init__(self) -> None:
        self.threads = 2

    def omp_get_max_threads(self) -> int:
        return self.threads

    def omp_set_num_threads(self, threads: int) -> None:
        self.threads = threads


def contended_kernel(lib: FakeOpenMP, call_s: float, stalled_calls: float) -> Callable[[], None]:
    """A kernel call that, on all threads, waits out a 5 ms scheduler tick for its first
    `stalled_calls` calls, as when another process's threads hold the cores."""
    calls = {"all threads": 0}

    def run() -> None:
        if lib.threads > 1:
            calls["all threads"] += 1
            if calls["all threads"] <= stalled_calls:
                time.sleep(0.005)
                return
        time.sleep(call_s)

    return run


def test_contended_timing_is_measured_again(monkeypatch):
    """Candidates whose every call on all threads stalled, so that one would be chosen from
    noise, are measured again until the one chosen runs as fast as on one thread; each keeps
    its fastest call over the attempts."""
    monkeypatch.setattr(autotune.random, "uniform", lambda a, b: 0.0)
    lib = FakeOpenMP()
    runs = {  # stalled for more calls than one measurement makes
        "fast": contended_kernel(lib, call_s=0.0001, stalled_calls=20),
        "slow": contended_kernel(lib, call_s=0.001, stalled_calls=20),
    }
    first = fastest_us(runs)
    assert min(first.values()) > 4000, first  # the noise a plain measurement chooses from
    us, contended = settled_us(runs, lib, runs)
    assert not contended
    assert us["fast"] < 1000 < us["slow"] < 4000, us
    assert lib.threads == 2


def test_timing_contended_throughout_is_flagged(tmp_path, monkeypatch):
    """A timing that stays contended over every attempt flags its tile `busy`: the build says
    so, and `aotgen build --force` measures it again."""
    monkeypatch.setattr(autotune.random, "uniform", lambda a, b: 0.0)
    lib = FakeOpenMP()
    runs = {"stalled": contended_kernel(lib, call_s=0.0001, stalled_calls=float("inf"))}
    us, contended = settled_us(runs, lib, runs)
    assert contended and us["stalled"] > 4000, us

    monkeypatch.setattr(OthersMeter, "cores", lambda self: 0.0)
    monkeypatch.setattr(autotune, "settled_us", lambda runs, lib, checked: (fastest_us(runs), True))
    tune = Autotune(tmp_path)
    tune.choose(*KEY)
    assert "held the cores" in tune.busy_note()
    measured = []
    monkeypatch.setattr(
        Autotune, "_measure", lambda self, *key: measured.append(key) or tune.tiles[key]
    )
    Autotune(tmp_path, retune_busy=True).choose(*KEY)
    assert measured == [KEY]


def test_cold_copies_take_turns(monkeypatch):
    """A weight is handed out as equal copies in turn, enough of them to leave the caches;
    tuples keep their None parts; a weight larger than that is one copy."""
    monkeypatch.setattr(autotune, "COLD_BYTES", 1 << 20)
    w = torch.randn(64, 256)  # 64 KiB: 16 copies
    turns = cold((w, None))
    seen = [turns() for _ in range(17)]
    assert len({t[0].data_ptr() for t in seen}) == 16
    assert all(torch.equal(t[0], w) and t[1] is None for t in seen)
    big = torch.randn(1 << 19)  # 2 MiB
    turns = cold(big)
    assert turns().data_ptr() == turns().data_ptr() != big.data_ptr()


def test_other_processes_cpu_is_seen():
    """A process spinning beside the measurement shows as about a core of others' use."""
    spin = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
    meter = OthersMeter()
    with subprocess.Popen([sys.executable, "-c", spin]) as proc:
        time.sleep(0.5)  # let it start spinning
        with meter.measuring():
            time.sleep(1.0)
        proc.kill()
    if meter.cores() is None:
        pytest.skip("no /proc/stat on this system")
    assert meter.cores() > 0.5, meter.cores()


@pytest.mark.parametrize("others_cores", [0.0, 1.0])
def test_tiles_measured_under_load_are_flagged(tmp_path, monkeypatch, others_cores):
    """Tiles are cached either way, so a rebuild makes the same graphs; those measured while
    other processes used the CPU say so in every build that takes them, and `retune_busy`
    (`aotgen build --force`) measures them again."""
    monkeypatch.setattr(OthersMeter, "cores", lambda self: others_cores)
    tune = Autotune(tmp_path)
    tile = tune.choose(*KEY)
    busy = others_cores > 0
    assert (tune.busy_note() is not None) == busy
    measured = []
    monkeypatch.setattr(
        Autotune, "_measure", lambda self, *key: measured.append(key) or tune.tiles[key]
    )
    monkeypatch.setattr(OthersMeter, "cores", lambda self: None)  # nothing measured below
    again = Autotune(tmp_path)
    assert again.choose(*KEY) == tile and measured == []
    assert (again.busy_note() is not None) == busy
    retuned = Autotune(tmp_path, retune_busy=True)
    assert retuned.choose(*KEY) == tile
    assert measured == ([KEY] if busy else [])


def test_a_kernel_change_re_measures_its_kinds_only(tmp_path, monkeypatch):
    monkeypatch.setattr(OthersMeter, "cores", lambda self: 0.0)
    tune = Autotune(tmp_path)
    block_key = ("gguf-Q8_0", 48, 64, 3)
    for key in (KEY, block_key):
        tune.choose(*key)
    real = autotune._source_key
    monkeypatch.setattr(
        autotune, "_source_key", lambda kind: "changed" if kind == "float32" else real(kind)
    )
    measured = []
    monkeypatch.setattr(
        Autotune, "_measure", lambda self, *key: measured.append(key) or tune.tiles[key]
    )
    again = Autotune(tmp_path)
    for key in (KEY, block_key):
        again.choose(*key)
    assert measured == [KEY]


def test_concurrent_builds_keep_the_first_tile_saved(tmp_path, monkeypatch):
    """Builds sharing a cache: of two that measure a shape at the same time, both use the tile
    saved first, and a build that meets the shape later takes it without measuring, though it
    loaded the cache before. Their graphs, and compile-cache keys, then agree."""
    monkeypatch.setattr(OthersMeter, "cores", lambda self: 0.0)
    found = iter([(4, 2), (8, 1)])  # what each measurement finds, in turn; no third

    def measure(self, kind, n, k, rows):
        tile = autotune.Tile(kind, n, k, rows, *next(found), us=1.0, blas_us=2.0)
        if self is first:  # while it measures, the other build measures the shape and saves
            assert second.choose(*KEY) == (8, 1)
        return tile

    monkeypatch.setattr(Autotune, "_measure", measure)
    first, second, late = Autotune(tmp_path), Autotune(tmp_path), Autotune(tmp_path)
    assert first.choose(*KEY) == (8, 1)
    assert late.choose(*KEY) == (8, 1)
    assert Autotune(tmp_path).choose(*KEY) == (8, 1)
