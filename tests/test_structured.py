"""Structured output (runtime/grammar.py): greedy decoding under a regex against a reference
that checks every candidate's text with the `regex` module's partial matching; speculative
decoding under a grammar against plain decoding (greedy: the same ids; sampled: the exact
distribution over answers); the batch engine against requests alone; `run` and `serve`."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import eager_engine, reset_caches

pytest.importorskip("llguidance")
regex = pytest.importorskip("regex")  # a dependency of transformers

from aotgen.runtime.batch_engine import BatchEngine  # noqa: E402
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationError  # noqa: E402
from aotgen.runtime.grammar import Grammar, GrammarError  # noqa: E402
from aotgen.runtime.rules import Penalties  # noqa: E402
from aotgen.runtime.sampling import SamplingParams, logits_to_probs  # noqa: E402
from aotgen.runtime.tree_draft import TreeParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORDS = r"[a-z ]{3,24}\."  # always completes within 25 characters
SPEC_MODES = ["ngram", "draft", "draft+ngram"]


@pytest.fixture(scope="module")
def engine(tiny_batch_package) -> Engine:
    return Engine.load(tiny_batch_package, threads=1)


def _config(grammar: Grammar | None, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=40, grammar=grammar, reuse_prefix=False, **kw)


def _prompt(engine: Engine, i: int = 0) -> list[int]:
    return engine.tokenizer.encode(["the cat sat on", "a dog ran to", "one two"][i])


def _reference_greedy(engine: Engine, prompt: list[int], pattern: str, limit: int) -> list[int]:
    """Greedy decoding where a token is allowed iff the answer's text with it is still a
    prefix of a match (`regex` partial matching), and eos iff the text matches in full."""
    tok = engine.tokenizer
    special = set(tok._tok.get_added_tokens_decoder())
    out: list[int] = []
    reset_caches(engine.target)
    while len(out) < limit:
        logits = engine.target.forward(prompt + out, 0)
        text = tok.decode(out)
        for t in logits.argsort(descending=True).tolist():
            if t in tok.eos_ids:
                if regex.fullmatch(pattern, text):
                    return out
            elif t not in special and regex.fullmatch(pattern, tok.decode(out + [t]), partial=True):
                out.append(t)
                break
        else:
            raise AssertionError(f"no token continues {text!r}")
    return out


# ---- greedy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("i", [0, 1, 2])
def test_greedy_under_a_regex_equals_the_partial_match_reference(engine, i):
    prompt = _prompt(engine, i)
    result = engine.generate(prompt, _config(Grammar("regex", WORDS)))
    assert result.finish_reason == "eos"
    assert regex.fullmatch(WORDS, result.text)
    assert result.token_ids == _reference_greedy(engine, prompt, WORDS, 40)
    unconstrained = engine.generate(prompt, _config(None, ignore_eos=True))
    assert not regex.fullmatch(WORDS, unconstrained.text)  # the grammar changed the answer


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_speculative_greedy_under_a_grammar_equals_plain(engine, mode):
    """Proposals are cut where the grammar refuses and verify rows restricted: the ids are
    plain constrained decoding's; the draft drafts within the grammar (acceptance above 0)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    for grammar in (Grammar("regex", WORDS), Grammar.json_schema(schema)):
        for i in range(3):
            prompt = _prompt(engine, i)
            plain = engine.generate(prompt, _config(grammar))
            spec = engine.generate(prompt, _config(grammar, speculative=mode))
            assert spec.token_ids == plain.token_ids, (grammar.kind, i)
            assert spec.finish_reason == plain.finish_reason
            if grammar.kind == "json_schema" and plain.finish_reason == "eos":
                answer = json.loads(plain.text)
                assert set(answer) == {"name", "n"} and isinstance(answer["n"], int)
        assert spec.spec.steps > 0


@pytest.fixture(scope="module")
def tree_engine(tiny_checkpoint) -> Engine:
    """The eager model with a 12-node tree graph and itself as the draft."""
    return eager_engine(tiny_checkpoint, tiny_checkpoint, 160, 6, tree_nodes=12)


TREES = [TreeParams(4, 0.02, False), TreeParams(4, 0.02, True)]


@pytest.mark.parametrize("mode", ["ngram", "draft"])
@pytest.mark.parametrize("tree", TREES, ids=["p-split", "best-first"])
def test_tree_speculation_under_a_grammar_equals_plain(tree_engine, mode, tree):
    """Trees are drafted free; each node's row is restricted after its path: greedy ids are
    plain constrained decoding's."""
    nodes = 0
    for i in range(3):
        prompt = _prompt(tree_engine, i)
        grammar = Grammar("regex", WORDS)
        plain = tree_engine.generate(prompt, _config(grammar))
        spec = tree_engine.generate(prompt, _config(grammar, speculative=mode, tree=tree))
        assert spec.token_ids == plain.token_ids, i
        assert regex.fullmatch(WORDS, spec.text)
        nodes += spec.spec.tree_nodes
    assert nodes > 0


def test_choice_answers_one_of_the_choices(engine):
    options = ["yes", "no", "maybe later"]
    for i in range(3):
        result = engine.generate(_prompt(engine, i), _config(Grammar.choice(options)))
        assert result.text in options and result.finish_reason == "eos"


# ---- sampling --------------------------------------------------------------------------------
AB4 = "[ab]{4}"  # 16 answers


def penalized(logits: torch.Tensor, prompt: list[int], path: list[int], pen) -> torch.Tensor:
    """The penalties as their definitions read, token by token: logit bias; the repetition
    penalty on tokens of prompt and answer (positive logits divided, negative multiplied);
    minus frequency x count and presence for tokens of the answer."""
    out = logits.float().clone()
    if pen is None:
        return out
    for t, bias in pen.logit_bias:
        out[t] += bias
    for t in set(prompt) | set(path):
        out[t] = out[t] / pen.repetition if out[t] > 0 else out[t] * pen.repetition
    for t in set(path):
        out[t] -= pen.frequency * path.count(t) + pen.presence
    return out


def _exact_answer_probs(
    engine: Engine, prompt: list[int], params: SamplingParams, pen: Penalties | None = None
) -> dict:
    """P(answer) of sampling under AB4: every token path through the grammar, walked with the
    target's logits after each prefix (penalized, restricted, then temperature as in
    sampling)."""
    constraint = engine.grammar_tokens.constraint(Grammar("regex", AB4))
    tok = engine.tokenizer
    probs: dict[str, float] = {}

    def walk(path: list[int], p: float) -> None:
        logits = penalized(engine.target.forward(prompt + path, 0), prompt, path, pen)
        q = logits_to_probs(constraint.restrict(logits)[None], params)[0]
        for t in torch.nonzero(q > 0).flatten().tolist():
            if t in tok.eos_ids:
                text = tok.decode(path)
                probs[text] = probs.get(text, 0.0) + p * float(q[t])
            else:
                constraint.advance([t])
                walk(path + [t], p * float(q[t]))
                constraint.rollback(1)

    reset_caches(engine.target)
    walk([], 1.0)
    return probs


PENALTIES = Penalties(repetition=1.6, presence=0.5, frequency=0.4)  # + a bias on "b"


@pytest.mark.parametrize(
    "mode, pen",
    [(None, None), ("ngram", None), ("draft", None), ("tree", None)]
    + [(None, PENALTIES), ("draft", PENALTIES), ("tree", PENALTIES)],
    ids=["plain", "ngram", "draft", "tree", "plain-penalties", "draft-penalties", "tree-penalties"],
)
def test_sampling_under_a_grammar_has_the_exact_distribution(engine, tree_engine, mode, pen):
    """400 seeded answers under AB4, alone and speculating (a chain; a tree of the eager
    model, drafted free), without and with penalties (runtime/rules.py): each answer's
    frequency against its exact probability (Pearson's chi-square over the 16 answers, those
    expected fewer than 5 times pooled: the bound is 6 standard deviations above its mean,
    the degrees of freedom)."""
    if pen is not None:
        pen = dataclasses.replace(pen, logit_bias=((engine.tokenizer.encode("b")[0], 1.0),))
    extra = {"penalties": pen}
    if mode == "tree":
        engine, mode, extra = tree_engine, "draft", {**extra, "tree": TREES[0]}
    params = SamplingParams(temperature=1.5)
    prompt = _prompt(engine, 0)
    exact = _exact_answer_probs(engine, prompt, params, pen)
    assert len(exact) == 16 and math.isclose(sum(exact.values()), 1.0, rel_tol=1e-4)
    n = 400
    counts: dict[str, int] = {}
    for seed in range(n):
        sampling = SamplingParams(temperature=1.5, seed=seed)
        text = engine.generate(
            prompt, _config(Grammar("regex", AB4), sampling=sampling, speculative=mode, **extra)
        ).text
        counts[text] = counts.get(text, 0) + 1
    assert set(counts) <= set(exact)
    # Answers expected fewer than 5 times are pooled (a chi-square term needs that many).
    rare = [a for a, p in exact.items() if n * p < 5]
    observed = [counts.get(a, 0) for a in exact if a not in rare] + [
        sum(counts.get(a, 0) for a in rare)
    ]
    expected = [n * p for a, p in exact.items() if a not in rare] + [
        n * sum(exact[a] for a in rare)
    ]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    df = sum(e > 0 for e in expected) - 1
    assert chi2 < df + 6 * math.sqrt(2 * df), (chi2, df, counts, exact)


