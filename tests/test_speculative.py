"""Speculative decoding through the runtime's loops: exactness against plain greedy on the
eager reference, on the compiled package, and distribution equality when sampling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from reference import eager_engine
from tiny import make_tiny_checkpoint

from aotgen.runtime.engine import GenerationConfig, GenerationError
from aotgen.runtime.sampling import SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Paris is the capital of France. Berlin is the capital of",
    "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5",
]
N_TOKENS = 40


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory) -> Path:
    """A different random model with the same tokenizer: a weak draft (low acceptance)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "tiny-draft", seed=7, layers=1)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, other_checkpoint):
    return {
        "self": eager_engine(tiny_checkpoint, tiny_checkpoint, 160, 6),  # always accepts
        "other": eager_engine(tiny_checkpoint, other_checkpoint, 160, 6),
        # The weak 1-layer draft writing its own keys/values into the target's first layer:
        # the verify must overwrite every one of them before the target reads it.
        "shared": eager_engine(tiny_checkpoint, other_checkpoint, 160, 6, share_kv=True),
    }


def _greedy(engine, ids, **kw):
    cfg = GenerationConfig(max_new_tokens=N_TOKENS, ignore_eos=True, **kw)
    return engine.generate(ids, cfg)


@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize(
    "proposer",
    [
        "ngram",
        "draft-self",
        "draft-other",
        "draft-shared",
        "draft+ngram-other",
        "draft+ngram-shared",
    ],
)
def test_speculative_greedy_equals_plain_greedy_eager(engines, proposer, k):
    mode, _, which = proposer.partition("-")
    engine = engines[which or "other"]
    drafted = lookup_steps = draft_steps = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        plain = _greedy(engine, ids)
        spec = _greedy(engine, ids, speculative=mode, k=k)
        assert spec.token_ids == plain.token_ids, (prompt, k)
        s = spec.spec
        assert s.steps > 0 and s.accepted <= s.drafted
        if proposer == "draft-self":  # the draft is the target: everything is accepted
            assert s.acceptance_rate == 1.0
        drafted += s.drafted
        lookup_steps += s.lookup_steps
        draft_steps += s.steps - s.lookup_steps
    assert drafted > 0, "nothing was drafted: the test would be vacuous"
    if mode == "draft+ngram":  # both proposers must have taken turns
        assert lookup_steps > 0 and draft_steps > 0, (lookup_steps, draft_steps)


@pytest.mark.parametrize("which", ["other", "shared"])
def test_adaptive_k_greedy_equals_plain(engines, which):
    engine = engines[which]
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        plain = _greedy(engine, ids)
        for mode in ("ngram", "draft", "draft+ngram"):
            assert (
                _greedy(engine, ids, speculative=mode, adaptive_k=True).token_ids == plain.token_ids
            )


def test_ngram_accepts_on_repetitive_text(engines):
    engine = engines["other"]
    ids = engine.tokenizer.encode(PROMPTS[2])
    s = _greedy(engine, ids, speculative="ngram", k=4).spec
    assert s.drafted > 0 and s.accepted > 0


def test_stop_string_mid_block_is_trimmed(engines):
    engine = engines["self"]
    ids = engine.tokenizer.encode(PROMPTS[0])
    plain = _greedy(engine, ids)
    stop = plain.text[5:8]
    want = plain.text[: plain.text.find(stop)]
    spec = _greedy(engine, ids, speculative="draft", k=6, stop=(stop,))
    assert spec.finish_reason == "stop" and spec.text == want


