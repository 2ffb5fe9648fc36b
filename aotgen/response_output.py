"""A chat answer as the Responses API's output: a reasoning item (the answer's reasoning), a
message item (its text) and function_call items (its tool calls), whole or as the stream's
events (`response.output_item.added`, `response.output_text.delta`, ...). The whole answer is
the streamed one fed at once, so both carry the same items."""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from aotgen.responses_api import ResponsesRequest
from aotgen.runtime.engine import GenerationResult
from aotgen.runtime.tokenizer import Tokenizer
from aotgen.serve_events import Event


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """One response's output items as they form, and its Response object."""

    def __init__(self, req: ResponsesRequest, settings: dict[str, Any], model: str, tok: Tokenizer):
        """`settings`: the chat request's sampling values the response reports (temperature,
        top_p), after the model's defaults."""
        self.req, self.settings, self.model, self.tok = req, settings, model, tok
        self.id, self.created_at = _id("resp"), int(time.time())
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item text or arguments stream into
        self.sequence = 0

    # ---- events ---------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[Event]:
        body = self.body("in_progress")
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def feed(self, delta: dict[str, Any]) -> list[Event]:
        """Events for a chat delta's reasoning, text and call pieces."""
        events: list[Event] = []
        if reasoning := delta.get("reasoning_content"):
            events += self._text("reasoning", reasoning)
        if content := delta.get("content"):
            events += self._text("message", content)
        for piece in delta.get("tool_calls") or []:
            events += self._call(piece)
        return events

    def finish(
        self, delta: dict[str, Any], result: GenerationResult
    ) -> tuple[list[Event], dict[str, Any]]:
        """The last delta's events, the closing event and the Response object."""
        events = self.feed(delta) + self._close()
        if not self.output:
            events += self._open("message") + self._close()  # an empty answer: an empty message
        status = "incomplete" if result.finish_reason == "length" else "completed"
        body = self.body(status, self._usage(result))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=body)], body

    def error(self, message: str) -> Event:
        """A stream's error event (the response ends with it)."""
        return self._event("error", code="server_error", message=message, param=None)

    def _text(self, kind: str, piece: str) -> list[Event]:
        events = [] if self.open is not None and self.open["type"] == kind else self._close()
        if self.open is None:
            events += self._open(kind)
        item = self.open
        assert item is not None
        item["text"] += piece
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        place = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self._event(name, **place, delta=piece, **extra)]

    def _open(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["status"] = "in_progress"
        self.open = item | {"text": ""}
        place = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        return [
            self._event("response.output_item.added", output_index=len(self.output), item=item),
            self._event("response.content_part.added", **place, part=part),
        ]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        item, self.open = self.open, None
        if item["type"] == "function_call":
            place = {"item_id": item["id"], "output_index": len(self.output)}
            kind, arguments = "response.function_call_arguments.done", item["arguments"]
            done = self._event(kind, **place, arguments=arguments)
            return [done, self._add(item | {"status": "completed"})]
        text = item.pop("text")
        place = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", **place, text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done = self._event("response.output_text.done", **place, text=text, logprobs=[])
        item |= {"content": [part], "status": "completed"}
        return [
            done,
            self._event("response.content_part.done", **place, part=part),
            self._add(item),
        ]

    def _call(self, piece: dict[str, Any]) -> list[Event]:
        """A call piece (chat_answer.py): a call's first opens its function_call item, each
        piece's arguments are a delta."""
        events: list[Event] = []
        function = piece["function"]
        if "id" in piece:
            events += self._close()
            item = {"id": _id("fc"), "type": "function_call", "call_id": piece["id"]}
            item |= {"name": function["name"], "arguments": "", "status": "in_progress"}
            self.open = item
            added = self._event("response.output_item.added", output_index=len(self.output))
            events.append(added | {"item": dict(item)})
        item = self.open
        assert item is not None and item["type"] == "function_call"
        if arguments := function["arguments"]:
            item["arguments"] += arguments
            place = {"item_id": item["id"], "output_index": len(self.output)}
            kind = "response.function_call_arguments.delta"
            events.append(self._event(kind, **place, delta=arguments))
        return events

    def _add(self, item: dict[str, Any]) -> Event:
        self.output.append(item)
        event = self._event("response.output_item.done", output_index=len(self.output) - 1)
        return event | {"item": copy.deepcopy(item)}

    # ---- the Response object --------------------------------------------------------------
    def body(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        text = req.text or {"format": {"type": "text"}}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": copy.deepcopy(self.output),
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store,
            "text": text,
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "truncation": "disabled",
            "usage": usage,
            "metadata": req.metadata or {},
            **self.settings,
        }

    def _usage(self, result: GenerationResult) -> dict[str, Any]:
        output = len(result.token_ids)
        reasoning = "".join(
            i["content"][0]["text"] for i in self.output if i["type"] == "reasoning"
        )
        return {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": output,
            # The reasoning's text encoded again: the answer's ids do not mark where it ends.
            "output_tokens_details": {"reasoning_tokens": len(self.tok.encode(reasoning))},
            "total_tokens": result.prompt_tokens + output,
        }

    def conversation_turn(self) -> dict[str, Any]:
        """The answer as the chat message a later response's conversation holds."""
        message: dict[str, Any] = {"role": "assistant", "content": None}
        for item in self.output:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] = item["content"][0]["text"]
            else:
                call = {"name": item["name"], "arguments": item["arguments"]}
                call = {"id": item["call_id"], "type": "function", "function": call}
                message.setdefault("tool_calls", []).append(call)
        if message["content"] is None and "tool_calls" not in message:
            message["content"] = ""
        return message