# ---- the batch engine ------------------------------------------------------------------------
def test_batch_engine_serves_grammars_beside_free_requests_as_alone(tiny_batch_package, engine):
    """Constrained and free requests, greedy and seeded, plain and speculating, in one batch:
    each gets what it gets alone."""
    batch = BatchEngine.load(tiny_batch_package, threads=1)
    requests = []
    for i in range(8):
        grammar = [Grammar("regex", WORDS), None, Grammar.json_object(), Grammar("regex", AB4)][
            i % 4
        ]
        sampling = SamplingParams(temperature=0.9, seed=i) if i % 3 == 2 else SamplingParams()
        mode = [None, "ngram", "draft", "draft+ngram"][i // 2 % 4]
        cfg = _config(grammar, sampling=sampling, speculative=mode)
        requests.append((_prompt(engine, i % 3), cfg))
    results = batch.generate_many([p for p, _ in requests], [c for _, c in requests])
    for (prompt, cfg), got in zip(requests, results, strict=True):
        want = engine.generate(prompt, cfg)
        assert got.token_ids == want.token_ids, cfg
        if cfg.grammar is not None and cfg.grammar.kind == "regex" and got.finish_reason == "eos":
            assert regex.fullmatch(cfg.grammar.source, got.text)


# ---- bad grammars ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "grammar,words",
    [
        (Grammar("regex", "[a-z"), "invalid regex"),
        (Grammar("json_schema", '{"type": '), "invalid json_schema"),
        (Grammar("grammar", "start: foo\n"), "invalid grammar"),
        (Grammar("choice", "not a list"), "invalid choice"),
    ],
)
def test_a_bad_grammar_is_a_one_line_generation_error(engine, grammar, words):
    with pytest.raises(GenerationError, match=words) as e:
        engine.generate(_prompt(engine), _config(grammar))
    assert "\n" not in str(e.value)


def test_unknown_kind_and_refused_combinations(engine):
    with pytest.raises(GrammarError, match="expected one of"):
        Grammar("xml", "<a/>")
    prompt = _prompt(engine)
    with pytest.raises(GenerationError, match="drop ignore_eos"):
        engine.generate(prompt, _config(Grammar.json_object(), ignore_eos=True))


# ---- the CLI ---------------------------------------------------------------------------------
def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aotgen", "run", *args], capture_output=True, text=True, cwd=REPO
    )


def test_run_json_schema_file_and_regex(tiny_batch_package, engine, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
                "additionalProperties": False,
            }
        )
    )
    prompt = "the cat sat on"
    for flags, grammar in (
        (["--json-schema", str(schema)], Grammar("json_schema", schema.read_text())),
        (["--regex", WORDS], Grammar("regex", WORDS)),
    ):
        proc = _run(
            str(tiny_batch_package),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "40",
            "--json",
            "--threads",
            "1",
            *flags,
        )
        assert proc.returncode == 0, proc.stderr
        want = engine.generate(engine.tokenizer.prompt_ids(prompt), _config(grammar))
        assert json.loads(proc.stdout)["ids"] == want.token_ids


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--regex", "[a-z"], "invalid regex"),
        (["--json-schema", "missing.json"], "missing.json: no such file"),
        (["--regex", "a", "--json-schema", "{}"], "at most one of"),
    ],
)
def test_run_refuses_bad_grammars_in_one_line(tiny_batch_package, flags, words):
    proc = _run(str(tiny_batch_package), "--prompt", "hi", *flags)
    assert proc.returncode == 1
    assert words in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# ---- the real model --------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_answers_json_matching_a_schema(smollm2_package):
    """SmolLM2 asked for a city as JSON: the answer parses, has exactly the schema's keys and
    types, and speculation (n-gram) gives the same answer."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_grammar import REQUESTS  # the benchmark's first request

    question, schema = REQUESTS[0]
    engine = Engine.load(smollm2_package, threads=2)
    ids = engine.chat_ids(question)
    cfg = GenerationConfig(max_new_tokens=100, grammar=Grammar.json_schema(schema))
    result = engine.generate(ids, cfg)
    assert result.finish_reason == "eos"
    answer = json.loads(result.text)
    assert set(answer) == {"city", "country", "population"}
    assert isinstance(answer["population"], int) and answer["city"] == "Paris"
    spec = engine.generate(
        ids, GenerationConfig(max_new_tokens=100, grammar=cfg.grammar, speculative="ngram")
    )
    assert spec.token_ids == result.token_ids
