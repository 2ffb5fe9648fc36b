"""Tree drafting and the tree speculation loop (llama.cpp `speculative`'s `n_parallel` /
`p_split`).

A round drafts the main chain of up to k tokens, then opens branches off it: where an
alternative candidate for a chain position has draft probability above `p_split` (n-gram
lookup: a share of the n-gram's followers above `p_split`), a branch starts with it, up to
`n_parallel` sequences in all (the main chain included), shallowest positions first, within
the tree graph's rows. Each branch then continues like the main chain, down to depth k. The
target scores the whole tree in one tree-graph call and `verify_tree` keeps one path.

Branches open off the main chain only (llama.cpp also branches off branches). A sampled draft
draws a branch's first token i.i.d. from the same distribution as the chain token it stands
beside (duplicates included), which is what keeps sampled verification exact (tree.py); the
number of branches at a position depends on that distribution only, never on the draws.

`best_first` shapes the tree by the chance that verification accepts each node instead
(tree_shape.py): the chain, cut where its next node is worth less than a leaf, and one-token
leaves beside it. Leaves cost no draft step; their tokens are fixed by the draft's ranking
(one-hot distributions), which sampled verification handles exactly (tree.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from aotgen.runtime.ngram import NgramProposer
from aotgen.runtime.proposers import draft_token, prefill_draft
from aotgen.runtime.sampling import SamplingParams, sample
from aotgen.runtime.tree import Tree, commit_path, verify_tree
from aotgen.runtime.tree_shape import (
    MAX_SIBLINGS,
    Calibration,
    Leaf,
    assemble,
    best_first,
    chain_is_done,
    ranked_leaves,
)

if TYPE_CHECKING:
    from aotgen.runtime.engine import Engine, GenerationConfig
    from aotgen.runtime.lookup_cache import LookupCache
    from aotgen.runtime.model_runner import ModelRunner
    from aotgen.runtime.rules import TokenRules
    from aotgen.runtime.speculative import SpecStats


@dataclass(frozen=True)
class TreeParams:
    """llama.cpp's controls: sequences drafted at once, and the branch threshold."""

    n_parallel: int = 4
    p_split: float = 0.1
    best_first: bool = False  # the most likely accepted nodes instead (tree_shape.py)

    def __post_init__(self) -> None:
        if isinstance(self.n_parallel, bool) or not (
            isinstance(self.n_parallel, int) and self.n_parallel >= 1
        ):
            raise ValueError(f"n_parallel must be an integer >= 1, got {self.n_parallel!r}")
        if not 0.0 <= self.p_split <= 1.0:
            raise ValueError(f"p_split must be in [0, 1], got {self.p_split!r}")


def plan_branches(
    options: list[list[tuple[int, Tensor | None]]], params: TreeParams, room: int
) -> list[tuple[int, int, Tensor | None]]:
    """(depth, token, probs) of the branches to open, shallowest first: options[j - 1] are
    the candidates beside the chain token at depth j; at most n_parallel - 1 and `room`."""
    limit = min(params.n_parallel - 1, room)
    picked = [(j, tok, q) for j, opts in enumerate(options, 1) for tok, q in opts]
    return picked[:limit]


