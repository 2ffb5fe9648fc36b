"""A chat answer in OpenAI's shape, whole or streamed: its reasoning apart
(aotgen/runtime/reasoning.py; gpt-oss's channels, aotgen/runtime/harmony.py), its tool calls
read back in the model's format (aotgen/tool_calls.py), logprobs (openai_api.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aotgen.openai_api import chat_logprobs, finish_reason
from aotgen.runtime.engine import GenerationResult
from aotgen.runtime.harmony import HarmonyStream, split_harmony
from aotgen.runtime.reasoning import ReasoningStream, split_reasoning
from aotgen.runtime.tokenizer import Tokenizer
from aotgen.tool_call_stream import CallDelta, ToolCallStream
from aotgen.tool_calls import ToolCall, ToolFormat


class AnswerStream:
    """A streamed chat answer as deltas: reasoning apart (`thinking` None: the template has no
    reasoning; else whether the answer starts inside it), text that may begin a tool call held
    back, each call's name and arguments as they form (aotgen/tool_call_stream.py)."""

    def __init__(self, thinking: bool | None, fmt: ToolFormat | None):
        self.reasoning = None if thinking is None else ReasoningStream(thinking)
        self.calls = None if fmt is None else ToolCallStream(fmt)

    def feed(self, piece: str) -> tuple[dict[str, Any], list[CallDelta]]:
        reasoning, content = self.reasoning.feed(piece) if self.reasoning else ("", piece)
        return self._answer(reasoning, content)

    def finish(self) -> tuple[dict[str, Any], list[CallDelta], bool]:
        """The last delta, call pieces, and whether the answer ended as calls."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        delta, deltas = self._answer(reasoning, content)
        if self.calls is None:
            return delta, deltas, False
        rest, ended = self.calls.finish()
        return _delta(reasoning, delta.get("content", "") + rest), deltas, ended

    def _answer(self, reasoning: str, content: str) -> tuple[dict[str, Any], list[CallDelta]]:
        deltas: list[CallDelta] = []
        if self.calls is not None and content:
            content, deltas = self.calls.feed(content)
        return _delta(reasoning, content), deltas


class HarmonyAnswerStream:
    """A streamed harmony answer (gpt-oss) as deltas, its calls' pieces as they form (none
    where the request took no tools: `fmt` None)."""

    def __init__(self, head: str, fmt: ToolFormat | None):
        self.split, self.fmt = HarmonyStream(head), fmt
        self.sent: list[int] = []  # how much of each call's arguments went out

    def feed(self, piece: str) -> tuple[dict[str, Any], list[CallDelta]]:
        return _delta(*self.split.feed(piece)), self._calls()

    def finish(self) -> tuple[dict[str, Any], list[CallDelta], bool]:
        delta = _delta(*self.split.finish())
        return delta, self._calls(), bool(self.sent)

    def _calls(self) -> list[CallDelta]:
        """The calls' pieces past what went out (`split_harmony` gives each call's arguments
        so far, each time a longer prefix)."""
        if self.fmt is None:
            return []
        deltas = []
        for index, (name, arguments) in enumerate(self.split.calls):
            if index == len(self.sent):
                self.sent.append(0)
                deltas.append(CallDelta(index, "", name))
            if piece := arguments[self.sent[index] :]:
                self.sent[index] = len(arguments)
                deltas.append(CallDelta(index, piece))
        return deltas


def _delta(reasoning: str, content: str) -> dict[str, Any]:
    return {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}


def chat_message(
    text: str, thinking: bool | None, fmt: ToolFormat | None, head: str | None = None
) -> tuple[dict[str, Any], list[ToolCall]]:
    """A whole chat answer as OpenAI's message (reasoning apart) and the tool calls in it
    (`head`: a harmony answer's, aotgen/runtime/harmony.py)."""
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
        """`thinking`: where a `<think>` answer starts (aotgen/runtime/reasoning.py); `head`: a
        harmony answer's (aotgen/runtime/harmony.py)."""
        self.tok, self.thinking, self.fmt, self.answer_head = tok, thinking, fmt, head
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk"}
        self.head |= {"created": int(time.time()), "model": model}
        self.streams = [
            AnswerStream(thinking, fmt) if head is None else HarmonyAnswerStream(head, fmt)
            for _ in range(n)
        ]
        self.call_ids: list[list[str]] = [[] for _ in range(n)]  # each choice's calls' ids

    def _calls(self, calls: list[ToolCall], indexed: bool) -> list[dict[str, Any]]:
        assert self.fmt is not None
        return [
            c.as_openai(self.fmt.call_id(), i if indexed else None) for i, c in enumerate(calls)
        ]

    def _pieces(self, index: int, deltas: list[CallDelta]) -> list[dict[str, Any]]:
        """Call pieces as OpenAI streams them: a call's first with its id, type and name, the
        rest with more of its arguments."""
        assert self.fmt is not None
        pieces = []
        for d in deltas:
            if d.name is not None:
                self.call_ids[index].append(self.fmt.call_id())
                call = ToolCall(d.name, d.arguments)
                pieces.append(call.as_openai(self.call_ids[index][d.index], d.index))
            else:
                pieces.append({"index": d.index, "function": {"arguments": d.arguments}})
        return pieces

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
            delta, deltas, calls = self.streams[index].finish()
            if calls:
                finish = "tool_calls"
        elif text:
            delta, deltas = self.streams[index].feed(text)
            if not delta and not deltas:
                return None  # held back: a tag or a tool call may be forming
        else:
            deltas = []
        if deltas:
            delta["tool_calls"] = self._pieces(index, deltas)
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