@pytest.mark.parametrize("speculative", [None, "draft", "ngram"])
def test_stop_token_mid_block_ends_the_answer(engines, speculative):
    """A stop token id (vLLM's stop_token_ids) ends the answer where plain decoding first
    emits it, as eos does: not joining it, finish "stop", the same under speculation."""
    engine = engines["other"]
    ids = engine.tokenizer.encode(PROMPTS[0])
    plain = _greedy(engine, ids)
    stop = plain.token_ids[5]
    want = plain.token_ids[: plain.token_ids.index(stop)]
    got = _greedy(engine, ids, speculative=speculative, k=6, stop_token_ids=(stop,))
    assert got.finish_reason == "stop" and got.token_ids == want
    with pytest.raises(GenerationError, match="stop token ids must be in"):
        _greedy(engine, ids, stop_token_ids=(engine.target.vocab_size,))


def _chi_square_same(a: list[int], b: list[int]) -> tuple[float, int, float]:
    """Two-sample chi-square statistic, degrees of freedom, and the 0.999 critical value
    (Wilson–Hilferty approximation of the chi-square quantile)."""
    ta, tb = torch.tensor(a), torch.tensor(b)
    cats = torch.unique(torch.cat([ta, tb]))
    ca = torch.stack([(ta == c).sum() for c in cats]).double()
    cb = torch.stack([(tb == c).sum() for c in cats]).double()
    keep = (ca + cb) >= 10  # pool rare categories so the approximation holds
    ca = torch.cat([ca[keep], ca[~keep].sum(0, keepdim=True)])
    cb = torch.cat([cb[keep], cb[~keep].sum(0, keepdim=True)])
    if ca[-1] + cb[-1] == 0:
        ca, cb = ca[:-1], cb[:-1]
    na, nb = ca.sum(), cb.sum()
    stat = (((ca * math.sqrt(nb / na) - cb * math.sqrt(na / nb)) ** 2) / (ca + cb)).sum().item()
    dof = len(ca) - 1
    z = 3.09  # 0.999 normal quantile
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat, dof, crit


def _samples(engine, ids, n, position, **kw):
    params = dict(temperature=1.0, top_p=0.95)
    out = []
    for seed in range(n):
        cfg = GenerationConfig(
            max_new_tokens=position + 1,
            ignore_eos=True,
            sampling=SamplingParams(seed=seed, **params),
            **kw,
        )
        out.append(engine.generate(ids, cfg).token_ids[position])
    return out


@pytest.mark.parametrize("mode", ["draft", "draft-shared", "ngram", "draft+ngram"])
def test_sampled_distribution_matches_plain(engines, mode):
    """Speculative sampling is lossless: token histograms agree with plain sampling."""
    mode, _, which = mode.partition("-")
    engine = engines[which or "other"]
    ids = engine.tokenizer.encode(PROMPTS[1])
    n, position = 600, 2
    plain = _samples(engine, ids, n, position)
    spec = _samples(engine, ids, n, position, speculative=mode, k=3)
    stat, dof, crit = _chi_square_same(plain, spec)
    assert dof >= 2, "the test needs a spread-out distribution to mean anything"
    assert stat < crit, (stat, dof, crit)
    # Negative control: a different distribution (greedy) must fail the same test.
    greedy = [t for t in _greedy_tokens(engine, ids, position, n)]
    stat_bad, _, crit_bad = _chi_square_same(plain, greedy)
    assert stat_bad > crit_bad


def _greedy_tokens(engine, ids, position, n):
    tok = _greedy(engine, ids).token_ids[position]
    return [tok] * n


# ---- compiled packages ------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_package(tiny_checkpoint, other_checkpoint, project) -> Path:
    """Target + a separate draft model compiled into one package."""
    from conftest import TINY_RECIPE

    from aotgen.package.build import build
    from aotgen.recipe import parse_recipe

    recipe = parse_recipe(
        {
            "checkpoint": str(tiny_checkpoint),
            **{k: v for k, v in TINY_RECIPE.items() if k != "verify_k"},
            "speculative": {"draft": {"checkpoint": str(other_checkpoint)}, "k": 4},
        },
        "tiny-spec",
        Path("."),
    )
    return build(recipe, project).path


