"""A chat answer in OpenAI's shape, whole or streamed: its reasoning apart
(aotgen/reasoning.py; gpt-oss's channels, aotgen/harmony.py), its tool calls read back in the
model's format (aotgen/tool_calls.py), logprobs (openai_api.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aotgen.harmony import HarmonyStream, split_harmony
from aotgen.openai_api import chat_logprobs, finish_reason
from aotgen.reasoning import ReasoningStream, split_reasoning
from aotgen.runtime.engine import GenerationResult
from aotgen.runtime.tokenizer import Tokenizer
from aotgen.tool_calls import ToolCall, ToolCallStream, ToolFormat


class AnswerStream:
    """A streamed chat answer as deltas: reasoning apart (`thinking` None: the template has no
    reasoning; else whether the answer starts inside it), text that may be a tool call held
    back, the calls read whole at the end."""

    def __init__(self, thinking: bool | None, fmt: ToolFormat | None):
        self.reasoning = None if thinking is None else ReasoningStream(thinking)
        self.calls = None if fmt is None else ToolCallStream(fmt)

    def feed(self, piece: str) -> dict[str, Any]:
        reasoning, content = self.reasoning.feed(piece) if self.reasoning else ("", piece)
        if self.calls is not None and content:
            content = self.calls.feed(content)
        return _delta(reasoning, content)

    def finish(self) -> tuple[dict[str, Any], list[ToolCall]]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        calls: list[ToolCall] = []
        if self.calls is not None:
            content = self.calls.feed(content) if content else ""
            rest, calls = self.calls.finish()
            content += rest
        return _delta(reasoning, content), calls


class HarmonyAnswerStream:
    """A streamed harmony answer (gpt-oss) as deltas, its calls read whole at the end (none
    where the request took no tools: `fmt` None)."""

    def __init__(self, head: str, fmt: ToolFormat | None):
        self.split, self.fmt = HarmonyStream(head), fmt

    def feed(self, piece: str) -> dict[str, Any]:
        return _delta(*self.split.feed(piece))

    def finish(self) -> tuple[dict[str, Any], list[ToolCall]]:
        delta = _delta(*self.split.finish())
        return delta, [ToolCall(*c) for c in self.split.calls] if self.fmt else []


def _delta(reasoning: str, content: str) -> dict[str, Any]:
    return {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}


def chat_message(
    text: str, thinking: bool | None, fmt: ToolFormat | None, head: str | None = None
) -> tuple[dict[str, Any], list[ToolCall]]:
    """A whole chat answer as OpenAI's message (reasoning apart) and the tool calls in it
    (`head`: a harmony answer's, aotgen/harmony.py)."""
    if head is not None:
        split = split_harmony(text, head)
        calls = [ToolCall(*c) for c in split.calls] if fmt else []
        message = {
            "role": "assistant",
            "content": (split.content or None) if calls else split.content,
        }
        if split.reasoning:
            message["reasoning_content"] = split.reasoning
        return message, calls
    reasoning, content = (None, text) if thinking is None else split_reasoning(text, thinking)
    content, calls = fmt.parse(content) if fmt else (content, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message, calls


class ChatAnswers:
    """The chunks (streamed) or choices (whole) of one chat request's `n` answers."""

    def __init__(
        self,
        tok: Tokenizer,
        model: str,
        n: int,
        thinking: bool | None,
        fmt: ToolFormat | None,
        head: str | None = None,
    ):
        """`thinking`: where a `<think>` answer starts (aotgen/reasoning.py); `head`: a harmony
        answer's (aotgen/harmony.py)."""
        self.tok, self.thinking, self.fmt, self.answer_head = tok, thinking, fmt, head
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk"}
        self.head |= {"created": int(time.time()), "model": model}
        self.streams = [
            AnswerStream(thinking, fmt) if head is None else HarmonyAnswerStream(head, fmt)
            for _ in range(n)
        ]

    def _calls(self, calls: list[ToolCall], indexed: bool) -> list[dict[str, Any]]:
        assert self.fmt is not None
        return [
            c.as_openai(self.fmt.call_id(), i if indexed else None) for i, c in enumerate(calls)
        ]

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        result: GenerationResult | None = None,
    ) -> dict[str, Any] | None:
        """A streamed chunk: a text piece, or the end (`finish`); None while held back."""
        delta: dict[str, Any] = {}
        if finish is not None and result is not None:
            delta, calls = self.streams[index].finish()
            if calls:
                delta["tool_calls"] = self._calls(calls, indexed=True)
                finish = "tool_calls"
        elif text:
            delta = self.streams[index].feed(text)
            if not delta:
                return None  # held back: a tag or a tool call may be forming
        choice = {"index": index, "delta": delta, "finish_reason": finish}
        if finish is not None and result is not None:
            choice["stop_reason"] = result.stop_reason  # vLLM's: the stop string or token id
        if result is not None and result.logprobs is not None:
            choice["logprobs"] = chat_logprobs(self.tok, result)
        return {**self.head, "choices": [choice]}

    def choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        """A whole answer's choice."""
        message, calls = chat_message(result.text, self.thinking, self.fmt, self.answer_head)
        choice = {"index": index, "message": message, "logprobs": None}
        choice["finish_reason"] = "tool_calls" if calls else finish_reason(result)
        choice["stop_reason"] = result.stop_reason
        if calls:
            message["tool_calls"] = self._calls(calls, indexed=False)
        if result.logprobs is not None:
            choice["logprobs"] = chat_logprobs(self.tok, result)
        return choice
