"""Tree speculation: several draft branches scored in one target call (the tree graph).

A `Tree` holds the current token (node 0, the root) and the drafted nodes after it, each with
its parent; nodes are in topological order with the first child's chain first, so the main
draft chain sits at node indices equal to its depths. The target's tree graph writes node i's
keys and values at cache slot start + i with RoPE position start + depth(i); each node attends
to the prefix and its own ancestors (`Tree.mask`). After verification the accepted path's
entries are copied to the slots start + depth (`commit_path`): nothing moves when the main
chain wins, and rejected nodes' slots are overwritten before anything reads them.

Verification walks the tree from the root:
- greedy: follow the child whose token is the target's argmax; stop at the first node with
  none and emit the argmax. The output is plain greedy decoding's.
- sampling: SpecInfer's multi-step speculative sampling (Miao et al. 2024, Algorithm 2):
  at a node with target distribution r, try its children in order; child x drawn from q is
  accepted with probability min(1, r(x) / q(x)), else r becomes normalize(max(0, r - q))
  and the next child is tried; with every child rejected, the token is drawn from r. Each
  try is one step of Leviathan et al.'s speculative sampling against the current residual,
  which emits exactly r as long as the child was drawn from q independently of the children
  tried before it: siblings of a sampled draft are drawn i.i.d. from the same q, and
  deterministic siblings (a greedy draft's or n-gram lookup's ranked candidates) are
  one-hot q's fixed in advance. So the emitted token at every node follows the target, and
  the sequence follows the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from aotgen.runtime.sampling import SamplingParams, logits_to_probs, sample
from aotgen.runtime.speculative import residual_probs


@dataclass
class Tree:
    """A token tree: node 0 is the current token (not yet in the target's cache)."""

    tokens: list[int]
    parents: list[int]  # parents[0] = -1; parents[i] < i
    # Per node, the draft distribution it was drawn from ([V]); None: a deterministic token.
    probs: list[Tensor | None] = field(default_factory=list)
    looked_up: bool = False  # from n-gram lookup, not the draft model

    @classmethod
    def root(cls, token: int) -> Tree:
        return cls([token], [-1], [None])

    def add(self, parent: int, token: int, probs: Tensor | None = None) -> int:
        """Append a child of `parent`; returns its node index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.probs.append(probs)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        depths = [0] * len(self.parents)
        for i, p in enumerate(self.parents[1:], 1):
            depths[i] = depths[p] + 1
        return depths

    @property
    def depth(self) -> int:
        """Drafted positions: the deepest node's depth."""
        return max(self.depths)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def mask(self, size: int | None = None) -> Tensor:
        """[size, size] bool: row i sees its ancestors and itself. Rows past the tree (padding)
        see the root and themselves."""
        size = size or len(self)
        m = torch.eye(size, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents[1:], 1):
            m[i] |= m[p]
        return m

    def check(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n or self.parents[0] != -1 or len(self.probs) != n:
            raise ValueError("a tree needs one parent and one probs entry per node, root first")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], 1)):
            raise ValueError(f"parents must precede their children, got {self.parents}")


def verify_tree_greedy(tree: Tree, logits: Tensor) -> tuple[list[int], int]:
    """The accepted path (node indices, root first) and the target's token after it.

    logits [len(tree), V]: row i is the target's prediction after node i's path."""
    predicted = logits.argmax(-1).tolist()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == predicted[node]), None)
        if nxt is None:
            return path, predicted[node]
        node = nxt
        path.append(node)


def verify_tree_stochastic(
    tree: Tree, target_probs: Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Multi-step speculative sampling down the tree (module docstring): the accepted path
    and one token from the target's (residual) distribution after it."""
    vocab = target_probs.shape[-1]
    node, path = 0, [0]
    while True:
        r = target_probs[node].float()
        for child in tree.children(node):
            x = tree.tokens[child]
            q = tree.probs[child]
            if q is None:
                q = torch.zeros(vocab)
                q[x] = 1.0
            if float(torch.rand((), generator=generator)) * float(q[x]) < float(r[x]):
                node = child
                path.append(child)
                break
            r = residual_probs(r[None], q[None].float())[0]
            r = r / r.sum()
        else:
            return path, int(sample(r[None], generator))


def verify_tree(
    tree: Tree, logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Greedy or sampled verification of a tree scored by the target (`logits` [N, V])."""
    if params.greedy:
        return verify_tree_greedy(tree, logits)
    return verify_tree_stochastic(tree, logits_to_probs(logits, params), generator)


def commit_path(caches: list[Tensor], start: int, path: list[int]) -> int:
    """Move the accepted path's keys and values from slots start + node to start + depth
    (the path's i-th node has depth i). Returns how many positions were copied.

    Going down the path is safe: node indices are never below depths, so a destination is
    never a later source."""
    moves = [(start + node, start + i) for i, node in enumerate(path) if node != i]
    if not moves:
        return 0
    src = torch.tensor([s for s, _ in moves], device=caches[0].device)
    dst = torch.tensor([d for _, d in moves], device=caches[0].device)
    for cache in caches:  # a ring layer's slot s is its cell s % cells
        cells = cache.shape[2]
        cache.index_copy_(2, dst % cells, cache.index_select(2, src % cells))
    return len(moves)
