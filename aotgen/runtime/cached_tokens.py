"""Which tokens each row of a KV cache holds, so that a request reuses what it shares.

A cache row holds keys and values for positions 0, 1, ... of the tokens that last ran there.
A request whose prompt starts with some of those tokens (the next turn of a chat, a shared
system prompt, the same prompt again) runs only the rest: the graphs attend to the cache, so
positions already in it are as good as recomputed, up to float rounding between graphs.

The record is kept truthful rather than complete: a write at `start` first forgets everything
from `start` on, a write the runner cannot name (a draft's own keys in the target's layers, a
tree's nodes) is only forgotten, and a write past the recorded end leaves the record as it
is, since the positions in between are unknown.

Sliding-window layers of a package built with a ring cache (`kv_cache.ring`) keep position
`p` in cell `p % cells`, so a later position overwrites it. The record then also keeps which
position each cell holds, and a row can go on at position `b` only if the cells still hold
the window before it (`b - window + 1 .. b - 1`); where they do not (an answer regenerated
from far back), the prompt runs from the start, as llama.cpp does without `--swa-full`.
"""

from __future__ import annotations


class CachedTokens:
    """The token ids whose keys and values sit at positions 0.. of each cache row (slot), and
    with a ring (`cells`, `window`), the position each ring cell of each row holds (-1: none
    or unknown)."""

    def __init__(self, slots: int, ring: tuple[int, int] | None = None):
        self.rows: list[list[int]] = [[] for _ in range(slots)]
        self.ring = ring
        self.cells: list[list[int]] = [[-1] * ring[0] for _ in range(slots)] if ring else []

    def clear(self) -> None:
        """Forget every row: nothing found before is reused (a benchmark's new conversation;
        caches written by something that does not record)."""
        for row in self.rows:
            row.clear()

    def forget(self, slot: int, start: int) -> None:
        """Positions `start`.. of `slot` are about to be overwritten."""
        del self.rows[slot][start:]

    def wrote(self, slot: int, start: int, tokens: list[int]) -> None:
        """`tokens` now sit at positions start.. of `slot` (after `forget(slot, start)`)."""
        row = self.rows[slot]
        if start == len(row):
            row.extend(tokens)
        self._place(slot, start, len(tokens), known=True)

    def overwrote(self, slot: int, start: int, count: int) -> None:
        """Positions (or tree slots) start.. of `slot` now hold keys that are not the record's:
        forgotten, and their ring cells unknown."""
        self.forget(slot, start)
        self._place(slot, start, count, known=False)

    def copy_cells(self, donor: int, slot: int) -> None:
        """`slot`'s ring layers were copied whole from `donor`'s row."""
        if self.ring:
            self.cells[slot] = list(self.cells[donor])

    def _place(self, slot: int, start: int, count: int, known: bool) -> None:
        if self.ring:
            cells, size = self.cells[slot], self.ring[0]
            for p in range(start, start + count):
                cells[p % size] = p if known else -1

    def prefix(self, slot: int, tokens: list[int]) -> int:
        """How many leading `tokens` the row holds such that it can go on after them."""
        n = 0
        for held, tok in zip(self.rows[slot], tokens, strict=False):
            if held != tok:
                break
            n += 1
        return self._resumable(slot, n)

    def _resumable(self, slot: int, n: int) -> int:
        """The largest b <= n at which the row's ring cells still hold the window before b
        (n without a ring); 0 where none within a ring's length of n does."""
        if not self.ring or n == 0:
            return n
        size, window = self.ring
        cells = self.cells[slot]
        lo = max(0, n - size - window)
        run, runs = 0, []  # runs[q - lo]: consecutive held positions ending at q
        for q in range(lo, n):
            run = run + 1 if cells[q % size] == q else 0
            runs.append(run)
        for b in range(n, max(0, n - size), -1):
            if runs[b - 1 - lo] >= min(window - 1, b):
                return b
        return 0

    def reusable(self, slot: int, prompt: list[int]) -> int:
        """How many leading prompt tokens need not run again: all that the row holds but the
        prompt's last, whose logits pick the first new token."""
        return self.prefix(slot, prompt[:-1])

    def best_slot(self, free: list[int], prompt: list[int]) -> int:
        """The free slot holding the longest prefix of `prompt` (the first on a tie)."""
        return max(free, key=lambda s: self.prefix(s, prompt))

    def holder(self, tokens: list[int]) -> tuple[int, int]:
        """The row holding the longest prefix of `tokens`, free or running, and its length."""
        held = [self.prefix(slot, tokens) for slot in range(len(self.rows))]
        slot = max(range(len(held)), key=held.__getitem__)  # the first on a tie
        return slot, held[slot]
