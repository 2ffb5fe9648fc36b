"""Which tokens each row of a KV cache holds, so that a request reuses what it shares.

A cache row holds keys and values for positions 0, 1, ... of the tokens that last ran there.
A request whose prompt starts with some of those tokens (the next turn of a chat, a shared
system prompt, the same prompt again) runs only the rest: the graphs attend to the cache, so
positions already in it are as good as recomputed, up to float rounding between graphs.

The record is kept truthful rather than complete: a write at `start` first forgets everything
from `start` on, a write the runner cannot name (a draft's own keys in the target's layers, a
tree's nodes) is only forgotten, and a write past the recorded end leaves the record as it
is, since the positions in between are unknown.
"""

from __future__ import annotations


class CachedTokens:
    """The token ids whose keys and values sit at positions 0.. of each cache row (slot)."""

    def __init__(self, slots: int):
        self.rows: list[list[int]] = [[] for _ in range(slots)]

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

    def prefix(self, slot: int, tokens: list[int]) -> int:
        """How many leading `tokens` the row already holds."""
        n = 0
        for held, tok in zip(self.rows[slot], tokens, strict=False):
            if held != tok:
                break
            n += 1
        return n

    def reusable(self, slot: int, prompt: list[int]) -> int:
        """How many leading prompt tokens need not run again: all that the row holds but the
        prompt's last, whose logits pick the first new token."""
        return min(self.prefix(slot, prompt), len(prompt) - 1)

    def best_slot(self, free: list[int], prompt: list[int]) -> int:
        """The free slot holding the longest prefix of `prompt` (the first on a tie)."""
        return max(free, key=lambda s: self.prefix(s, prompt))

    def holder(self, tokens: list[int]) -> tuple[int, int]:
        """The row holding the longest prefix of `tokens`, free or running, and its length."""
        held = [self.prefix(slot, tokens) for slot in range(len(self.rows))]
        slot = max(range(len(held)), key=held.__getitem__)  # the first on a tie
        return slot, held[slot]
