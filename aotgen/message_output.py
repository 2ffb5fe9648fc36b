"""A chat answer as the Messages API's message: content blocks (`thinking`, `text`, one
`tool_use` per call), whole or as the stream's events (`message_start`, `content_block_start`,
`content_block_delta`, ..., `message_stop`). The whole message is the streamed one fed at once,
so both carry the same blocks."""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from aotgen.messages_api import error_body
from aotgen.runtime.engine import GenerationResult
from aotgen.serve_events import Event

# A streamed block's kind (also the key its text grows under) -> its deltas' type.
_DELTAS = {"text": "text_delta", "thinking": "thinking_delta"}


def anthropic_stop(result: GenerationResult, calls: bool, window: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished answer (`window`: its length
    was the context's room, not max_tokens)."""
    if calls:
        return "tool_use", None
    if result.finish_reason == "length":
        return ("model_context_window_exceeded" if window else "max_tokens"), None
    if isinstance(result.stop_reason, str):
        return "stop_sequence", result.stop_reason
    return "end_turn", None  # eos, or a stop token (stop_token_ids)


class MessageOutput:
    """One answer's content blocks as they form, and its Message object."""

    def __init__(self, model: str, prompt_tokens: int, window: bool = False):
        """`window`: the answer's length is the context's room, less than max_tokens."""
        self.id, self.model, self.prompt_tokens = f"msg_{uuid.uuid4().hex}", model, prompt_tokens
        self.window = window
        self.content: list[dict[str, Any]] = []
        self.open: str | None = None  # the kind of the last block while its text streams

    def opening(self) -> list[Event]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        return [{"type": "message_start", "message": self.body(None, None, usage)}]

    def feed(self, delta: dict[str, Any]) -> list[Event]:
        """Events for a chat delta's reasoning, text and call pieces."""
        events: list[Event] = []
        if reasoning := delta.get("reasoning_content"):
            events += self._text("thinking", reasoning)
        if content := delta.get("content"):
            events += self._text("text", content)
        for piece in delta.get("tool_calls") or []:
            events += self._tool_use(piece)
        return events

    def finish(
        self, delta: dict[str, Any], result: GenerationResult
    ) -> tuple[list[Event], dict[str, Any]]:
        """The last delta's events, the closing events and the Message object."""
        events = self.feed(delta) + self._close()
        calls = any(block["type"] == "tool_use" for block in self.content)
        calls = calls and result.finish_reason != "length"  # a call cut short: max_tokens
        reason, sequence = anthropic_stop(result, calls, self.window)
        usage = {
            "input_tokens": result.prompt_tokens - result.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": result.cached_tokens,
            "output_tokens": len(result.token_ids),
        }
        end = {"type": "message_delta", "usage": usage}
        end["delta"] = {"stop_reason": reason, "stop_sequence": sequence}
        return events + [end, {"type": "message_stop"}], self.body(reason, sequence, usage)

    def error(self, message: str) -> Event:
        """A stream's error event (the message ends with it)."""
        return error_body(500, message)

    def _text(self, kind: str, piece: str) -> list[Event]:
        events: list[Event] = []
        if self.open != kind:
            events += self._close()
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            events.append(self._start(block))
            self.open = kind
        self.content[-1][kind] += piece
        delta, index = {"type": _DELTAS[kind], kind: piece}, len(self.content) - 1
        return events + [{"type": "content_block_delta", "index": index, "delta": delta}]

    def _start(self, block: dict[str, Any]) -> Event:
        self.content.append(block)
        event = {"type": "content_block_start", "index": len(self.content) - 1}
        return event | {"content_block": copy.deepcopy(block)}

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        if self.open == "tool_use":  # its input: the arguments read (none where they were cut)
            block = self.content[-1]
            try:
                block["input"] = json.loads(block.pop("arguments"))
            except json.JSONDecodeError:
                block["input"] = {}
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _tool_use(self, piece: dict[str, Any]) -> list[Event]:
        """A call piece (chat_answer.py): a call's first starts a tool_use block (its id the
        chat API's: a Mistral template checks the ids it is sent back), each piece's arguments
        are an input_json_delta."""
        events: list[Event] = []
        function = piece["function"]
        if "id" in piece:
            events += self._close()
            block = {"type": "tool_use", "id": piece["id"], "name": function["name"], "input": {}}
            events.append(self._start(block))
            self.content[-1]["arguments"], self.open = "", "tool_use"
        if arguments := function["arguments"]:
            self.content[-1]["arguments"] += arguments
            delta = {"type": "input_json_delta", "partial_json": arguments}
            index = len(self.content) - 1
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        return events

    def body(
        self, reason: str | None, sequence: str | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        """The Message object."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": copy.deepcopy(self.content),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }
