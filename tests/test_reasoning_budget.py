"""A reasoning budget (runtime/reasoning_budget.py): greedy answers against a reference loop
that applies the budget as its definition reads (N tokens of reasoning, then any character
left split finished, then the message and the close, then the model again); every
speculative mode and the batch engine against plain decoding; the state machine's tags,
whatever tokens spell them; sampled answers' forced close where the definition puts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reference import (
    CHAT_TEMPLATES,
    eager_engine,
    r1_thinking_template,
    reset_caches,
    with_chat_template,
)
from test_cli_help import aotgen
from test_structured import TREES

from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationError
from aotgen.runtime.grammar import Grammar
from aotgen.runtime.reasoning import split_reasoning
from aotgen.runtime.reasoning_budget import (
    COUNTING,
    DONE,
    FORCING,
    IDLE,
    BudgetState,
    ReasoningBudget,
    marks_of,
)
from aotgen.runtime.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
N = 28
MESSAGE = "Time is up."
QUESTION = [{"role": "user", "content": "How many r are in strawberry?"}]


def _thinking(engine: Engine) -> Engine:
    """`engine` rendering chats with DeepSeek-R1's template: the prompt opens the reasoning."""
    engine.tokenizer = engine.tokenizer.with_chat_template(r1_thinking_template())
    return engine


@pytest.fixture(scope="module")
def engine(tiny_batch_package) -> Engine:
    return _thinking(Engine.load(tiny_batch_package, threads=1))


@pytest.fixture(scope="module")
def tree_engine(tiny_checkpoint) -> Engine:
    """The eager model with a 12-node tree graph and itself as the draft."""
    return _thinking(eager_engine(tiny_checkpoint, tiny_checkpoint, 160, 6, tree_nodes=12))


def _prompts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    asks = ("How many r are in strawberry?", "Name a prime.", "Why is the sky blue?")
    return [tok.encode_chat([{"role": "user", "content": ask}]) for ask in asks]


def _complete(data: bytes) -> bool:
    """Whether `data` ends on a whole UTF-8 character: its last lead byte has all the
    continuation bytes its length asks."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:
            return back >= (1 if byte < 0xC0 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4)
    return True


def _reference(
    engine: Engine, prompt: list[int], budget: int, message: str = "", n: int = N
) -> list[int]:
    """Greedy from the model's logits: `budget` tokens, then tokens until the reasoning's
    bytes end on a whole character, then the forced close, then greedy again."""
    tok, marks = engine.tokenizer, marks_of(engine.tokenizer, message)
    forced = list(marks.forced)
    out: list[int] = []
    start = None
    reset_caches(engine.target)
    while len(out) < n:
        reasoning = b"".join(tok.token_bytes(t) for t in out)
        if start is None and len(out) >= budget and _complete(reasoning):
            assert marks.close not in reasoning  # the random model never closes it itself
            start = len(out)
        if start is not None and len(out) - start < len(forced):
            out.append(forced[len(out) - start])
        else:
            out.append(int(engine.target.forward(prompt + out, 0).argmax()))
    return out


def _config(budget: int | None, **kw) -> GenerationConfig:
    fields = {"max_new_tokens": N, "ignore_eos": True, "reuse_prefix": False} | kw
    return GenerationConfig(reasoning_budget=budget, **fields)


def test_budget_closes_the_reasoning_as_defined(engine):
    """Budgets 0 (closed at once), 1, 5 and 12, with and without a message: the answer is the
    reference's; its reasoning is cut there and the content follows the close."""
    waited = 0
    for prompt in _prompts(engine):
        free = engine.generate(prompt, _config(None))
        for budget, message in ((0, ""), (1, ""), (5, MESSAGE), (12, "")):
            got = engine.generate(prompt, _config(budget, reasoning_budget_message=message))
            want = _reference(engine, prompt, budget, message)
            assert got.token_ids == want, (budget, message)
            assert got.token_ids[:budget] == free.token_ids[:budget]
            reasoning, _ = split_reasoning(got.text, thinking=True)
            assert got.text.count("</think>") == 1
            assert reasoning.endswith(message)
            forced = marks_of(engine.tokenizer, message).forced
            waited += got.token_ids[budget : budget + len(forced)] != list(forced)
    assert waited >= 1  # one of them ends its budget inside a character, and waits


