"""n-gram lookup proposals (aotgen/runtime/ngram.py) against a brute-force reference that
recounts the whole text for every drafted token, and the rules one at a time: the longest
convincing match wins, counts (then recency) pick the follower, the draft stops where the
evidence does."""

from __future__ import annotations

import random

import pytest

from aotgen.runtime.ngram import MIN_OCCURRENCES, MIN_PERCENT, NgramIndex, NgramProposer


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: at each step, recount the followers of every suffix n-gram of the text
    (drafted tokens included in the key, never in the counts), longest convincing n first."""
    draft: list[int] = []
    while len(draft) < k:
        context = tokens + draft
        chosen = None
        for n in range(max_n, min_n - 1, -1):
            if n > len(context):
                continue
            key = context[-n:]
            counts: dict[int, list[int]] = {}
            for pos in range(n, len(tokens)):
                if tokens[pos - n : pos] == key:
                    entry = counts.setdefault(tokens[pos], [0, pos])
                    entry[0] += 1
                    entry[1] = pos
            if not counts:
                continue
            total = sum(c for c, _ in counts.values())
            best = max(counts, key=lambda t: tuple(counts[t]))
            i = min(n, len(MIN_OCCURRENCES)) - 1
            if total >= MIN_OCCURRENCES[i] and 100 * counts[best][0] >= MIN_PERCENT[i] * total:
                chosen = best
                break
        if chosen is None:
            break
        draft.append(chosen)
    return draft


def test_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(400):
        min_n, max_n = rng.choice([(1, 1), (1, 3), (1, 4), (2, 4), (3, 5)])
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randint(0, 50))]
        k = rng.randint(1, 7)
        got = NgramProposer(min_n, max_n).propose(tokens, k)
        assert got == reference_propose(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)


def test_incremental_index_equals_a_fresh_one() -> None:
    """One proposer across a growing history (as within a request), and across a history
    that is not an extension (a new request), agrees with a new proposer every time."""
    rng = random.Random(1)
    proposer = NgramProposer(1, 4)
    tokens: list[int] = []
    for step in range(300):
        if step == 150:
            tokens = tokens[:40] + [9]  # diverges from what is indexed
        tokens += [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        assert proposer.propose(tokens, 6) == NgramProposer(1, 4).propose(tokens, 6)


def test_longest_convincing_match_wins() -> None:
    # After "1": 5 three times, 7 once. After "8 1" and "9 8 1": 7.
    tokens = [1, 5, 1, 5, 1, 5, 9, 8, 1, 7, 3, 9, 8, 1]
    assert NgramProposer(1, 4).propose(tokens, 1) == [7]  # "9 8 1" -> 7 beats "1" -> 5
    assert NgramProposer(1, 1).propose(tokens, 1) == [5]  # only the 1-gram: 3 of 4 say 5


def test_counts_then_recency_pick_the_follower() -> None:
    # "4 4 4" was followed by 1 twice and by 2 once, 2 most recently: the count wins.
    tokens = [4, 4, 4, 1, 0, 4, 4, 4, 1, 0, 4, 4, 4, 2, 0, 4, 4, 4]
    assert NgramProposer(3, 3).propose(tokens, 1) == [1]
    # An equal count: the most recent follower.
    tokens = [4, 4, 4, 1, 0, 4, 4, 4, 2, 0, 4, 4, 4]
    assert NgramProposer(3, 3).propose(tokens, 1) == [2]


def test_draft_length_follows_the_evidence() -> None:
    text = [10, 11, 12, 13, 14, 15, 16, 17]
    # A copied text is drafted to its end and on (the draft extends its own n-grams) ...
    assert NgramProposer(1, 4).propose(text + [0] + text[:3], 5) == text[3:8]
    # ... a text seen once with a 2-gram match only is not convincing (2 occurrences needed)
    assert NgramProposer(1, 4).propose([10, 11, 12, 0, 10, 11], 5) == []
    # ... and a 1-gram whose followers disagree proposes nothing.
    assert NgramProposer(1, 4).propose([3, 1, 3, 2, 3, 5, 3], 5) == []
    # A 4-gram seen once is enough, and the draft follows the latest copy (99, not 15).
    tokens = [12, 13, 14, 15, 16, 0, 12, 13, 14, 99, 0, 12, 13]
    assert NgramProposer(1, 4).propose(tokens, 6) == [14, 99, 0, 12, 13, 14]
    # The draft stops where the followers disagree: "1 2" -> 3 every time, then 8, 6 or 4.
    tokens = [1, 2, 3, 8, 1, 2, 3, 6, 1, 2, 3, 4, 0, 1, 2]
    assert NgramProposer(1, 4).propose(tokens, 6) == [3]


def test_no_draft_without_history_or_room() -> None:
    proposer = NgramProposer(1, 3)
    assert proposer.propose([], 3) == [] and proposer.propose([5], 3) == []
    assert proposer.propose([1, 2, 3, 1, 2, 3, 1, 2], 0) == []
    assert len(proposer.propose([1, 2, 3] * 10, 4)) == 4  # k caps a long convincing draft
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_min_n_excludes_shorter_matches() -> None:
    tokens = [5, 1, 2, 6, 1, 2, 7, 1]  # "1" -> 2 twice; "7 1" never occurred before
    assert NgramProposer(1, 4).propose(tokens, 1) == [2]
    assert NgramProposer(2, 4).propose(tokens, 1) == []


def test_candidates_rank_the_branches() -> None:
    tokens = [7, 8, 1, 7, 8, 2, 7, 8, 1, 7, 8]  # "7 8" -> 1 twice, 2 once
    proposer = NgramProposer(1, 2)
    proposer.index.sync(tokens)
    ranked = proposer.candidates(tokens)
    assert [(f.token, f.count) for f in ranked] == [(1, 2), (2, 1)]


def test_long_history() -> None:
    rng = random.Random(2)
    tokens = [rng.randrange(500) for _ in range(8000)]
    tokens += tokens[1000:1010]  # a 10-token repeat: the 4-gram suffix occurred once before
    assert NgramProposer(1, 4).propose(tokens, 5) == tokens[1010:1015]


def test_index_counts() -> None:
    index = NgramIndex(2)
    index.sync([1, 2, 1, 2, 3])
    assert [(f.token, f.count, f.last) for f in index.followers([1], 1)] == [(2, 2, 3)]
    assert [(f.token, f.count) for f in index.followers([1, 2], 2)] == [(3, 1), (1, 1)]