def test_spec_package_has_draft_graphs(spec_package):
    from aotgen.package.manifest import verify_package

    m = verify_package(spec_package)
    assert set(m["models"]) == {"target", "draft"}
    assert set(m["models"]["draft"]["graphs"]) == {"prefill", "decode"}
    assert m["models"]["draft"]["config"]["num_hidden_layers"] == 1


@pytest.mark.parametrize("mode", ["ngram", "draft", "draft+ngram"])
def test_compiled_speculative_greedy_equals_plain(spec_package, mode):
    from aotgen.runtime.engine import Engine

    engine = Engine.load(spec_package)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        plain = _greedy(engine, ids)
        for k in (1, 3, 4):
            spec = _greedy(engine, ids, speculative=mode, k=k)
            assert spec.token_ids == plain.token_ids, (prompt, mode, k)


def test_compiled_sampling_distribution_matches_plain(spec_package):
    from aotgen.runtime.engine import Engine

    engine = Engine.load(spec_package)
    ids = engine.tokenizer.encode(PROMPTS[1])
    n, position = 600, 2
    plain = _samples(engine, ids, n, position)
    spec = _samples(engine, ids, n, position, speculative="draft", k=4)
    stat, dof, crit = _chi_square_same(plain, spec)
    assert dof >= 2 and stat < crit, (stat, dof, crit)


def test_draft_with_other_vocabulary_is_refused(tmp_path, tiny_checkpoint, project):
    import json

    from aotgen.package.build import build
    from aotgen.recipe import RecipeError, parse_recipe

    other = make_tiny_checkpoint(tmp_path / "other-vocab", seed=3, layers=1)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[40], list(vocab)[41]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    recipe = parse_recipe(
        {"checkpoint": str(tiny_checkpoint), "speculative": {"draft": {"checkpoint": str(other)}}},
        "bad-draft",
        Path("."),
    )
    with pytest.raises(RecipeError, match="different vocabulary"):
        build(recipe, project)
    assert not (project.artifacts_dir / "bad-draft").exists()


def test_self_speculation_draft_can_be_quantized(tiny_checkpoint, project):
    """`draft: {layers: N, quantize: ...}`: the target's first layers, int8, compiled AOT."""
    from conftest import TINY_RECIPE

    from aotgen.package.build import build
    from aotgen.recipe import parse_recipe
    from aotgen.runtime.engine import Engine

    draft = {"layers": 1, "quantize": {"linear": "int8"}}
    recipe = parse_recipe(
        {
            "checkpoint": str(tiny_checkpoint),
            **{k: v for k, v in TINY_RECIPE.items() if k != "verify_k"},
            "speculative": {"draft": draft, "k": 4},
        },
        "tiny-self-int8",
        Path("."),
    )
    engine = Engine.load(build(recipe, project).path)
    entry = engine.manifest["models"]["draft"]
    assert entry["config"]["num_hidden_layers"] == 1
    assert entry["quantization"]["linear"]["scheme"] == "int8"
    # Made from the target's weights, the draft runs on the target's first cache layer.
    assert entry["kv_cache"]["shared_with"] == "target"
    assert set(entry["graphs"]) == {"decode"}  # it never prefills: no prefill graph built
    assert len(engine.draft.caches) == 2
    assert all(d is t for d, t in zip(engine.draft.caches, engine.target.caches[:2], strict=True))
    ids = engine.tokenizer.encode(PROMPTS[0])
    plain = _greedy(engine, ids)
    spec = _greedy(engine, ids, speculative="draft", k=3)
    assert spec.token_ids == plain.token_ids
    assert spec.spec.drafted > 0 and spec.spec.accepted > 0