class TreeDraftProposer:
    """A token tree from the draft model (see the module docstring). `self.pos` is the first
    position missing from the draft's cache, as in `DraftProposer`."""

    def __init__(
        self,
        draft: ModelRunner,
        prompt: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        tree: TreeParams,
        reuse_prefix: bool = True,
    ) -> None:
        self.draft, self.params, self.generator, self.tree_params = draft, params, generator, tree
        self.calibration = Calibration()
        if not draft.shares_cache:
            prefill_draft(draft, prompt, 0, reuse_prefix)
        self.pos = len(prompt)

    def _pick(self, logits: Tensor) -> tuple[int, Tensor | None]:
        return draft_token(logits, self.params, self.generator)

    def _alternatives(self, logits: Tensor, q: Tensor | None, token: int) -> list:
        """Branch starts beside `token`: a greedy draft's next candidates above p_split, or
        as many i.i.d. draws from q as q has candidates above p_split."""
        p_split = self.tree_params.p_split
        if q is None:
            top = torch.softmax(logits.float(), -1).topk(MAX_SIBLINGS + 1)
            return [
                (int(t), None)
                for p, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)
                if t != token and p > p_split
            ][:MAX_SIBLINGS]
        ranked = q.topk(MAX_SIBLINGS + 1).values[1:]  # beside the top one
        count = int((ranked > p_split).sum())
        return [(int(sample(q[None], self.generator)), q) for _ in range(count)]

    def _extend(
        self, tree: Tree, node: int, logits: Tensor, pos: int, depth: int, k: int, budget: int
    ) -> None:
        """Continue node's sequence (its token at `pos`, `logits` after it) down to depth k."""
        while depth < k and len(tree) < budget:
            tok, q = self._pick(logits)
            node = tree.add(node, tok, q)
            depth += 1
            if depth < k and len(tree) < budget:
                logits = self.draft.decode(tok, pos + 1)
                pos += 1

    def propose(self, history: list[int], k: int, budget: int) -> Tree:
        if self.draft.shares_cache:
            self.pos = len(history) - 1
        start = len(history) - 1  # the root's position
        logits = self.draft.forward(history[self.pos :], self.pos)
        if self.tree_params.best_first:
            return self._best_first(history[-1], logits, start, k, budget)
        tree = Tree.root(history[-1])
        chain_logits: list[Tensor] = []
        node = 0
        for depth in range(1, k + 1):  # the main chain: node index == depth
            if len(tree) >= budget:
                break
            chain_logits.append(logits)
            tok, q = self._pick(logits)
            node = tree.add(node, tok, q)
            if depth < k and len(tree) < budget:
                logits = self.draft.decode(tok, start + depth)
        self.pos = start + len(tree) - 1  # written: the root and all chain tokens but the last
        if self.tree_params.n_parallel == 1:
            return tree
        options = [
            self._alternatives(lg, tree.probs[j], tree.tokens[j])
            for j, lg in enumerate(chain_logits, 1)
        ]
        branches = plan_branches(options, self.tree_params, budget - len(tree))
        if not branches:
            return tree
        # Deepest first: a branch at depth j overwrites the draft cache from start + j on,
        # which the shallower branches still to come do not read.
        firsts = [(j, tree.add(j - 1, tok, q)) for j, tok, q in branches]
        for j, b in sorted(firsts, reverse=True):
            if j < k and len(tree) < budget:
                lg = self.draft.decode(tree.tokens[b], start + j)
                self._extend(tree, b, lg, start + j, j, k, budget)
        self.pos = min(self.pos, start + min(j for j, _ in firsts))
        return tree

    def _best_first(self, root: int, logits: Tensor, start: int, k: int, budget: int) -> Tree:
        """The chain while its next node could still be kept, then the best nodes of it and
        of the leaves beside it (`best_first`)."""
        n_parallel, cal = self.tree_params.n_parallel, self.calibration
        picks: list[tuple[int, Tensor | None, float]] = []
        values: list[float] = []
        leaves: list[Leaf] = []
        for depth in range(1, min(k, budget - 1) + 1):
            tok, q = self._pick(logits)
            probs = torch.softmax(logits.float(), -1) if q is None else q
            top = probs.topk(MAX_SIBLINGS + 1)
            parent = values[-1] if values else 1.0
            leaves += ranked_leaves(
                top.values.tolist(),
                top.indices.tolist(),
                tok,
                depth,
                parent,
                lambda p: cal.estimate(p, leaf=True),
            )
            p_tok = float(probs[tok])
            picks.append((tok, q, p_tok))
            values.append(parent * cal.estimate(p_tok, leaf=False))
            if depth == k or chain_is_done(values, leaves, budget, n_parallel):
                break
            logits = self.draft.decode(tok, start + depth)
        self.pos = start + len(picks)  # the root and all chain tokens but the last are written
        kept, chosen = best_first(values, leaves, budget, n_parallel)
        tree, scores = assemble(root, picks, kept, chosen)
        cal.drafted(tree, scores)
        if chosen:  # a leaf's position holds the chain token in the draft's cache
            self.pos = min(self.pos, start + min(f.depth for f in chosen))
        return tree

    def verified(self, path: list[int]) -> None:
        self.calibration.verified(path)

    def accepted(self, pos: int) -> None:
        self.pos = min(self.pos, pos)


class TreeLookupProposer:
    """A token tree from n-gram lookup: the chain `NgramProposer.propose` drafts, with the
    other ranked followers (`candidates`) whose share passes p_split as branches."""

    def __init__(
        self, min_n: int, max_n: int, tree: TreeParams, shared: LookupCache | None = None
    ) -> None:
        self.ngram = NgramProposer(min_n, max_n, shared)
        self.tree_params = tree
        self.calibration = Calibration()

    def _continue(self, context: list[int], n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            ranked = self.ngram.candidates(context)
            if not ranked:
                break
            out.append(ranked[0].token)
            context = context + [ranked[0].token]
        return out

    def propose(self, history: list[int], k: int, budget: int) -> Tree:
        chain = self.ngram.propose(history, min(k, budget - 1))  # syncs the index
        tree = Tree.root(history[-1])
        for tok in chain:
            tree.add(len(tree) - 1, tok)
        tree.looked_up = bool(chain)
        if not chain or self.tree_params.n_parallel == 1:
            return tree
        tail = list(history[-self.ngram.max_n :])
        if self.tree_params.best_first:
            return self._best_first(history[-1], tail, chain, budget)
        options = []
        for j in range(1, len(chain) + 1):
            context = tail + chain[: j - 1]
            ranked = self.ngram.candidates(context)
            total = sum(f.count for f in ranked)
            options.append(
                [
                    (f.token, None)
                    for f in ranked[: MAX_SIBLINGS + 1]
                    if f.token != chain[j - 1] and f.count > self.tree_params.p_split * total
                ]
            )
        branches = plan_branches(options, self.tree_params, budget - len(tree))
        firsts = [(j, tree.add(j - 1, tok)) for j, tok, _ in branches]  # each gets its row
        for j, node in firsts:
            rest = self._continue(tail + chain[: j - 1] + [tree.tokens[node]], k - j)
            for t in rest[: budget - len(tree)]:
                node = tree.add(node, t)
        return tree

    def _best_first(self, root: int, tail: list[int], chain: list[int], budget: int) -> Tree:
        """The chain and the other followers at each of its positions as leaves, valued by
        the acceptance estimates of the followers' shares along the path (`best_first`)."""
        cal = self.calibration
        values: list[float] = []
        leaves: list[Leaf] = []
        chain_shares: list[float] = []
        for j, tok in enumerate(chain, 1):
            ranked = self.ngram.candidates(tail + chain[: j - 1])
            total = sum(f.count for f in ranked)
            ranked = ranked[: MAX_SIBLINGS + 1]
            shares = [f.count / total for f in ranked]
            parent = values[-1] if values else 1.0
            leaves += ranked_leaves(
                shares,
                [f.token for f in ranked],
                tok,
                j,
                parent,
                lambda p: cal.estimate(p, leaf=True),
            )
            share = next((s for s, f in zip(shares, ranked, strict=True) if f.token == tok), 0.0)
            chain_shares.append(share)
            values.append(parent * cal.estimate(share, leaf=False))
        kept, chosen = best_first(values, leaves, budget, self.tree_params.n_parallel)
        picks = [(tok, None, share) for tok, share in zip(chain, chain_shares, strict=True)]
        tree, scores = assemble(root, picks, kept, chosen)
        tree.looked_up = True
        cal.drafted(tree, scores)
        return tree

    def accepted(self, pos: int) -> None:
        pass

    def verified(self, path: list[int]) -> None:
        self.calibration.verified(path)


class TreeDraftOrLookup:
    """draft+ngram: the lookup tree when lookup drafts anything, else the draft's tree."""

    def __init__(self, lookup: TreeLookupProposer, draft: TreeDraftProposer) -> None:
        self.lookup, self.draft = lookup, draft
        self.looked_up = False

    def propose(self, history: list[int], k: int, budget: int) -> Tree:
        tree = self.lookup.propose(history, k, budget)
        self.looked_up = len(tree) > 1
        return tree if self.looked_up else self.draft.propose(history, k, budget)

    def accepted(self, pos: int) -> None:
        self.draft.accepted(pos)

    def verified(self, path: list[int]) -> None:
        (self.lookup if self.looked_up else self.draft).verified(path)


def tree_proposer(
    engine: Engine, prompt: list[int], config: GenerationConfig, gen: torch.Generator
) -> TreeDraftProposer | TreeLookupProposer | TreeDraftOrLookup:
    lookup = TreeLookupProposer(
        config.lookup_min, config.ngram_max, config.tree, engine.lookup_cache
    )
    if not config.uses_draft:
        return lookup
    draft = TreeDraftProposer(
        engine.draft, prompt, config.sampling, gen, config.tree, config.reuse_prefix
    )
    return TreeDraftOrLookup(lookup, draft) if config.uses_lookup else draft


def tree_steps(
    engine: Engine,
    prompt: list[int],
    tok: int,
    pos: int,
    config: GenerationConfig,
    spec: SpecStats,
    gen: torch.Generator,
    rules: TokenRules | None = None,
) -> Iterator[tuple[list[int], Tensor]]:
    """Propose a tree -> score it in one tree-graph call -> keep one path, per yield (with
    the logits rows that chose the accepted tokens). Under the request's rules (runtime/
    rules.py) the tree is drafted free and each node's row takes the rules as they stand
    after its path: a node the grammar refuses is never accepted, greedy or sampled (its
    target probability is 0), which keeps verification exact without pruning the tree."""
    target = engine.target
    budget = target.tree_len
    k = min(config.k or engine.verify_k, budget - 1)
    proposer = tree_proposer(engine, prompt, config, gen)
    history = list(prompt) + [tok]
    while True:
        tree = proposer.propose(history, k, budget)
        if len(tree) == 1:  # nothing drafted: a plain decode step
            logits = target.decode(tok, pos)[None]
        else:
            logits = target.tree_forward(tree, pos)
        scored = logits
        if rules is not None:
            scored = rules.over_tree(tree.tokens, tree.parents)(logits)
        path, nxt = verify_tree(tree, scored, config.sampling, gen)
        proposer.verified(path)
        moved = commit_path(target.caches, pos, path)
        path_tokens = [tree.tokens[i] for i in path]  # now at pos.., as a chain
        target.cached.wrote(0, pos, path_tokens)
        accepted = path_tokens[1:] + [nxt]
        if rules is not None:
            rules.advance(accepted)
        spec.update(tree.depth, len(path) - 1, lookup=tree.looked_up)
        spec.tree_nodes += len(tree) - 1
        spec.branch_steps += moved > 0
        pos += len(path)
        proposer.accepted(pos)
        history.extend(accepted)
        tok = nxt
        yield accepted, logits[path]  # the row of each path node chose the token after it
