"""Tree speculation: the tree forward against chain decoding of each path, the KV fix-up,
and greedy tree verification against plain greedy on the eager reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aotgen.model.llama import new_kv_cache
from aotgen.runtime.tree import Tree, commit_path, verify_tree_greedy

# (parents of nodes 1.., as a list): chain, wide, deep, a branch at every position.
SHAPES = {
    "chain": [0, 1, 2, 3, 4],
    "wide": [0, 0, 0, 0, 0, 0],
    "deep": [0, 1, 2, 3, 0, 5, 6, 7],
    "every": [0, 1, 2, 3, 0, 1, 2, 3],
    "bushy": [0, 1, 1, 0, 4, 4, 2],
}


def make_tree(parents: list[int], seed: int, vocab: int) -> Tree:
    gen = torch.Generator().manual_seed(seed)
    tree = Tree.root(int(torch.randint(vocab, (), generator=gen)))
    for p in parents:
        tree.add(p, int(torch.randint(vocab, (), generator=gen)))
    tree.check()
    return tree


def path_to(tree: Tree, node: int) -> list[int]:
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


@torch.no_grad()
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_forward_equals_chain_forward_of_every_path(tiny_model, shape):
    """Each node's logits equal plain decoding of its root-to-node path after the prefix, and
    after `commit_path` the cache holds the path's keys/values at their positions."""
    model, cfg, cache_len = tiny_model
    prompt = torch.randint(cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    start = prompt.shape[1]
    tree = make_tree(SHAPES[shape], seed=1, vocab=cfg.vocab_size)
    caches = new_kv_cache(cfg, cache_len)
    model(prompt, torch.arange(start), caches)
    depths = torch.tensor(tree.depths)
    logits = model(torch.tensor([tree.tokens]), start + depths, caches, tree.mask())[0]
    for node in range(len(tree)):
        path = path_to(tree, node)
        ref_caches = new_kv_cache(cfg, cache_len)
        model(prompt, torch.arange(start), ref_caches)
        ref = model(
            torch.tensor([[tree.tokens[i] for i in path]]),
            start + torch.arange(len(path)),
            ref_caches,
        )[0]
        torch.testing.assert_close(logits[node], ref[-1], rtol=1e-4, atol=1e-4)
        if tree.children(node):
            continue  # commit the leaves' paths (each covers its ancestors)
        committed = [c.clone() for c in caches]
        commit_path(committed, start, path)
        end = start + len(path)
        for got, want in zip(committed, ref_caches, strict=True):
            torch.testing.assert_close(got[:, :, :end], want[:, :, :end], rtol=1e-5, atol=1e-5)


def test_tree_mask_and_checks():
    tree = make_tree(SHAPES["bushy"], seed=0, vocab=50)
    m = tree.mask(9)
    assert m[7].nonzero().flatten().tolist() == [0, 1, 2, 7]  # node 7: 0 -> 1 -> 2 -> 7
    assert m[8].nonzero().flatten().tolist() == [0, 8]  # padding: root and itself
    assert tree.depths == [0, 1, 2, 2, 1, 2, 2, 3]
    bad = Tree([1, 2], [-1, 1], [None, None])
    with pytest.raises(ValueError, match="precede"):
        bad.check()


def test_commit_path_moves_only_branch_nodes():
    caches = [torch.arange(10.0).reshape(1, 1, 10, 1).clone()]
    assert commit_path(caches, 2, [0, 1, 2]) == 0
    assert commit_path(caches, 2, [0, 4, 6]) == 2  # slots 6 -> 3, 8 -> 4
    assert caches[0].flatten().tolist() == [0, 1, 2, 6, 8, 5, 6, 7, 8, 9]


def test_verify_tree_greedy_follows_argmax():
    #        0
    #      /   \
    #     1(5)  3(7)
    #     |      |
    #     2(6)   4(8)
    tree = Tree.root(9)
    for parent, token in [(0, 5), (1, 6), (0, 7), (3, 8)]:
        tree.add(parent, token)
    logits = torch.zeros(5, 10)
    logits[0, 7] = logits[3, 8] = logits[4, 1] = 1.0  # the sibling branch, fully, then 1
    assert verify_tree_greedy(tree, logits) == ([0, 3, 4], 1)
    logits[0, 7], logits[0, 2] = 0.0, 1.0  # every child of the root rejected
    assert verify_tree_greedy(tree, logits) == ([0], 2)


def _random_chain_and_leaves(gen: torch.Generator, depth: int):
    """Path values of a chain of `depth` nodes and of up to 3 leaves at each of its positions,
    from random draft distributions (ranked probabilities at each position)."""
    from aotgen.runtime.tree_shape import ranked_leaves

    values: list[float] = []
    leaves = []
    for j in range(1, depth + 1):
        probs = torch.softmax(torch.randn(5, generator=gen) * 2, -1).sort(descending=True)
        parent = values[-1] if values else 1.0
        leaves += ranked_leaves(probs.values.tolist()[:4], [1, 2, 3, 4], 1, j, parent)
        values.append(parent * float(probs.values[0]))
    return values, leaves


def test_best_first_keeps_the_most_probable_tree():
    """best_first against a brute force over every tree it may build (a chain prefix and a
    set of leaves whose chain parent is kept, at most budget - 1 nodes and n_parallel - 1
    leaves): the kept nodes' total path probability (the expected tokens a calibrated draft
    gets accepted) is the maximum, and the kept set is such a tree."""
    from itertools import combinations

    from aotgen.runtime.tree_shape import best_first

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        depth = 1 + trial % 5
        values, leaves = _random_chain_and_leaves(gen, depth)
        budget, n_parallel = 2 + trial % 6, 1 + trial % 4
        kept, chosen = best_first(values, leaves, budget, n_parallel)
        assert kept + len(chosen) <= budget - 1 and len(chosen) <= n_parallel - 1
        assert all(f.depth - 1 <= kept for f in chosen), "a leaf without its parent"
        best = 0.0
        for d in range(min(depth, budget - 1) + 1):
            fits = [f for f in leaves if f.depth - 1 <= d]
            room = min(budget - 1 - d, n_parallel - 1)
            for n in range(room + 1):
                for pick in combinations(fits, n):
                    best = max(best, sum(values[:d]) + sum(f.value for f in pick))
        got = sum(values[:kept]) + sum(f.value for f in chosen)
        assert got == pytest.approx(best, rel=1e-12), (trial, kept, chosen)


def test_calibration_learns_acceptance_by_kind_and_probability():
    """Before any round the estimate is the draft's probability; after rounds it approaches
    the rate at which reached nodes of that kind and probability bin were accepted, and a bin
    without observations the kind's rate. Nodes whose parent was rejected teach nothing."""
    from aotgen.runtime.tree_shape import Calibration

    cal = Calibration()
    assert cal.estimate(0.25, leaf=False) == 0.25 and cal.estimate(0.25, leaf=True) == 0.25
    for _ in range(200):  # chain 1 -> 2, and a leaf (3) beside node 1; the chain always wins
        tree = Tree.root(0)
        for parent, token in [(0, 1), (1, 2), (0, 3)]:
            tree.add(parent, token)
        cal.drafted(tree, [(False, 0.25), (False, 0.95), (True, 0.22)])
        cal.verified([0, 1])  # node 1 accepted, node 2 rejected, the leaf rejected
    assert cal.estimate(0.21, leaf=False) > 0.98  # node 1's bin: accepted 200 of 200
    assert cal.estimate(0.95, leaf=False) < 0.02  # node 2: rejected every time
    assert cal.estimate(0.29, leaf=True) < 0.02
    # A bin nothing reached follows the kind's rate over all bins (here 200 of 400).
    assert 0.45 < cal.estimate(0.55, leaf=False) < 0.55
    assert cal.estimate(0.55, leaf=True) < 0.02
    cal.drafted(tree, [(False, 0.55), (False, 0.55), (True, 0.55)])
    cal.verified([0])  # node 1 rejected: node 2 was not reached
    assert cal.reached[0][5] == 1 and cal.reached[1][5] == 1


def test_chain_stops_only_when_its_next_node_cannot_be_kept():
    """chain_is_done says stop exactly when a chain node one deeper, at most as probable as
    the last, would not be kept by best_first, whatever its value."""
    from aotgen.runtime.tree_shape import best_first, chain_is_done

    gen = torch.Generator().manual_seed(1)
    for trial in range(200):
        values, leaves = _random_chain_and_leaves(gen, 1 + trial % 5)
        budget, n_parallel = 2 + trial % 6, 1 + trial % 4
        done = chain_is_done(values, leaves, budget, n_parallel)
        nxt = values[-1] * float(torch.rand((), generator=gen))
        for candidate in (values[-1], nxt):  # the best and a typical next value
            kept, _ = best_first(values + [candidate], leaves, budget, n_parallel)
            if done:
                assert kept <= len(values), (trial, candidate)
        kept, _ = best_first(values + [values[-1]], leaves, budget, n_parallel)
        assert done == (kept <= len(values)), trial


# ---- the runtime's tree loop on the eager reference -------------------------------------------

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Paris is the capital of France. Berlin is the capital of",
    "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5",
]
N_TOKENS = 40
TREE_NODES = 12
# (n_parallel, p_split, best_first, k): a chain, wide (many branches at the first positions),
# deep, and trees shaped by path probability.
TREE_PARAMS = {
    "chain": (1, 0.1, False, 4),
    "default": (4, 0.1, False, 4),
    "wide": (8, 0.0, False, 2),
    "deep": (2, 0.0, False, 7),
    "best-first": (4, 0.1, True, 6),
    "best-first-wide": (12, 0.1, True, 3),
}