@pytest.mark.parametrize("mode", ["ngram", "draft", "draft+ngram"])
def test_speculation_under_a_budget_equals_plain(engine, mode):
    """Each verify row allows only the forced token where the budget is spent after the
    proposal tokens before it: the greedy ids are plain decoding's."""
    for prompt in _prompts(engine):
        for budget in (0, 3, 9):
            plain = engine.generate(prompt, _config(budget))
            got = engine.generate(prompt, _config(budget, speculative=mode))
            assert got.token_ids == plain.token_ids, (mode, budget)


@pytest.mark.parametrize("mode", ["ngram", "draft"])
@pytest.mark.parametrize("tree", TREES, ids=["p-split", "best-first"])
def test_tree_speculation_under_a_budget_equals_plain(tree_engine, mode, tree):
    for prompt in _prompts(tree_engine):
        for budget in (2, 7):
            plain = tree_engine.generate(prompt, _config(budget))
            got = tree_engine.generate(prompt, _config(budget, speculative=mode, tree=tree))
            assert got.token_ids == plain.token_ids, (mode, budget)


def test_sampled_answers_close_where_the_budget_says(engine):
    """Sampled at temperature 1 (plain and n-gram): the close follows the reasoning's first
    `budget` tokens, or the first whole character after them, in every answer."""
    forced = list(marks_of(engine.tokenizer, "").forced)
    tok, budget = engine.tokenizer, 6
    for seed in range(4):
        for mode in (None, "ngram"):
            params = SamplingParams(temperature=1.0, seed=seed)
            got = engine.generate(
                _prompts(engine)[0], _config(budget, sampling=params, speculative=mode)
            ).token_ids
            start = next(
                i
                for i in range(budget, N)
                if _complete(b"".join(tok.token_bytes(t) for t in got[:i]))
            )
            assert got[start : start + len(forced)] == forced, (seed, mode)


def test_batched_requests_keep_their_own_budgets(engine, tiny_batch_package):
    """Four requests at once, three budgets and none: each answer is the engine's alone."""
    batch = BatchEngine.load(tiny_batch_package, threads=1)
    batch.tokenizer = _thinking(batch.engine).tokenizer
    prompts = _prompts(engine) + _prompts(engine)[:1]
    configs = [_config(budget) for budget in (0, 4, None, 10)]
    got = batch.generate_many(prompts, configs)
    for answer, prompt, config in zip(got, prompts, configs, strict=True):
        assert answer.token_ids == engine.generate(prompt, config).token_ids


def test_the_tags_are_found_however_the_tokens_spell_them(engine):
    """Idle until `<think>` (here in pieces of the byte-level vocabulary), counting to the
    budget, a close by the model itself keeps what is left for a later reasoning, and a
    spent budget forces the close; `along` and `over_tree` agree with stepping."""
    tok = engine.tokenizer
    marks = marks_of(tok)
    budget = ReasoningBudget(tok, marks, BudgetState(IDLE, 13))
    ids = tok.encode("Hm <think>ab</think> ok <think>cdefg")
    assert len(tok.encode("<think>")) > 1
    phases = []
    for token in ids:
        budget.advance([token])
        phases.append((budget.state.phase, budget.state.left))
    text = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    first_open = next(i for i, t in enumerate(text) if t.endswith("<think>"))
    assert phases[first_open - 1][0] == IDLE and phases[first_open] == (COUNTING, 13)
    closed = next(i for i, t in enumerate(text) if t.endswith("</think>"))
    spent = closed - first_open - 1  # "ab" and the close's tokens before its last
    assert phases[closed] == (IDLE, 13 - spent)
    assert len(tok.encode("cdefg")) == 13 - spent  # the rest of the budget
    assert budget.state.phase == FORCING
    assert budget.forced() == marks.forced[0]

    budget = ReasoningBudget(tok, marks, BudgetState(COUNTING, 3))
    proposal = [tok.encode("a")[0]] * 3 + list(marks.forced) + [tok.encode("b")[0]]
    n, rows = budget.along(proposal)
    assert n == len(proposal)
    assert rows[:3] == [None] * 3 and rows[3 : 3 + len(marks.forced)] == list(marks.forced)
    assert rows[-1] is None and budget.state == BudgetState(COUNTING, 3)  # left as it was
    n, _ = budget.along([tok.encode("a")[0]] * 4)  # the fourth misses the forced token
    assert n == 3
    parents = [-1, 0, 1, 2, 1]
    tokens = [0, *proposal[:3], tok.encode("c")[0]]
    assert budget.over_tree(tokens, parents) == [None, None, None, marks.forced[0], None]
    budget.advance(proposal)
    assert budget.state.phase == DONE
    budget.rollback(len(proposal))
    assert budget.state == BudgetState(COUNTING, 3)


