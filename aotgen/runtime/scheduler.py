"""Continuous batching: which requests hold a KV-cache slot, which wait, who goes next.

Requests queue FIFO (bounded: a full queue refuses, it does not grow without limit; requests a
free slot will take do not count), take a free slot between steps, and give it back the step
they finish or are cancelled. A request takes the free slot whose cache row holds the longest
prefix of its prompt (runtime/cached_tokens.py) and runs only the rest; without one, the slot
freed longest ago, so recent conversations stay in the cache longest. Prefill is first come,
first served, one request at a time, so a long prompt is chunked across steps while the
running requests keep decoding; a request left with only its prompt's last token (the rest
found in the cache) runs it in the step's decode instead, so many requests that share a
prompt all get their first token in one step.
"""

from __future__ import annotations

from collections import deque

from aotgen.runtime.cached_tokens import CachedTokens
from aotgen.runtime.sequence import Sequence


class QueueFull(RuntimeError):
    """The engine holds as many waiting requests as it may: retry later."""


class Scheduler:
    def __init__(self, cached: CachedTokens, max_queue: int):
        self.cached = cached
        self.free: deque[int] = deque(range(len(cached.rows)))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.max_queue = max_queue

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; QueueFull when `max_queue` requests already wait beyond the free slots
        (those take a slot at the next step, however many arrived since the last)."""
        queued = len(self.waiting) - len(self.free)
        if queued >= self.max_queue:
            raise QueueFull(
                f"{queued} requests are already waiting for a slot (max_queue={self.max_queue});"
                " retry later"
            )
        self.waiting.append(seq)

    def admit(self) -> None:
        """Give free slots to waiting requests, oldest first."""
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            if seq.config.reuses_prefix:
                seq.slot = self.cached.best_slot(list(self.free), seq.prompt)
                seq.pos = seq.cached_tokens = self.cached.reusable(seq.slot, seq.prompt)
            else:
                seq.slot = self.free[0]
            self.free.remove(seq.slot)
            self.running.append(seq)

    def prefilling(self) -> list[Sequence]:
        """Running requests whose prompt is not all in their cache yet, oldest first."""
        return [s for s in self.running if s.prefilling]

    def decoding(self) -> list[Sequence]:
        """Requests past their prompt, and those left with its last token only."""
        return [s for s in self.running if (not s.prefilling or s.last_prompt_token) and not s.done]

    def release(self, seq: Sequence) -> None:
        """A finished or cancelled request leaves: its slot is free for the next step."""
        if seq in self.running:
            self.running.remove(seq)
            self.free.append(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.slot = -1

    def cancelled(self) -> list[Sequence]:
        return [s for s in (*self.running, *self.waiting) if s.cancelled]

    def find(self, request_id: int) -> Sequence | None:
        return next((s for s in (*self.running, *self.waiting) if s.id == request_id), None)