def first_layer_checkpoint(src: Path, out: Path) -> Path:
    """The target's first layer with its norm and head: a draft that is often right."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(str(out / "model.safetensors"))
    save_file(
        {k: v for k, v in weights.items() if ".layers.1." not in k}, str(out / "model.safetensors")
    )
    return out


@pytest.fixture(scope="module")
def tree_engines(tiny_checkpoint, tmp_path_factory):
    from reference import eager_engine

    draft = first_layer_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("draft") / "layer0")
    return {
        "own": eager_engine(tiny_checkpoint, draft, 160, 6, tree_nodes=TREE_NODES),
        "shared": eager_engine(
            tiny_checkpoint, draft, 160, 6, share_kv=True, tree_nodes=TREE_NODES
        ),
    }


_PLAIN: dict[tuple[int, str], list[int]] = {}


def _plain(engine, prompt: str) -> list[int]:
    """Plain greedy ids, once per engine and prompt."""
    key = (id(engine), prompt)
    if key not in _PLAIN:
        _PLAIN[key] = _generate(engine, engine.tokenizer.encode(prompt)).token_ids
    return _PLAIN[key]


def _generate(engine, ids, **kw):
    from aotgen.runtime.engine import GenerationConfig

    return engine.generate(ids, GenerationConfig(max_new_tokens=N_TOKENS, ignore_eos=True, **kw))


@pytest.mark.parametrize("shape", list(TREE_PARAMS))
@pytest.mark.parametrize(
    "proposer", ["ngram-own", "draft-own", "draft-shared", "draft+ngram-shared"]
)
def test_tree_greedy_equals_plain_greedy_eager(tree_engines, proposer, shape):
    from aotgen.runtime.tree_draft import TreeParams

    mode, _, which = proposer.partition("-")
    engine = tree_engines[which]
    n_parallel, p_split, best, k = TREE_PARAMS[shape]
    tree = TreeParams(n_parallel, p_split, best)
    nodes = drafted = branch_steps = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        spec = _generate(engine, ids, speculative=mode, k=k, tree=tree)
        assert spec.token_ids == _plain(engine, prompt), (prompt, proposer, shape)
        nodes += spec.spec.tree_nodes
        drafted += spec.spec.drafted
        branch_steps += spec.spec.branch_steps
    assert drafted > 0, "nothing was drafted: the test would be vacuous"
    if shape == "chain":
        assert nodes == drafted and branch_steps == 0
    elif mode != "ngram":  # branches open and some win
        assert nodes > drafted and branch_steps > 0, (nodes, drafted, branch_steps)


def test_tree_lookup_drafts_from_the_lookup_cache(tree_engines):
    """An n-gram tree with a cache of earlier requests: the same prompt three times gives plain
    greedy ids each time, the later ones in fewer steps (their chains come from the cache)."""
    from aotgen.runtime.lookup_cache import LookupCache
    from aotgen.runtime.tree_draft import TreeParams

    engine = tree_engines["own"]
    ids = engine.tokenizer.encode(PROMPTS[0])
    engine.lookup_cache = LookupCache()
    try:
        runs = [_generate(engine, ids, speculative="ngram", tree=TreeParams(2)) for _ in range(3)]
    finally:
        engine.lookup_cache = None
    assert all(r.token_ids == _plain(engine, PROMPTS[0]) for r in runs)
    assert runs[2].spec.steps < runs[0].spec.steps, [r.spec.steps for r in runs]


class FixedShapes:
    """A proposer of a fixed tree shape: the chain is the target's greedy continuation, each
    token replaced by a random one with probability 1/3; branch tokens are the true token or
    random, half each. Every path through the tree gets exercised, copies included."""

    def __init__(self, parents: list[int], truth: list[int], seed: int) -> None:
        self.parents, self.truth = parents, truth
        self.gen = torch.Generator().manual_seed(seed)
        self.start = 0

    def _token(self, true_token: int, p_wrong: float) -> int:
        if float(torch.rand((), generator=self.gen)) < p_wrong:
            return int(torch.randint(300, (), generator=self.gen))
        return true_token

    def propose(self, history: list[int], k: int, budget: int) -> Tree:
        tree = Tree.root(history[-1])
        done = len(history) - self.start  # tokens of `truth` already out
        for p in self.parents[: budget - 1]:
            depth = tree.depths[p] + 1
            true = self.truth[min(done + depth - 1, len(self.truth) - 1)]
            tree.add(p, self._token(true, 1 / 3 if len(tree) == depth else 1 / 2))
        return tree

    def accepted(self, pos: int) -> None:
        pass

    def verified(self, path: list[int]) -> None:
        pass


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fixed_tree_shapes_greedy_equals_plain(tree_engines, shape, monkeypatch):
    from aotgen.runtime import tree_draft
    from aotgen.runtime.tree_draft import TreeParams

    engine = tree_engines["own"]
    branch_steps = 0
    for seed, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(prompt)
        plain = _plain(engine, prompt)
        fixed = FixedShapes(SHAPES[shape], plain, seed)
        fixed.start = len(ids)
        monkeypatch.setattr(tree_draft, "tree_proposer", lambda *a, fixed=fixed: fixed)
        spec = _generate(engine, ids, speculative="ngram", tree=TreeParams())
        assert spec.token_ids == plain, (prompt, shape)
        branch_steps += spec.spec.branch_steps
    if shape != "chain":
        assert branch_steps > 0


def test_tree_needs_a_tree_graph(tree_engines, tiny_checkpoint):
    from reference import eager_engine

    from aotgen.runtime.engine import GenerationError
    from aotgen.runtime.tree_draft import TreeParams

    engine = eager_engine(tiny_checkpoint, None, 160, 4)
    ids = engine.tokenizer.encode(PROMPTS[0])
    with pytest.raises(GenerationError, match="no tree verify graph.*tree_nodes"):
        _generate(engine, ids, speculative="ngram", tree=TreeParams())
    with pytest.raises(GenerationError, match="speculative mode"):
        _generate(tree_engines["own"], ids, tree=TreeParams())


# ---- a compiled package with the tree graph ---------------------------------------------------


@pytest.fixture(scope="module")
def tree_package(tiny_checkpoint, project) -> Path:
    """The tiny target, its first layer as a shared-cache draft, and a 8-row tree graph."""
    from conftest import TINY_RECIPE

    from aotgen.package.build import build
    from aotgen.recipe import parse_recipe

    data = {
        "checkpoint": str(tiny_checkpoint),
        **TINY_RECIPE,
        "tree_nodes": 8,
        "speculative": {"draft": {"layers": 1}},
    }
    return build(parse_recipe(data, "tiny-tree", Path(".")), project).path


def test_compiled_tree_greedy_equals_plain(tree_package):
    from aotgen.package.manifest import verify_package
    from aotgen.runtime.engine import Engine
    from aotgen.runtime.tree_draft import TreeParams

    graphs = verify_package(tree_package)["models"]["target"]["graphs"]
    assert graphs["tree"]["inputs"][-1] == {"name": "tree_mask", "shape": [8, 8], "dtype": "bool"}
    engine = Engine.load(tree_package)
    for mode in ("ngram", "draft", "draft+ngram"):
        branch_steps = 0
        for prompt in PROMPTS:
            ids = engine.tokenizer.encode(prompt)
            plain = _generate(engine, ids).token_ids
            for tree in (
                TreeParams(1),
                TreeParams(4, 0.1),
                TreeParams(8, 0.0),
                TreeParams(4, best_first=True),
            ):
                spec = _generate(engine, ids, speculative=mode, k=4, tree=tree)
                assert spec.token_ids == plain, (prompt, mode, tree)
                branch_steps += spec.spec.branch_steps
        if mode != "ngram":
            assert branch_steps > 0, mode


def test_compiled_tree_sampling_matches_plain(tree_package):
    from test_speculative import _chi_square_same, _samples

    from aotgen.runtime.engine import Engine
    from aotgen.runtime.tree_draft import TreeParams

    engine = Engine.load(tree_package)
    ids = engine.tokenizer.encode(PROMPTS[1])
    n, position = 600, 2
    plain = _samples(engine, ids, n, position)
    tree = TreeParams(4, 0.05)
    spec = _samples(engine, ids, n, position, speculative="draft", k=4, tree=tree)
    stat, dof, crit = _chi_square_same(plain, spec)
    assert dof >= 2 and stat < crit, (stat, dof, crit)


def test_package_without_tree_graph_refuses_tree_mode(tiny_package):
    """An older package (no tree graph): one clear line from the CLI, no traceback."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "aotgen", "run", str(tiny_package), "--prompt", PROMPTS[0]]
    cmd += ["--lookup", "ngram", "--draft-parallel", "4", "--max-new-tokens", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "has no tree verify graph" in out.stderr and "tree_nodes" in out.stderr


@pytest.mark.parametrize(
    "tree_nodes, match",
    [(1, "tree_nodes must be 0"), (33, "tree_nodes must be 0"), (True, "tree_nodes must be 0")],
)
def test_tree_nodes_is_checked(tree_nodes, match):
    from aotgen.recipe import RecipeError, parse_recipe

    with pytest.raises(RecipeError, match=match):
        parse_recipe({"checkpoint": "c", "tree_nodes": tree_nodes}, "r", Path("."))
    with pytest.raises(RecipeError, match="not supported with `parallel`"):
        parse_recipe(
            {"checkpoint": "c", "tree_nodes": 8, "parallel": {"tensor": 2}}, "r", Path(".")
        )


def test_bench_has_tree_rows(tree_package, tmp_path, monkeypatch):
    """`aotgen bench --speculative` on a package with a tree graph: a tree row per mode,
    each with plain greedy's output, and the tree step's cost."""
    from aotgen import bench

    prompts = {
        "chat": ["the cat sat"],
        "grounded": ["Repeat: {text}"],
        "grounded_text": "a b c a b",
    }
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    monkeypatch.setattr(bench, "PROMPTS_FILE", tmp_path / "prompts.json")
    rows, costs = bench.bench_speculative(tree_package, max_new_tokens=8, rounds=1)
    modes = ["ngram", "draft", "draft+ngram"]
    assert [r.mode for r in rows if r.task == "chat"] == [
        "plain",
        *modes,
        *(f"{m} tree" for m in modes),
    ]
    assert all(r.same_as_plain for r in rows)
    assert costs["tree_ms"] > 0


def test_bench_samples_every_mode_with_seeds(tree_package, tmp_path, monkeypatch):
    """`aotgen bench --speculative --temperature T`: every mode samples, each generation seeded
    by prompt and pass with the same seed in every mode; outputs are not compared with plain's
    (they differ by design)."""
    from aotgen import bench
    from aotgen.runtime.engine import Engine, GenerationConfig
    from aotgen.runtime.sampling import SamplingParams

    prompts = {"chat": ["the cat sat", "one two"], "grounded": ["Repeat: {text}"]}
    prompts["grounded_text"] = "a b c a b"
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    monkeypatch.setattr(bench, "PROMPTS_FILE", tmp_path / "prompts.json")
    calls = []
    generate = Engine.generate

    def spy(self, ids, config):
        out = generate(self, ids, config)
        calls.append((tuple(ids), config.speculative, config.tree, config.sampling, out.token_ids))
        return out

    monkeypatch.setattr(Engine, "generate", spy)
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    rows, _ = bench.bench_speculative(tree_package, 8, rounds=2, sampling=sampling)
    for r in rows:
        assert r.same_as_plain is None and r.tokens > 0
        if r.mode != "plain":
            assert 0 <= r.acceptance <= 1
    timed = [c for c in calls if c[3].seed is not None]  # the warm-ups are unseeded
    assert len(timed) == 7 * (2 * 2 + 2 * 1)  # 7 modes x (2 chat prompts + 1 grounded) x 2
    assert all((c[3].temperature, c[3].top_p) == (1.0, 0.9) for c in calls)
    chat = [c for c in timed if c[0] == tuple(timed[0][0])]
    assert [c[3].seed for c in chat] == [0] * 7 + [2] * 7  # prompt 0: pass 0, then pass 1
    plain = [c[4] for c in chat if c[1] is None]
    config = GenerationConfig(8, SamplingParams(temperature=1.0, top_p=0.9, seed=0))
    assert plain[0] == generate(Engine.load(tree_package), list(chat[0][0]), config).token_ids


@pytest.mark.cpp
@pytest.mark.parametrize(
    "mode, flags, best_first, penalized",
    [
        ("ngram", ["--lookup", "ngram"], False, False),
        ("draft", ["--speculative"], False, False),
        ("draft+ngram", ["--speculative", "--lookup", "ngram"], False, False),
        # Both best-first proposers: lookup where it matches, the draft elsewhere.
        ("draft+ngram", ["--speculative", "--lookup", "ngram"], True, False),
        # Each node's row under the penalties as they stand after its path.
        ("draft", ["--speculative"], False, True),
    ],
    ids=["ngram", "draft", "draft+ngram", "draft+ngram-best-first", "draft-penalties"],
)
def test_cpp_tree_speculation_gives_pythons_ids(
    run_bin, tree_package, mode, flags, best_first, penalized
):
    """aotgen-run --draft-parallel: the same ids, counts and logprobs (the accepted path's
    rows) as the Python runtime, greedy and sampled (same drafting order, same random draws),
    and greedy equals plain."""
    from test_cpp_runtime import PENALTIES, PENALTY_FLAGS, cpp_generate, sampling_args

    from aotgen.runtime.engine import Engine, GenerationConfig
    from aotgen.runtime.sampling import SamplingParams
    from aotgen.runtime.tree_draft import TreeParams

    engine = Engine.load(tree_package)
    tree = TreeParams(4, 0.05, best_first)
    tree_flags = ["--draft-parallel", "4", "--p-split", "0.05", "--k", "4"]
    tree_flags += ["--best-first"] if best_first else []
    nodes = branches = lookups = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        common = ["--max-new-tokens", str(N_TOKENS), "--ignore-eos"]
        for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=7)):
            cfg = GenerationConfig(
                max_new_tokens=N_TOKENS,
                ignore_eos=True,
                sampling=params,
                speculative=mode,
                k=4,
                tree=tree,
                logprobs=1,
                penalties=PENALTIES if penalized else None,
            )
            ref = engine.generate(ids, cfg)
            got = cpp_generate(
                run_bin,
                tree_package,
                ids,
                *common,
                *sampling_args(params),
                *flags,
                *tree_flags,
                *(PENALTY_FLAGS if penalized else []),
                "--logprobs",
                "1",
            )
            assert got["ids"] == ref.token_ids, (prompt, params)
            assert [x["logprob"] for x in got["logprobs"]] == pytest.approx(
                [lp.logprob for lp in ref.logprobs], abs=1e-5
            )
            for key in ("drafted", "accepted", "lookup_steps", "tree_nodes", "branch_steps"):
                assert got["spec"][key] == getattr(ref.spec, key), key
            if params.greedy and penalized:
                plain = GenerationConfig(N_TOKENS, ignore_eos=True, penalties=cfg.penalties)
                assert got["ids"] == engine.generate(ids, plain).token_ids
            elif params.greedy:
                assert got["ids"] == _plain(engine, prompt)
            nodes += got["spec"]["tree_nodes"]
            branches += got["spec"]["branch_steps"]
            lookups += got["spec"]["lookup_steps"]
    assert nodes > 0
    if mode == "draft+ngram":
        assert lookups > 0, "lookup never proposed: its tree code was not reached"
    if mode != "ngram":
        assert branches > 0, "no branch won: the test would not reach the branch code"


@pytest.mark.cpp
def test_cpp_package_without_tree_graph_refuses_tree_mode(run_bin, tiny_package):
    from test_cpp_runtime import assert_fails, run

    proc = run(
        run_bin,
        tiny_package,
        "--prompt",
        "a b",
        "--lookup",
        "ngram",
        "--draft-parallel",
        "2",
        "--max-new-tokens",
        "4",
        check=False,
    )
    assert_fails(proc, "has no tree verify graph")