@pytest.mark.parametrize("kernels", ["autotuned", "panels"])
def test_block_quantized_draft_keeps_greedy_output(tiny_checkpoint, project, kernels, monkeypatch):
    """The spec recipe's draft: the target's weights as int4 (int8 head) with int8
    activations (kernels/block_dot.py), compiled into the package: lossy, so only the
    acceptance shows it, never the output. `autotuned`: each weight on the kernel the build
    measured faster (a tiny one-row draft may keep block_dot.cpp); `panels`: every block
    linear on gguf_dot's panels, whatever the timings."""
    from conftest import TINY_RECIPE

    from aotgen.package import autotune
    from aotgen.package.build import build
    from aotgen.recipe import parse_recipe
    from aotgen.runtime.engine import Engine
    from tests.test_block_dot_panels import (
        assert_block_linears_follow_the_autotune,
        assert_block_linears_on_panels,
    )

    if kernels == "panels":
        measured = autotune.Autotune.choose

        def panels_only(self, kind, n, k, rows):
            tile = measured(self, kind, n, k, rows)
            if tile != autotune.BLOCK_DOT:
                return tile
            return measured(self, f"gguf-dot-{autotune.BLOCK_QTYPES[kind]}", n, k, rows)

        monkeypatch.setattr(autotune.Autotune, "choose", panels_only)
    quantize = {
        "linear": {"int4": {"groupsize": 32}},
        "overrides": {"lm_head": "int8"},
        "embedding": "int8",
        "activations": "int8",
    }
    recipe = parse_recipe(
        {
            "checkpoint": str(tiny_checkpoint),
            **{k: v for k, v in TINY_RECIPE.items() if k != "verify_k"},
            "speculative": {"draft": {"quantize": quantize}, "k": 4},
        },
        f"tiny-block-draft-{kernels}",
        Path("."),
    )
    package = build(recipe, project).path
    engine = Engine.load(package)
    linear = engine.manifest["models"]["draft"]["quantization"]["linear"]
    assert linear["activation_dtype"] == "int8" and "block_linear" in linear["kernel"]
    if kernels == "panels":
        assert_block_linears_on_panels(package, "draft")
    else:
        assert_block_linears_follow_the_autotune(package, "draft")
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        plain = _greedy(engine, ids)
        for mode, k in (("draft", 1), ("draft", 4), ("draft+ngram", 3)):
            spec = _greedy(engine, ids, speculative=mode, k=k)
            assert spec.token_ids == plain.token_ids, (prompt, mode, k)
            assert spec.spec.accepted > 0


def test_separate_draft_keeps_its_own_cache(spec_package):
    from aotgen.runtime.engine import Engine

    engine = Engine.load(spec_package)
    assert "shared_with" not in engine.manifest["models"]["draft"]["kv_cache"]
    assert not engine.draft.shares_cache
    assert all(d is not t for d, t in zip(engine.draft.caches, engine.target.caches, strict=False))


def test_shared_cache_layout_mismatch_is_refused():
    from aotgen.package.manifest import PackageError
    from aotgen.runtime.model_runner import _target_cache_layers

    kv = {"layers": 1, "shapes": [[1, 2, 16, 8]] * 2, "dtype": "float32"}
    dtypes = [torch.float32] * 2
    with pytest.raises(PackageError, match="share the target's KV cache"):
        _target_cache_layers(kv, dtypes, [torch.zeros(1, 2, 16, 4)] * 2)
    with pytest.raises(PackageError, match="share the target's KV cache"):
        _target_cache_layers(kv, dtypes, None)
    with pytest.raises(PackageError, match="share the target's KV cache"):  # a state's dtype
        _target_cache_layers(kv, [torch.float32, torch.bfloat16], [torch.zeros(1, 2, 16, 8)] * 2)
    target = [torch.zeros(1, 2, 16, 8) for _ in range(4)]
    shared = _target_cache_layers(kv, dtypes, target)
    assert len(shared) == 2 and shared[0] is target[0] and shared[1] is target[1]


