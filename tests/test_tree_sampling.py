"""Sampled tree verification is lossless: the distribution test of test_speculative_core.py
(TV distance, with negative controls) on token trees.

A toy model over V tokens: the target's first token follows p0 and its second p1[first]; the
draft's follow q0 and q1[first]. A round drafts a tree of `width` siblings at depth 1, each
with one child (best-first: leaves beside a chain); the first two emitted tokens must follow
p0(x) * p1[x](y).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_speculative_core import V, matches

from aotgen.runtime.sampling import make_generator, sample
from aotgen.runtime.speculative import residual_probs
from aotgen.runtime.tree import Tree, verify_tree_stochastic

Verifier = Callable[[Tree, torch.Tensor, torch.Generator], tuple[list[int], int]]


def tables(seed: int):
    gen = make_generator(seed)
    p0 = torch.softmax(torch.randn(V, generator=gen) * 1.5, -1)
    p1 = torch.softmax(torch.randn(V, V, generator=gen) * 1.5, -1)
    q0 = torch.softmax(p0.log() + torch.randn(V, generator=gen), -1)  # a related draft
    q1 = torch.softmax(p1.log() + torch.randn(V, V, generator=gen), -1)
    return p0, p1, q0, q1


def draft_tree(root: int, q: torch.Tensor, q_next: torch.Tensor, width: int, kind: str, gen):
    """Root -> `width` siblings, each with one child. `sampled`: siblings i.i.d. from q,
    children from q_next[sibling]; `ranked`: q's top tokens as one-hot drafts, children their
    top token. `best-first` (tree_draft.py): a chain token from q with its child from
    q_next, then q's top other tokens as one-hot leaves without children."""
    tree = Tree.root(root)
    if kind == "sampled":
        firsts = [(int(sample(q[None], gen)), q) for _ in range(width)]
    elif kind == "ranked":
        firsts = [(int(t), None) for t in q.topk(width).indices]
    else:
        x = int(sample(q[None], gen))
        others = [int(t) for t in q.topk(width).indices if int(t) != x][: width - 1]
        firsts = [(x, q)] + [(t, None) for t in others]
    for tok, probs in firsts:
        node = tree.add(0, tok, probs)
        if kind == "ranked":
            tree.add(node, int(q_next[tok].argmax()))
        elif probs is not None:
            tree.add(node, int(sample(q_next[tok][None], gen)), q_next[tok])
    return tree


def first_two(verifier: Verifier, seed: int, n: int, width: int, kind: str) -> torch.Tensor:
    p0, p1, q0, q1 = tables(seed)
    gen = make_generator(seed + 100)
    out = torch.empty(n, 2, dtype=torch.long)
    uniform = torch.full((V, V), 1.0 / V)
    for i in range(n):
        tree = draft_tree(0, q0, q1, width, kind, gen)
        # Target rows: the root predicts p0; a depth-1 node x predicts p1[x]; depth 2: any.
        target = torch.stack(
            [p0]
            + [
                p1[t] if d == 1 else uniform[0]
                for t, d in zip(tree.tokens[1:], tree.depths[1:], strict=True)
            ]
        )
        path, nxt = verifier(tree, target, gen)
        emitted = [tree.tokens[j] for j in path[1:]] + [nxt]
        if len(emitted) < 2:  # a second round, rooted at the first token
            x = emitted[0]
            tree = draft_tree(x, q1[x], uniform, width, kind, gen)
            target = torch.stack([p1[x]] + [uniform[0]] * (len(tree) - 1))
            path, nxt = verifier(tree, target, gen)
            emitted.append(([tree.tokens[j] for j in path[1:]] + [nxt])[0])
        out[i] = torch.tensor(emitted[:2])
    return out


def check(tokens: torch.Tensor, seed: int) -> bool:
    p0, p1, _, _ = tables(seed)
    joint = (p0[:, None] * p1).reshape(-1)
    return matches(tokens[:, 0], p0) and matches(tokens[:, 0] * V + tokens[:, 1], joint)


def first_child_always(tree: Tree, target: torch.Tensor, gen) -> tuple[list[int], int]:
    """Broken on purpose: accepts the first child at every node."""
    node, path = 0, [0]
    while children := tree.children(node):
        node = children[0]
        path.append(node)
    return path, int(sample(target[node][None], gen))


def no_residual_between_siblings(tree: Tree, target: torch.Tensor, gen) -> tuple[list[int], int]:
    """Broken on purpose (the tree-specific bug): every sibling is tested against the target's
    distribution itself instead of the residual left by the siblings rejected before it."""
    node, path = 0, [0]
    while True:
        p = target[node]
        for child in tree.children(node):
            x, q = tree.tokens[child], tree.probs[child]
            qx = 1.0 if q is None else float(q[x])
            if float(torch.rand((), generator=gen)) * qx < float(p[x]):
                node = child
                path.append(child)
                break
        else:
            q = tree.probs[tree.children(node)[-1]] if tree.children(node) else None
            r = p if q is None else residual_probs(p[None], q[None])[0]
            return path, int(sample(r[None], gen))


N = 20_000


@pytest.mark.parametrize("kind", ["sampled", "ranked", "best-first"])
def test_tree_sampling_matches_target(kind: str) -> None:
    tokens = first_two(verify_tree_stochastic, seed=3, n=N, width=3, kind=kind)
    assert check(tokens, seed=3)
    assert check(tokens[: N // 10], seed=3)  # the bound shrinks with n and still holds


@pytest.mark.parametrize("broken", [first_child_always, no_residual_between_siblings])
def test_tree_negative_controls_fail_the_check(broken: Verifier) -> None:
    for kind in ("sampled", "ranked", "best-first"):
        assert not check(first_two(broken, seed=3, n=N, width=3, kind=kind), seed=3), kind
