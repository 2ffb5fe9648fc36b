"""Reasoning: what a model thinks before it answers (`<think> ... </think>`: Qwen3, QwQ,
DeepSeek-R1 and its distills), sent apart from the answer as `reasoning_content`, the field
DeepSeek's API, vLLM's reasoning parsers and llama-server use.

Whether an answer starts inside its reasoning is read from the prompt: DeepSeek-R1's template
ends the prompt with `<think>\\n` (the answer then holds only the closing tag), Qwen3's lets
the model open the tag itself, or closes an empty one when thinking is off
(`chat_template_kwargs: {"enable_thinking": false}`: the answer is all content). Newlines
around the reasoning and before the answer are dropped, as Qwen3's template drops them from
the history it renders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aotgen.runtime.tokenizer import Tokenizer

OPEN, CLOSE = "<think>", "</think>"


def opens_reasoning(prompt_text: str) -> bool | None:
    """True: the prompt opened the reasoning (DeepSeek-R1's generation prompt), the answer
    starts inside it; None: the prompt closed an empty one (Qwen3 with thinking off), none
    comes; False: the model may open one itself."""
    tail = prompt_text.rstrip()
    if tail.endswith(OPEN):
        return True
    return None if tail.endswith(CLOSE) else False


def takes_reasoning(chat_template: str | None) -> bool:
    return bool(chat_template) and OPEN in chat_template


def thinking_of(tok: Tokenizer, prompt: list[int]) -> bool | None:
    """Whether the answer to a chat prompt starts inside its reasoning (True), may open one
    (False), or has none (None: the template has no reasoning, or the prompt closed it)."""
    if not takes_reasoning(tok.chat_template):
        return None
    return opens_reasoning(tok.decode(prompt[-32:]))  # enough for the tags, spelled by bytes


def _split(text: str, thinking: bool, final: bool) -> tuple[str, str]:
    """(reasoning, content) of `text`; unless `final`, only what cannot change as more text
    comes (nothing of a tag that may be forming, no newline that may end the reasoning)."""
    if not thinking:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            undecided = not final and OPEN.startswith(stripped)
            return "", "" if undecided else text
        text = stripped[len(OPEN) :]
    reasoning, closed, content = text.partition(CLOSE)
    if closed:
        return reasoning.strip("\n"), content.lstrip("\n")
    if not final:
        held = next((n for n in range(len(CLOSE) - 1, 0, -1) if text.endswith(CLOSE[:n])), 0)
        reasoning = text[: len(text) - held].rstrip("\n")
    return reasoning.strip("\n"), ""


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """A whole answer's reasoning (None: it has none) and its content."""
    reasoning, content = _split(text, thinking, final=True)
    opened = thinking or text.lstrip().startswith(OPEN)
    return (reasoning if opened else None), content


class SplitStream:
    """A streamed answer split into (reasoning, content) deltas as the text arrives: the split
    of all the text so far, of which only what cannot change goes out (`_split` with `final`
    False), each part sent from where the last delta ended."""

    def __init__(self) -> None:
        self.text = ""
        self.sent_reasoning = self.sent_content = 0

    def _split(self, final: bool) -> tuple[str, str]:
        raise NotImplementedError

    def _deltas(self, final: bool) -> tuple[str, str]:
        reasoning, content = self._split(final)
        out = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) that may go out now."""
        self.text += piece
        return self._deltas(final=False)

    def finish(self) -> tuple[str, str]:
        return self._deltas(final=True)


class ReasoningStream(SplitStream):
    """A streamed `<think>` answer; together its deltas add up to `split_reasoning` of the
    whole."""

    def __init__(self, thinking: bool):
        super().__init__()
        self.thinking = thinking

    def _split(self, final: bool) -> tuple[str, str]:
        return _split(self.text, self.thinking, final)