@pytest.mark.parametrize(
    ("spec", "share_kv"),
    [
        ({"draft": {"quantize": {"linear": "int8"}}}, True),
        ({"draft": {"layers": 2}}, True),
        ({"draft": {"layers": 2}, "share_kv": False}, False),
        ({"draft": {"checkpoint": "d"}}, False),
    ],
)
def test_share_kv_defaults_to_drafts_from_the_targets_weights(spec, share_kv):
    from aotgen.recipe import parse_recipe

    recipe = parse_recipe({"checkpoint": "c", "speculative": spec}, "r", Path("."))
    assert recipe.speculative["share_kv"] is share_kv


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"draft": {"checkpoint": "d"}, "share_kv": True}, "separate checkpoint"),
        ({"draft": {"layers": 2}, "share_kv": "yes"}, "true or false"),
    ],
)
def test_share_kv_is_checked(spec, match):
    from aotgen.recipe import RecipeError, parse_recipe

    with pytest.raises(RecipeError, match=match):
        parse_recipe({"checkpoint": "c", "speculative": spec}, "r", Path("."))


@pytest.mark.parametrize(
    "draft",
    [{"layers": 2, "checkpoint": "x"}, {"quantize": {"linear": "int8"}, "lora": 1}, {}],
)
def test_draft_keys_are_checked(draft):
    from aotgen.recipe import RecipeError, parse_recipe

    with pytest.raises(RecipeError, match="draft takes at most one of checkpoint, layers"):
        parse_recipe({"checkpoint": "c", "speculative": {"draft": draft}}, "r", Path("."))


def test_bench_speculative_modes_take_turns(spec_package, tmp_path, monkeypatch):
    """`aotgen bench --speculative`: every mode on every prompt, outputs equal plain greedy."""
    import json

    from aotgen import bench

    prompts = {
        "chat": ["the cat sat", "one two three"],
        "grounded": ["Repeat: {text}", "Copy: {text}"],
        "grounded_text": "a b c a b c a b",
    }
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    monkeypatch.setattr(bench, "PROMPTS_FILE", tmp_path / "prompts.json")
    rows, costs = bench.bench_speculative(spec_package, max_new_tokens=8, rounds=2)
    assert [(r.task, r.mode) for r in rows] == [
        (task, mode)
        for task in ("chat", "grounded 1", "grounded 2")  # grounded prompts: a row each
        for mode in ("plain", "ngram", "draft", "draft+ngram")
    ]
    for r in rows:
        assert r.same_as_plain and r.tok_s > 0 and r.decode_tok_s > 0 and r.tokens > 0
        if r.mode != "plain":
            assert 0 <= r.acceptance <= 1 and 1 <= r.mean_accepted_length <= 5
    assert {"decode_ms", "verify_ms", "draft_ms"} <= set(costs)


def test_cli_draft_behind_lookup(spec_package):
    """`aotgen run --speculative --lookup ngram` prints plain greedy's text and says how many
    steps lookup proposed."""
    import subprocess
    import sys

    def run(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "aotgen", "run", str(spec_package), "--prompt", PROMPTS[2]]
        cmd += ["--max-new-tokens", str(N_TOKENS), *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    plain, spec = run(), run("--speculative", "--lookup", "ngram")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    stats = " ".join(spec.stderr.split())  # rich wraps long lines
    assert "speculative (draft+ngram)" in stats and "n-gram proposed" in stats


def test_cli_ngram_match_bounds(tiny_package):
    """`aotgen run --lookup ngram --ngram-min/--ngram-max`: plain greedy's text; an empty
    range is a one-line error, not a traceback."""
    import subprocess
    import sys

    def run(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "aotgen", "run", str(tiny_package), "--prompt", PROMPTS[0]]
        cmd += ["--max-new-tokens", str(N_TOKENS), "--ignore-eos", *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    plain, spec = run(), run("--lookup", "ngram", "--ngram-min", "2", "--ngram-max", "3")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    bad = run("--lookup", "ngram", "--ngram-min", "5")
    assert bad.returncode != 0 and "--ngram-min (5) must be <= --ngram-max (4)" in bad.stderr
    assert "Traceback" not in bad.stderr
