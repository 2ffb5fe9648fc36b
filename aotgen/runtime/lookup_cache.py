"""n-gram counts that outlive a request: what followed every short n-gram of earlier texts.

A request's own text (`ngram.NgramIndex`) only helps once the answer starts repeating it. A
service answering many requests sees the same answers, code and JSON shapes again and again:
this cache counts the followers of every 1..4-gram of each finished request (prompt and
answer), and n-gram lookup drafts from it where the request's own text has no convincing
match. It is llama.cpp's dynamic lookup cache (`llama-lookup --lookup-cache-dynamic`):
- its evidence rule, with its "strict" thresholds for 1- and 2-grams (text from other
  requests is weaker evidence than the request's own), but a 3- or 4-gram seen once convinces
  (llama.cpp asks twice), so that an answer repeated, or shaped like one before it, is
  drafted from its second occurrence on, not its third (measured: docs/speculative.md);
- the same file format (llama.cpp's `common_ngram_cache_save`), so a cache written by either
  program is read by the other: per n-gram, 4 int32 token slots (unused ones -1), the number
  of followers, then (token, count) int32 pairs, little-endian. aotgen writes the n-grams and
  followers sorted, so equal caches are equal files.

Speculation is lossless, so a cache only changes speed, never text. A cache is shared across
requests and users: what one request taught shows in how fast another's answer comes.
The C++ runtime (`runtime/cpp/lookup_cache.cpp`) implements the same rules and reads and
writes the same files.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from aotgen.runtime.ngram import Follower, convincing

MAX_N = 4  # llama.cpp's LLAMA_NGRAM_MAX: token slots per n-gram in the file
# Occurrences an n-gram needs and its top follower's share in percent, by n (1, 2, 3, 4):
# llama.cpp's `draft_min_sample_size_strict` / `draft_min_percent_strict` ({4, 3, 2, 2},
# {75, 66, 66, 66}) but for the 3- and 4-grams' occurrences.
MIN_OCCURRENCES = (4, 3, 1, 1)
MIN_PERCENT = (75, 66, 66, 66)
MAX_NGRAMS = 500_000  # past this many n-grams, counts halve and the ones at zero go
SAVE_EVERY_S = 60.0  # a server's writes of its cache while requests add to it (PeriodicSave)
_COUNT_MAX = 2**31 - 1
_HEAD = struct.Struct(f"<{MAX_N}ii")
_PAIR = struct.Struct("<ii")


class LookupCacheError(ValueError):
    """A lookup-cache file that cannot be read: what is wrong, and what to do."""


class LookupCache:
    """n-gram -> {follower: count} over every text added, for n = 1..4."""

    def __init__(self, max_ngrams: int = MAX_NGRAMS) -> None:
        if max_ngrams < 1:
            raise ValueError(f"max_ngrams must be >= 1, got {max_ngrams}")
        self.max_ngrams = max_ngrams
        self.table: dict[tuple[int, ...], dict[int, int]] = {}
        self.additions = 0  # texts added: a saver compares it to know whether to write again
        self._lock = threading.Lock()  # add vs snapshot: a server saves from another thread

    def __len__(self) -> int:
        return len(self.table)

    def add(self, tokens: Sequence[int]) -> None:
        """Count every n-gram of a finished request's text (prompt + answer) and its follower."""
        toks = [int(t) for t in tokens]
        with self._lock:
            for n in range(1, MAX_N + 1):
                for i in range(n, len(toks)):
                    part = self.table.setdefault(tuple(toks[i - n : i]), {})
                    part[toks[i]] = min(part.get(toks[i], 0) + 1, _COUNT_MAX)
            while len(self.table) > self.max_ngrams:
                self._age()
            self.additions += 1

    def snapshot(self) -> LookupCache:
        """A copy taken between two `add`s, to write while requests go on adding to this one
        (a copy takes an eighth of what writing it does)."""
        with self._lock:
            copy = LookupCache(self.max_ngrams)
            copy.table = {key: part.copy() for key, part in self.table.items()}
            copy.additions = self.additions
        return copy

    def _age(self) -> None:
        """Halve every count and forget what reaches zero: n-grams seen once go first, and
        what the traffic no longer repeats fades."""
        aged: dict[tuple[int, ...], dict[int, int]] = {}
        for key, part in self.table.items():
            kept = {t: c // 2 for t, c in part.items() if c >= 2}
            if kept:
                aged[key] = kept
        self.table = aged

    def followers(self, context: Sequence[int], n: int) -> list[Follower]:
        """What followed the last n tokens of context, most frequent (then lowest id) first."""
        if not 1 <= n <= min(MAX_N, len(context)):
            return []
        part = self.table.get(tuple(int(t) for t in context[len(context) - n :]), {})
        ranked = sorted(part.items(), key=lambda tc: (-tc[1], tc[0]))
        return [Follower(t, c, -1) for t, c in ranked]

    def candidates(self, context: Sequence[int], min_n: int, max_n: int) -> list[Follower]:
        """The ranked followers of the longest suffix n-gram (max_n down to min_n, at most 4)
        whose counts convince (MIN_OCCURRENCES, MIN_PERCENT); [] when none does."""
        for n in range(min(max_n, MAX_N), min_n - 1, -1):
            ranked = self.followers(context, n)
            if convincing(ranked, n, MIN_OCCURRENCES, MIN_PERCENT):
                return ranked
        return []

    # ---- files ---------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the cache in llama.cpp's format, through a temporary file renamed into place
        (a killed process leaves the old file whole)."""
        path = Path(path)
        chunks: list[bytes] = []
        for key in sorted(self.table):
            part = self.table[key]
            chunks.append(_HEAD.pack(*key, *([-1] * (MAX_N - len(key))), len(part)))
            chunks += [_PAIR.pack(t, c) for t, c in sorted(part.items())]
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"".join(chunks))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def open(cls, path: str | Path, vocab_size: int) -> LookupCache:
        """The cache in `path`, or a new one where there is no file yet (it is written on
        `save`)."""
        return cls.load(path, vocab_size) if Path(path).exists() else cls()

    @classmethod
    def load(cls, path: str | Path, vocab_size: int, max_ngrams: int = MAX_NGRAMS) -> LookupCache:
        """Read a cache file (aotgen's or llama.cpp's) for a model of `vocab_size` tokens;
        LookupCacheError names the first thing wrong in it."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise LookupCacheError(f"lookup cache {path}: {e.strerror}") from None
        cache = cls(max_ngrams)
        offset = 0
        while offset < len(data):
            offset = _read_record(data, offset, path, vocab_size, cache.table)
        while len(cache.table) > cache.max_ngrams:
            cache._age()
        return cache


class PeriodicSave:
    """Writes a cache to `path` every `every_s` seconds while requests add to it, from a
    thread of its own, and once more on `close`: a server killed without a shutdown keeps
    what it had learnt up to its last write. A failed write is logged and tried again at the
    next interval."""

    def __init__(self, cache: LookupCache, path: Path, every_s: float) -> None:
        self.cache, self.path, self.every_s = cache, path, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aotgen-lookup-cache", daemon=True)

    def start(self) -> None:
        if self.every_s > 0:
            self._thread.start()

    def _run(self) -> None:
        written = self.cache.additions
        while not self._stop.wait(self.every_s):
            if self.cache.additions != written:
                snapshot = self.cache.snapshot()
                try:
                    snapshot.save(self.path)
                    written = snapshot.additions
                except OSError as e:
                    logging.getLogger("aotgen").warning("lookup cache %s: %s", self.path, e)

    def close(self) -> None:
        """Stop (after a write under way), then write what came since."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.cache.save(self.path)


def _read_record(
    data: bytes, offset: int, path: Path, vocab: int, table: dict[tuple[int, ...], dict[int, int]]
) -> int:
    """One n-gram and its followers from `data` at `offset` into `table`; the next offset."""

    def bad(what: str) -> LookupCacheError:
        return LookupCacheError(
            f"lookup cache {path}: {what} at byte {offset}; it is not an n-gram cache of this "
            "model (llama.cpp's lookup-cache format): delete it or pass another file"
        )

    if offset + _HEAD.size > len(data):
        raise bad("the file ends inside an n-gram")
    *slots, n_followers = _HEAD.unpack_from(data, offset)
    n = next((i for i, t in enumerate(slots) if t == -1), MAX_N)
    if n == 0 or any(t != -1 for t in slots[n:]):
        raise bad(f"n-gram {slots} has no tokens or a gap")
    if n_followers < 1:
        raise bad(f"n-gram {slots[:n]} has {n_followers} followers")
    end = offset + _HEAD.size + n_followers * _PAIR.size
    if end > len(data):
        raise bad(f"the file ends inside the followers of n-gram {slots[:n]}")
    part = table.setdefault(tuple(slots[:n]), {})
    for token, count in _PAIR.iter_unpack(data[offset + _HEAD.size : end]):
        if count < 1:
            raise bad(f"follower {token} has count {count}")
        part[token] = min(part.get(token, 0) + count, _COUNT_MAX)
    outside = [t for t in (*slots[:n], *part) if not 0 <= t < vocab]
    if outside:
        raise bad(f"token {outside[0]} lies outside the vocabulary (0..{vocab - 1})")
    return end
