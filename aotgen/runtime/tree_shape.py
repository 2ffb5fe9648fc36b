"""Best-first token trees: which nodes of the chain and of the leaves beside it go into the
tree graph's rows, and the acceptance estimates that value them.

A tree of the chain's draft steps and one-token leaves (each chain position's next candidates)
keeps the `budget - 1` nodes most likely to be accepted, as Sequoia's and EAGLE-2's dynamic
trees do: a node's value is the product of its path's acceptance estimates, so the kept nodes
maximise the expected number of accepted tokens. The estimates are counted over the
generation's own rounds (`Calibration`), since a draft's probability is a poor guess of
acceptance (docs/speculative.md, "Token trees"). The C++ runtime (runtime/cpp/tree_shape.cpp)
implements the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from aotgen.runtime.tree import Tree

MAX_SIBLINGS = 7  # candidates tried per position, as llama.cpp's `for f = 1..7`
CALIBRATION_BINS = 10  # acceptance is tracked per tenth of draft probability
CALIBRATION_PRIOR = 2.0  # pseudo-observations at the draft's probability, before any round


@dataclass(frozen=True)
class Leaf:
    """A one-token branch beside the chain token at `depth`: its value (the chance that
    verification accepts it), its rank among the position's candidates, its token and its
    draft probability."""

    value: float
    depth: int
    rank: int
    token: int
    p: float


def ranked_leaves(
    probs: list[float],
    tokens: list[int],
    chain_token: int,
    depth: int,
    parent_value: float,
    accept: Callable[[float], float] = float,
) -> list[Leaf]:
    """The candidates beside the chain token at `depth` (probs/tokens ranked, best first),
    valued parent_value * accept(p)."""
    alts = [(p, t) for p, t in zip(probs, tokens, strict=True) if t != chain_token]
    return [
        Leaf(parent_value * accept(p), depth, rank, t, p)
        for rank, (p, t) in enumerate(alts[:MAX_SIBLINGS])
    ]


def best_first(
    chain_values: list[float], leaves: list[Leaf], budget: int, n_parallel: int
) -> tuple[int, list[Leaf]]:
    """The chain nodes to keep (a count: the chain's prefix) and the leaves: the budget - 1
    nodes of highest value, at most n_parallel - 1 of them leaves (by depth, then rank).
    Ties go to chain nodes, then to shallower ones, so no node is kept without its parent (a
    node's value is at most its parent's)."""
    leaves = sorted(leaves, key=lambda f: (-f.value, f.depth, f.rank))[: n_parallel - 1]
    chain = [((v, 1, -d, 0), None) for d, v in enumerate(chain_values, 1)]
    side = [((f.value, 0, -f.depth, -f.rank), f) for f in leaves]
    kept = sorted(chain + side, key=lambda c: c[0], reverse=True)[: budget - 1]
    chosen = sorted((f for _, f in kept if f is not None), key=lambda f: (f.depth, f.rank))
    return sum(f is None for _, f in kept), chosen


def chain_is_done(
    chain_values: list[float], leaves: list[Leaf], budget: int, n_parallel: int
) -> bool:
    """Whether the chain's next node could not be kept: its value is at most the last one's,
    and the chain so far and the leaves above that value fill the budget."""
    last = chain_values[-1]
    above = sorted((f.value for f in leaves if f.value > last), reverse=True)
    return len(chain_values) + len(above[: n_parallel - 1]) >= budget - 1


class Calibration:
    """How often verification accepted a drafted node, by its kind (the chain's pick, or a
    leaf beside it) and its draft probability (n-gram lookup: share), counted over the rounds
    so far: a node is reached when its parent was accepted (or is the root). Before any
    round the estimate is the draft's probability itself."""

    def __init__(self) -> None:
        self.reached = [[0] * CALIBRATION_BINS for _ in range(2)]
        self.accepted = [[0] * CALIBRATION_BINS for _ in range(2)]
        self.pending: tuple[list[int], list[tuple[bool, float]]] | None = None

    @staticmethod
    def _bin(p: float) -> int:
        return min(int(p * CALIBRATION_BINS), CALIBRATION_BINS - 1)

    def estimate(self, p: float, leaf: bool) -> float:
        """The bin's rate, shrunk towards the kind's rate over all bins (itself shrunk towards
        p), so that one round already corrects every bin of a draft that is under- or
        overconfident throughout."""
        kind = int(leaf)
        seen, hits = sum(self.reached[kind]), sum(self.accepted[kind])
        pooled = (hits + CALIBRATION_PRIOR * p) / (seen + CALIBRATION_PRIOR)
        b = self._bin(p)
        seen, hits = self.reached[kind][b], self.accepted[kind][b]
        return (hits + CALIBRATION_PRIOR * pooled) / (seen + CALIBRATION_PRIOR)

    def drafted(self, tree: Tree, scores: list[tuple[bool, float]]) -> None:
        """The tree just proposed, with (leaf, draft probability) per node after the root."""
        self.pending = (list(tree.parents), scores)

    def verified(self, path: list[int]) -> None:
        if self.pending is None:
            return
        parents, scores = self.pending
        self.pending = None
        on_path = set(path)
        for node, (leaf, p) in enumerate(scores, 1):
            if parents[node] in on_path:
                self.reached[int(leaf)][self._bin(p)] += 1
                self.accepted[int(leaf)][self._bin(p)] += node in on_path


def assemble(
    root: int, chain: list[tuple[int, Tensor | None, float]], kept: int, leaves: list[Leaf]
) -> tuple[Tree, list[tuple[bool, float]]]:
    """The tree of the chain's first `kept` (token, probs, draft probability) picks, chain
    nodes first at indices equal to their depths, then the leaves; and (leaf, draft
    probability) per node after the root, for `Calibration.drafted`."""
    tree = Tree.root(root)
    for tok, q, _ in chain[:kept]:
        tree.add(len(tree) - 1, tok, q)
    for leaf in leaves:
        tree.add(leaf.depth - 1, leaf.token)
    scores = [(False, p) for _, _, p in chain[:kept]] + [(True, f.p) for f in leaves]
    return tree, scores
