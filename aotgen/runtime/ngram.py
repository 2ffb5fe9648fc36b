"""n-gram lookup proposals: counts of what followed every short n-gram of the text so far.

The design joins two proposers this runtime is measured against:
- vLLM's prompt lookup tries the longest suffix match first (`prompt_lookup_max` down to
  `prompt_lookup_min`): a longer match is stronger evidence than a shorter one;
- llama.cpp's `llama-lookup` (`common_ngram_cache_draft`) keeps, for every n-gram of the
  context, how often each token followed it, drafts the most frequent follower, and drafts one
  token at a time, each looked up with the tokens drafted before it, only while the counts are
  convincing (a minimum number of occurrences and a minimum share for the winner). So the
  draft is long on copied text and empty on free text, where a proposal would only cost a
  verify step.

Ties between equally frequent followers go to the one seen most recently. Where the request's
own text convinces of nothing, a `LookupCache` of earlier requests' texts, when given, is asked
by a stricter rule (runtime/lookup_cache.py). The C++ runtime
(`runtime/cpp/ngram.cpp`) implements the same rules; `tests/test_cpp_runtime.py` checks the two
agree token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aotgen.runtime.lookup_cache import LookupCache

# Evidence an n-gram needs before its most frequent follower is drafted, by n (1, 2, 3, 4+):
# how often the n-gram occurred, and the winner's share of its followers in percent.
# llama.cpp's `draft_min_sample_size_lax` / `draft_min_percent_lax` for the context cache.
MIN_OCCURRENCES = (2, 2, 1, 1)
MIN_PERCENT = (66, 50, 50, 50)


@dataclass(frozen=True)
class Follower:
    """A token that followed an n-gram: how often, and the position of its latest occurrence."""

    token: int
    count: int
    last: int


class NgramIndex:
    """For n = 1..max_n, every n-gram of a token sequence -> {next token: [count, last pos]}.

    Grows as tokens are appended (O(max_n) per token), so a round of drafting costs a few
    dictionary lookups however long the text is.
    """

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self._reset()

    def _reset(self) -> None:
        self.tokens: list[int] = []
        self.tables: list[dict[tuple[int, ...], dict[int, list[int]]]] = [
            {} for _ in range(self.max_n)
        ]

    def sync(self, history: Sequence[int]) -> None:
        """Index history: the new tail when it extends what is indexed, else from scratch."""
        n_old = len(self.tokens)
        if len(history) < n_old or list(history[:n_old]) != self.tokens:
            self._reset()
            n_old = 0
        for pos in range(n_old, len(history)):
            self._add(int(history[pos]))

    def _add(self, token: int) -> None:
        pos = len(self.tokens)
        for n in range(1, min(self.max_n, pos) + 1):
            key = tuple(self.tokens[pos - n : pos])
            entry = self.tables[n - 1].setdefault(key, {}).setdefault(token, [0, pos])
            entry[0] += 1
            entry[1] = pos
        self.tokens.append(token)

    def followers(self, context: Sequence[int], n: int) -> list[Follower]:
        """What followed the last n tokens of context, most frequent (then most recent) first."""
        if n > len(context):
            return []
        table = self.tables[n - 1].get(tuple(context[len(context) - n :]), {})
        ranked = [Follower(t, c, last) for t, (c, last) in table.items()]
        return sorted(ranked, key=lambda f: (f.count, f.last), reverse=True)


def convincing(
    followers: list[Follower],
    n: int,
    min_occurrences: Sequence[int] = MIN_OCCURRENCES,
    min_percent: Sequence[int] = MIN_PERCENT,
) -> bool:
    """Enough occurrences of the n-gram, and a clear enough winner among its followers."""
    if not followers:
        return False
    total = sum(f.count for f in followers)
    i = min(n, len(min_occurrences)) - 1
    return total >= min_occurrences[i] and 100 * followers[0].count >= min_percent[i] * total


class NgramProposer:
    """Drafts from the text so far (prompt + output): longest convincing n-gram first, its
    most frequent follower, one token at a time for as long as the evidence holds; then from
    `shared`, earlier requests' counts, when given."""

    def __init__(self, min_n: int = 1, max_n: int = 4, shared: LookupCache | None = None) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.index = NgramIndex(max_n)
        self.shared = shared

    def candidates(self, context: Sequence[int]) -> list[Follower]:
        """The ranked followers of the longest convincing suffix n-gram of context (after
        `sync`); [] when none convinces. Several of them are branches for tree drafting."""
        for n in range(self.max_n, self.min_n - 1, -1):
            followers = self.index.followers(context, n)
            if convincing(followers, n):
                return followers
        return (
            [] if self.shared is None else self.shared.candidates(context, self.min_n, self.max_n)
        )

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow history; fewer (or none) when the evidence runs out."""
        self.index.sync(history)
        context = [int(t) for t in history[max(0, len(history) - self.max_n) :]]
        draft: list[int] = []
        while len(draft) < k:
            ranked = self.candidates(context)
            if not ranked:
                break
            draft.append(ranked[0].token)
            context = (context + [ranked[0].token])[-self.max_n :]
        return draft
