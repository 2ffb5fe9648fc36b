"""A reasoning budget: at most N tokens of reasoning, then the reasoning is closed for the
model, which goes on to answer (llama.cpp's `--reasoning-budget`, vLLM's
`thinking_token_budget`, Anthropic's `thinking.budget_tokens`).

The answer's tokens drive a small state machine, as llama.cpp's reasoning-budget sampler
does: `idle` watches for the text that opens the reasoning (`<think>`; gpt-oss's
`<|channel|>analysis<|message|>`), `counting` spends the budget until the text that closes it
comes, `waiting` lets a character whose bytes are split across tokens finish, `forcing` allows
only the next token of the closing text (an optional message, then the close), `done` passes
everything. The tags are looked for in the tokens' bytes, however the model spells them.
A reasoning closed by the model itself leaves what is left of the budget for any
later reasoning of the same answer: the budget bounds all of it.

The state after each taken token is kept, so speculative decoding can ask what each verify
row (each tree node) allows after the proposal tokens before it, and drafters roll back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from aotgen.runtime.harmony import CHANNEL, MESSAGE, START, head_of, takes_harmony
from aotgen.runtime.reasoning import CLOSE, OPEN, takes_reasoning, thinking_of

if TYPE_CHECKING:
    from aotgen.runtime.tokenizer import Tokenizer

IDLE, COUNTING, WAITING, FORCING, DONE = "idle", "counting", "waiting", "forcing", "done"
_ANALYSIS = f"{CHANNEL}analysis{MESSAGE}"
_HARMONY_CLOSE = f"<|end|>{START}assistant{CHANNEL}final{MESSAGE}"  # on to the final answer


class BudgetError(ValueError):
    """A reasoning budget the package cannot keep (its template has no reasoning)."""


@dataclass(frozen=True)
class BudgetMarks:
    """The text that opens and closes a model's reasoning, and the token ids forced when the
    budget is spent."""

    open: bytes
    close: bytes
    forced: tuple[int, ...]


@dataclass(frozen=True)
class BudgetState:
    phase: str
    left: int  # budget tokens left
    tail: bytes = b""  # the last bytes, where a tag may be starting
    forced: int = 0  # tokens of `forced` taken so far (forcing)
    owed: int = 0  # UTF-8 continuation bytes still to come for the last character


def has_reasoning(tok: Tokenizer) -> bool:
    """Whether the package's chat template has a reasoning a budget can bound."""
    return takes_harmony(tok.chat_template) or takes_reasoning(tok.chat_template)


def marks_of(tok: Tokenizer, message: str = "") -> BudgetMarks:
    """The marks of the package's template: `<think>` tags or gpt-oss's analysis channel.
    `message` goes before the forced close (e.g. "Time is up; I answer now.")."""
    if takes_harmony(tok.chat_template):
        forced = tok.encode(message) + tok.encode(_HARMONY_CLOSE)
        return BudgetMarks(_ANALYSIS.encode(), b"<|end|>", tuple(forced))
    if takes_reasoning(tok.chat_template):
        lead = f"{message}\n" if message else "\n"
        return BudgetMarks(OPEN.encode(), CLOSE.encode(), tuple(tok.encode(lead + CLOSE)))
    raise BudgetError(
        "this package's chat template has no reasoning (<think> tags or gpt-oss's analysis "
        "channel) for a reasoning budget to bound; leave the budget out"
    )


def start_of(tok: Tokenizer, prompt: list[int], budget: int) -> BudgetState:
    """Where an answer to `prompt` starts: inside a reasoning the prompt opened, past one it
    closed (nothing to bound), or idle (the model may open one)."""
    head = head_of(tok, prompt)
    if head is not None:
        inside = _ANALYSIS in head  # the prompt continues an analysis message
    else:
        thinking = thinking_of(tok, prompt)
        if thinking is None:
            return BudgetState(DONE, budget)
        inside = thinking
    return _opened(budget) if inside else BudgetState(IDLE, budget)


def _opened(left: int) -> BudgetState:
    return BudgetState(COUNTING, left) if left > 0 else BudgetState(FORCING, 0)


def _owed_after(owed: int, data: bytes) -> int:
    """UTF-8 continuation bytes still owed after `data`."""
    for byte in data:
        if byte & 0xC0 == 0x80:
            owed = max(owed - 1, 0)
        elif byte >= 0xF0:
            owed = 3
        elif byte >= 0xE0:
            owed = 2
        elif byte >= 0xC0:
            owed = 1
        else:
            owed = 0
    return owed


def _find(tag: bytes, tail: bytes, data: bytes) -> tuple[bytes | None, bytes]:
    """(the bytes after `tag` if it ends within `data`, else None; the new tail)."""
    window = tail + data
    at = window.find(tag)
    if at < 0:
        return None, _tail(window, tag)
    after = window[at + len(tag) :]
    return after, _tail(after, tag)


def _tail(data: bytes, tag: bytes) -> bytes:
    """The last bytes of `data` that may start `tag`."""
    return data[max(len(data) - len(tag) + 1, 0) :]


class ReasoningBudget:
    """One request's budget and its state after each taken token."""

    def __init__(self, tok: Tokenizer, marks: BudgetMarks, start: BudgetState):
        self.tok, self.marks = tok, marks
        self.states = [start]

    @property
    def state(self) -> BudgetState:
        return self.states[-1]

    def forced(self, state: BudgetState | None = None) -> int | None:
        """The one token allowed next, or None: any."""
        state = state or self.state
        return self.marks.forced[state.forced] if state.phase == FORCING else None

    def step(self, state: BudgetState, token: int) -> BudgetState:
        m = self.marks
        if state.phase == IDLE:
            after, tail = _find(m.open, state.tail, self.tok.token_bytes(token))
            return replace(state, tail=tail) if after is None else _opened(state.left)
        if state.phase in (COUNTING, WAITING):
            data = self.tok.token_bytes(token)
            after, tail = _find(m.close, state.tail, data)
            if after is not None:  # the model closed it: the rest of the budget stays
                return BudgetState(IDLE, state.left, tail=_tail(after, m.open))
            owed = _owed_after(state.owed, data)
            left = state.left - (state.phase == COUNTING)
            if left > 0:
                return replace(state, left=left, tail=tail, owed=owed)
            return BudgetState(FORCING if owed == 0 else WAITING, 0, tail=tail, owed=owed)
        if state.phase == FORCING:
            forced = state.forced + 1
            if forced == len(m.forced):
                return BudgetState(DONE, 0)
            return replace(state, forced=forced)
        return state

    def advance(self, tokens: list[int]) -> None:
        for token in tokens:
            self.states.append(self.step(self.state, token))

    def rollback(self, count: int) -> None:
        del self.states[len(self.states) - count :]

    def along(self, tokens: list[int]) -> tuple[int, list[int | None]]:
        """How many leading `tokens` the budget takes (none past a forced token they miss),
        and the forced token of each verify row (row i: after tokens[:i])."""
        state, rows = self.state, [self.forced()]
        for token in tokens:
            if rows[-1] is not None and token != rows[-1]:
                break
            state = self.step(state, token)
            rows.append(self.forced(state))
        return len(rows) - 1, rows

    def over_tree(self, tokens: list[int], parents: list[int]) -> list[int | None]:
        """The forced token of each tree node's row, after the node's path."""
        states = [self.state]
        for node, parent in enumerate(parents[1:], 1):
            states.append(self.step(states[parent], tokens[node]))
        return [self.forced(s) for s in states]
