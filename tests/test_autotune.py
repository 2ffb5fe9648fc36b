"""The build's autotune (aotgen/package/autotune.py): each candidate's fastest call over
interleaved rounds on cold weights, tiles measured under load flagged, a kernel change
re-measuring only the kinds that run it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from aotgen.package import autotune
from aotgen.package.autotune import Autotune, OthersMeter, cold, fastest_us

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
