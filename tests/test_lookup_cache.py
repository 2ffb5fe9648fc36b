"""The n-gram cache that outlives a request (aotgen/runtime/lookup_cache.py): counts against a
brute-force recount, llama.cpp's file format byte for byte, its strict evidence rule, the
proposer asking it only where the request's own text convinces of nothing, damaged files
refused in one line, and engines that learn from each request: greedy text unchanged, a
repeated request drafted from the cache in fewer verify steps."""

from __future__ import annotations

import random
import struct
import threading
import time
from pathlib import Path

import pytest

from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.lookup_cache import LookupCache, LookupCacheError, PeriodicSave
from aotgen.runtime.ngram import NgramProposer


def _recount(texts: list[list[int]], key: tuple[int, ...]) -> dict[int, int]:
    counts: dict[int, int] = {}
    n = len(key)
    for text in texts:
        for i in range(n, len(text)):
            if tuple(text[i - n : i]) == key:
                counts[text[i]] = counts.get(text[i], 0) + 1
    return counts


def test_counts_equal_a_recount() -> None:
    rng = random.Random(0)
    texts = [[rng.randrange(5) for _ in range(rng.randint(0, 40))] for _ in range(6)]
    cache = LookupCache()
    for text in texts:
        cache.add(text)
    keys = {tuple(t[i - n : i]) for t in texts for n in range(1, 5) for i in range(n, len(t))}
    assert set(cache.table) == keys
    for key in keys:
        assert cache.table[key] == _recount(texts, key), key


def test_file_is_llama_cpps_format(tmp_path: Path) -> None:
    """[1, 2, 1]: n-grams (1) -> 2, (1, 2) -> 1, (2) -> 1, as llama.cpp's common_ngram_cache_save
    writes them (4 int32 token slots, -1 unused; the follower count; token/count pairs),
    sorted by n-gram."""
    cache = LookupCache()
    cache.add([1, 2, 1])
    cache.save(tmp_path / "c.bin")

    def record(ngram: list[int], pairs: list[tuple[int, int]]) -> bytes:
        slots = ngram + [-1] * (4 - len(ngram))
        body = b"".join(struct.pack("<ii", t, c) for t, c in pairs)
        return struct.pack("<4ii", *slots, len(pairs)) + body

    want = record([1], [(2, 1)]) + record([1, 2], [(1, 1)]) + record([2], [(1, 1)])
    assert (tmp_path / "c.bin").read_bytes() == want


def test_save_load_round_trip_and_unsorted_files(tmp_path: Path) -> None:
    rng = random.Random(1)
    cache = LookupCache()
    for _ in range(5):
        cache.add([rng.randrange(50) for _ in range(60)])
    cache.save(tmp_path / "c.bin")
    again = LookupCache.load(tmp_path / "c.bin", vocab_size=50)
    assert again.table == cache.table
    # llama.cpp writes its hash map's order, and a repeated n-gram adds up
    rec = struct.pack("<4ii", 7, 8, -1, -1, 1) + struct.pack("<ii", 9, 2)
    other = struct.pack("<4ii", 3, -1, -1, -1, 2) + struct.pack("<iiii", 4, 1, 5, 6)
    (tmp_path / "u.bin").write_bytes(rec + other + rec)
    loaded = LookupCache.load(tmp_path / "u.bin", vocab_size=10)
    assert loaded.table == {(7, 8): {9: 4}, (3,): {4: 1, 5: 6}}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (struct.pack("<4ii", 1, 2, -1, -1, 1) + struct.pack("<i", 3), "ends inside the followers"),
        (struct.pack("<4i", 1, 2, -1, -1), "ends inside an n-gram"),
        (struct.pack("<4ii", 1, -1, 2, -1, 1) + struct.pack("<ii", 3, 1), "a gap"),
        (struct.pack("<4ii", -1, -1, -1, -1, 1) + struct.pack("<ii", 3, 1), "no tokens"),
        (struct.pack("<4ii", 1, -1, -1, -1, 0), "0 followers"),
        (struct.pack("<4ii", 1, -1, -1, -1, 1) + struct.pack("<ii", 3, 0), "count 0"),
        (struct.pack("<4ii", 1, -1, -1, -1, 1) + struct.pack("<ii", 10, 1), "token 10 lies"),
    ],
)
def test_damaged_files_are_refused_in_one_line(tmp_path: Path, body: bytes, message: str) -> None:
    (tmp_path / "bad.bin").write_bytes(body)
    with pytest.raises(LookupCacheError, match=message) as e:
        LookupCache.load(tmp_path / "bad.bin", vocab_size=10)
    assert "\n" not in str(e.value) and "delete it or pass another file" in str(e.value)


def _cache(*texts: list[int]) -> LookupCache:
    cache = LookupCache()
    for text in texts:
        cache.add(text)
    return cache


