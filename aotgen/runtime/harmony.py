"""gpt-oss's answers in OpenAI's harmony format, read apart into reasoning, content and calls.

A harmony answer is a run of messages, each `<|start|>assistant` (the generation prompt ends
with it), a header naming its channel and perhaps a recipient, `<|message|>`, the body, and
`<|end|>` (more follows), `<|call|>` or `<|return|>` (generation ends):

    <|channel|>analysis<|message|>User asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>Paris.<|return|>

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ...}

The `analysis` channel is the model's reasoning (`reasoning_content`, as vLLM and llama-server
send it); `final`, and `commentary` addressed to no one (a preamble), are the answer; a message
to `functions.NAME` is a call of the request's tool NAME, the body its JSON arguments. Other
recipients are gpt-oss's built-in tools (`browser.search`, `python`), which no request
declares and aotgen does not run: such a message is reasoning, as vLLM keeps it out of the
calls. The markers are special tokens: the answer's text keeps them
(`Tokenizer.decode` skips none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aotgen.runtime.reasoning import SplitStream

if TYPE_CHECKING:
    from aotgen.runtime.grammar import Grammar
    from aotgen.runtime.tokenizer import Tokenizer

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


def takes_harmony(chat_template: str | None) -> bool:
    return bool(chat_template) and CHANNEL in chat_template and MESSAGE in chat_template


def answer_head(prompt_text: str) -> str:
    """The part of the answer's first message the prompt already wrote: `assistant` after a
    generation prompt, more where the prompt continues a message."""
    head = prompt_text.rpartition(START)[2]
    return "" if any(end in head for end in ENDS) else head


def head_of(tok: Tokenizer, prompt: list[int]) -> str | None:
    """The answer's head for a chat prompt (`answer_head`), or None: not a harmony template."""
    if not takes_harmony(tok.chat_template):
        return None
    start = tok.token_to_id(START)  # from the last message's start (a long one included)
    at = len(prompt) - 1 - prompt[::-1].index(start) if start in prompt else len(prompt) - 64
    return answer_head(tok.decode(prompt[max(at, 0) :]))


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, JSON arguments)


def _pending(text: str) -> int:
    """Characters at the end that may begin a marker (held back until they cannot)."""
    for size in range(min(max(map(len, MARKERS)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-size:]) for m in MARKERS):
            return size
    return 0


def split_harmony(text: str, head: str = "assistant", final: bool = True) -> Split:
    """Reasoning, content and calls of the answer `text` after its `head` (`answer_head`);
    unless `final`, only what cannot change as more text comes (a call's arguments so far). An
    answer that never opens a message body (a model that does not write harmony) is all
    content."""
    split = Split()
    messages = (head + text).split(START)
    for index, message in enumerate(messages):
        header, has_body, body = message.partition(MESSAGE)
        if not has_body:
            continue  # a header still coming, or text between messages
        ends = [at for at in (body.find(end) for end in ENDS) if at >= 0]
        done = bool(ends) or index + 1 < len(messages) or final
        body = body[: min(ends)] if ends else body
        recipient = _RECIPIENT.search(header)
        if not done:
            body = body[: len(body) - _pending(body)]
        if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
            split.calls.append((recipient.group(1).removeprefix(FUNCTIONS), body.strip()))
            continue
        channel = _CHANNEL.search(header)
        if recipient is not None or (channel is not None and channel.group(1) == "analysis"):
            split.reasoning += ("\n" if split.reasoning else "") + body
        else:
            split.content += body
    if final and MESSAGE not in head + text:
        split.content = text
    return split


class HarmonyStream(SplitStream):
    """A streamed harmony answer; together its deltas add up to `split_harmony` of the whole,
    whose calls `finish` leaves in `calls`."""

    def __init__(self, head: str = "assistant"):
        super().__init__()
        self.head = head
        self.calls: list[tuple[str, str]] = []

    def _split(self, final: bool) -> tuple[str, str]:
        split = split_harmony(self.text, self.head, final)
        self.calls = split.calls
        return split.reasoning, split.content


# Free reasoning before the answer: analysis messages of any text, each followed by the next
# message's start. Special tokens (unquoted) are not text: no text lexeme runs over one.
_ANALYSIS = (
    f'start: analysis* @answer\nanalysis: {CHANNEL} "analysis" {MESSAGE} think <|end|> '
    f'{START} "assistant"\nthink: /(?s:.*)/\n'
)


def after_analysis(grammar: Grammar, channel_head: str) -> Grammar:
    """`grammar` for a message after free reasoning (`Grammar.after_reasoning` for harmony),
    led by `channel_head` (Lark: the message's header up to and with its `<|message|>`)."""
    return grammar.after(_ANALYSIS.replace("@answer", f"{channel_head} @answer"))


def final_answer(grammar: Grammar) -> Grammar:
    """A structured answer (`response_format`) in the final channel, after free reasoning."""
    return after_analysis(grammar, f'{CHANNEL} "final" {MESSAGE}')