def test_a_model_that_opens_its_reasoning_itself(engine, tmp_path):
    """Under Qwen3's template the model opens the reasoning itself (here under a regex that
    makes it): the budget starts at `<think>`, and without one the budget forces nothing."""
    qwen3 = (CHAT_TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    tok = engine.tokenizer
    engine.tokenizer = tok.with_chat_template(qwen3)
    try:
        prompt = engine.tokenizer.encode_chat(QUESTION)
        free = engine.generate(prompt, _config(None))
        assert engine.generate(prompt, _config(3)).token_ids == free.token_ids
        grammar = Grammar("regex", "<think>[a-z ]*(\n</think>[a-z ]*)?")
        plain = engine.generate(prompt, _config(None, grammar=grammar, ignore_eos=False))
        got = engine.generate(prompt, _config(4, grammar=grammar, ignore_eos=False))
        opened = next(i for i in range(N) if tok.decode(got.token_ids[: i + 1]) == "<think>")
        assert got.token_ids[: opened + 5] == plain.token_ids[: opened + 5]
        forced = list(marks_of(engine.tokenizer).forced)
        assert got.token_ids[opened + 5 : opened + 5 + len(forced)] == forced
        assert "\n</think>" not in plain.text
    finally:
        engine.tokenizer = tok


def test_gpt_oss_analysis_closed_into_the_final_answer(engine):
    """Under gpt-oss's harmony template a prompt that continues an analysis message is
    inside the reasoning: after the budget, the message, `<|end|>` and the final channel's
    header are forced (the answer's reference, as for `<think>`)."""
    tok = engine.tokenizer
    harmony = (CHAT_TEMPLATES / "compact-harmony.jinja").read_text()
    engine.tokenizer = tok.with_chat_template(harmony)
    try:
        chat = engine.tokenizer.encode_chat(QUESTION)
        prompt = chat + engine.tokenizer.encode("<|channel|>analysis<|message|>")
        forced = marks_of(engine.tokenizer, MESSAGE).forced
        final = "<|end|><|start|>assistant<|channel|>final<|message|>"
        assert engine.tokenizer.decode(forced) == MESSAGE + final
        config = _config(5, reasoning_budget_message=MESSAGE, max_new_tokens=64)
        got = engine.generate(prompt, config)
        assert got.token_ids == _reference(engine, prompt, 5, MESSAGE, n=64)
        assert got.text.count(final) == 1
        idle = engine.generate(chat, _config(5)).token_ids  # the model opens no analysis
        assert idle == engine.generate(chat, _config(None)).token_ids
    finally:
        engine.tokenizer = tok


def test_bad_budgets_are_one_line_errors(engine, tiny_batch_package):
    prompt = _prompts(engine)[0]
    with pytest.raises(GenerationError, match="reasoning_budget must be a whole number >= 0"):
        engine.generate(prompt, _config(-1))
    plain = Engine.load(tiny_batch_package, threads=1)  # ChatML: no reasoning
    with pytest.raises(GenerationError, match="has no reasoning .* leave the budget out"):
        plain.generate(prompt, _config(8))


def test_aotgen_run_takes_a_budget(tiny_package, tmp_path):
    """`aotgen run --reasoning-budget N --reasoning-budget-message M --json`: the engine's ids
    under the same budget; the reasoning ends with the message, the content after it."""
    package = with_chat_template(tiny_package, tmp_path / "r1", r1_thinking_template())
    engine = Engine.load(package, threads=1)
    flags = ["--max-new-tokens", "40", "--ignore-eos", "--json", "--threads", "1"]
    flags += ["--reasoning-budget", "4", "--reasoning-budget-message", MESSAGE]
    got = json.loads(aotgen("run", str(package), "--chat", "Hi", *flags, cwd=REPO).stdout)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    config = _config(4, max_new_tokens=40, reasoning_budget_message=MESSAGE)
    assert got["ids"] == engine.generate(ids, config).token_ids
    assert got["reasoning"].endswith(MESSAGE) and got["content"]