def test_evidence_rule() -> None:
    """llama.cpp's strict counts for short n-grams (1-gram: 4 occurrences and 75 %; 2-gram: 3
    and 66 %); a 3- or 4-gram seen once convinces, two different followers (50 %) do not."""
    two_of_three = _cache([1, 2, 3] * 2 + [1, 2, 4])  # (1, 2) -> 3 twice, 4 once: 66 %
    assert [f.token for f in two_of_three.candidates([9, 1, 2], 2, 2)] == [3, 4]
    assert _cache([1, 2, 3] * 2).candidates([9, 1, 2], 2, 2) == []  # 2 occurrences: too few
    assert _cache([7, 8] * 3 + [7]).candidates([7], 1, 1) == []  # 3 occurrences of (7)
    assert [f.token for f in _cache([7, 8] * 4 + [7]).candidates([7], 1, 1)] == [8]
    assert [f.token for f in _cache([5, 6, 7, 8, 9]).candidates([5, 6, 7, 8], 1, 4)] == [9]
    assert [f.token for f in _cache([5, 6, 7, 9]).candidates([0, 5, 6, 7], 3, 4)] == [9]
    split = _cache([5, 6, 7, 8, 9], [5, 6, 7, 8, 10])
    assert split.candidates([5, 6, 7, 8], 3, 4) == []  # 4-gram and 3-gram (6, 7, 8) split 50 %


def test_proposer_asks_the_cache_only_where_its_own_text_fails() -> None:
    shared = _cache([10, 11, 12, 13, 14, 15])
    alone = NgramProposer(1, 4)
    with_cache = NgramProposer(1, 4, shared)
    assert alone.propose([1, 10, 11, 12], 3) == []
    assert with_cache.propose([1, 10, 11, 12], 3) == [13, 14, 15]
    # the request's own text convinces (a 3-gram seen once, lax): it wins over the cache
    own = [10, 11, 12, 99, 10, 11, 12]
    assert with_cache.propose(own, 1) == alone.propose(own, 1) == [99]


def test_aging_bounds_the_cache() -> None:
    cache = LookupCache(max_ngrams=8)
    cache.add([1, 2, 1, 2, 1, 2, 1, 2, 3, 4, 5, 6, 7])
    assert 0 < len(cache) <= 8
    assert cache.table[(1,)] == {2: 2}  # 4 occurrences halved; the once-seen n-grams forgotten


def _texts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50) for _ in range(rng.randrange(5, 40))] for _ in range(count)]


def test_snapshots_taken_while_another_thread_adds_are_whole() -> None:
    """A server writes snapshots from its own thread while the engine's thread adds texts:
    each snapshot equals a recount of the texts added before it (none half-added)."""
    cache, texts = LookupCache(), _texts(400, seed=5)
    adder = threading.Thread(target=lambda: [cache.add(t) for t in texts])
    adder.start()
    snapshots = []
    while adder.is_alive() or not snapshots:
        snapshots.append(cache.snapshot())
    adder.join()
    assert any(0 < s.additions < len(texts) for s in snapshots)  # some taken mid-way
    for snap in snapshots[:: max(1, len(snapshots) // 8)]:
        recount = LookupCache()
        for t in texts[: snap.additions]:
            recount.add(t)
        assert snap.table == recount.table


def test_periodic_save_writes_while_texts_come_and_once_more_on_close(tmp_path: Path) -> None:
    cache, path = LookupCache(), tmp_path / "c.bin"
    saver = PeriodicSave(cache, path, every_s=0.05)
    saver.start()
    time.sleep(0.2)
    assert not path.exists()  # nothing learnt, nothing written
    cache.add(_texts(1, seed=1)[0])
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert LookupCache.load(path, 50).table == cache.table  # written without a shutdown
    cache.add(_texts(1, seed=2)[0])
    saver.close()
    assert LookupCache.load(path, 50).table == cache.table


def test_no_interval_writes_on_close_only(tmp_path: Path) -> None:
    cache, path = LookupCache(), tmp_path / "c.bin"
    saver = PeriodicSave(cache, path, every_s=0)
    saver.start()
    cache.add([1, 2, 3, 4])
    time.sleep(0.1)
    assert not path.exists()
    saver.close()
    assert LookupCache.load(path, 50).table == cache.table


# ---- engines that learn ---------------------------------------------------------------------
NGRAM = GenerationConfig(max_new_tokens=24, ignore_eos=True, speculative="ngram", k=4)


def test_engine_drafts_a_repeated_request_from_the_cache(tiny_batch_package) -> None:
    """The same prompt three times: greedy ids never change; with a cache, the third request
    is drafted from the first two (fewer verify steps, more accepted) than without one."""
    engine = Engine.load(tiny_batch_package)
    prompt = [5, 9, 23, 41, 17, 3, 60, 8]
    plain = engine.generate(prompt, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    without = engine.generate(prompt, NGRAM)
    engine.lookup_cache = LookupCache()
    results = [engine.generate(prompt, NGRAM) for _ in range(3)]
    assert all(r.token_ids == plain.token_ids for r in (without, *results))
    assert len(engine.lookup_cache) > 0
    third = results[2].spec
    assert third.accepted > without.spec.accepted
    assert third.steps < without.spec.steps


def test_batch_engine_learns_from_finished_requests(tiny_batch_package) -> None:
    engine = BatchEngine.load(tiny_batch_package)
    engine.engine.lookup_cache = LookupCache()
    prompts = [[5, 9, 23, 41, 17, 3, 60, 8], [7, 7, 30, 2, 19]]
    first = engine.generate_many(prompts, [NGRAM, NGRAM])
    engine.generate_many(prompts, [NGRAM, NGRAM])
    third = engine.generate_many(prompts, [NGRAM, NGRAM])
    alone = Engine.load(tiny_batch_package)
    for p, a, b in zip(prompts, first, third, strict=True):
        want = alone.generate(p, GenerationConfig(max_new_tokens=24, ignore_eos=True))
        assert a.token_ids == b.token_ids == want.token_ids
    assert sum(r.spec.steps for r in third) < sum(r.spec.steps for r in first)
