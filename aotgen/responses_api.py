"""OpenAI's Responses API (`POST /v1/responses`) as a chat request: input items become chat
messages, function tools and the text format become the chat API's, and a stored response's
conversation (`previous_response_id`) comes before the new input. The answer's output items
are aotgen/response_output.py's."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from aotgen.openai_api import ApiError, ChatRequest

# Responses kept for `previous_response_id` and GET /v1/responses/ID, newest last; the oldest
# go first (OpenAI keeps them 30 days; a server in memory keeps the last few hundred).
STORED_RESPONSES = 512


class ResponsesRequest(BaseModel):
    """The Responses API's request. Fields it does not declare (temperature, top_p and the
    chat API's extensions: top_k, min_p, seed, repetition_penalty, chat_template_kwargs, ...)
    go to the chat request as they are."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items, each with an id (`GET /v1/responses/ID/input_items`): text as
        a user message of one input_text part."""
        if isinstance(self.input, str):
            part = {"type": "input_text", "text": self.input}
            items = [{"type": "message", "role": "user", "content": [part]}]
        else:
            items = [{"type": "message"} | item for item in self.input]
        prefixes = {"message": "msg", "function_call": "fc", "reasoning": "rs"}
        for item in items:
            if "id" not in item:
                prefix = prefixes.get(item["type"], item["type"])
                item["id"] = f"{prefix}_{uuid.uuid4().hex}"
            if item["type"] == "message" and isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
        return items

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (the chat API's shape)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise ApiError(400, "input is empty: give text or at least one item", "input")
        messages: list[dict[str, Any]] = []
        reasoning: str | None = None  # a reasoning item's text, for the answer after it
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "reasoning":
                reasoning = _part_text(item.get("content") or [], f"input.{i}.content")
            elif kind == "message":
                messages.append(_message(item, i))
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function"}
                call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                output = item.get("output")
                if not isinstance(output, str):
                    output = _part_text(output or [], f"input.{i}.output")
                messages.append(
                    {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
                )
            else:
                raise ApiError(
                    400,
                    f"input.{i}: items of type {kind!r} are not served (message, function_call, "
                    "function_call_output, reasoning)",
                    f"input.{i}.type",
                )
            if kind != "reasoning" and reasoning is not None:  # the answer it reasoned for
                if messages[-1]["role"] == "assistant":
                    messages[-1]["reasoning_content"] = reasoning
                reasoning = None
        return messages

    def chat_request(self, history: list[dict[str, Any]]) -> tuple[ChatRequest, list[dict]]:
        """The chat request that answers this one after `history` (a stored response's
        conversation), and the conversation a later response continues (input included,
        instructions not: OpenAI does not carry them over)."""
        self._refuse_unsupported()
        conversation = history + self.input_messages()
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields = dict(self.model_extra or {}) | {"messages": system + conversation}
        fields |= {"model": self.model, "stream": self.stream}
        fields["parallel_tool_calls"] = self.parallel_tool_calls
        if self.max_output_tokens is not None:
            fields["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            fields["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if (fmt := (self.text or {}).get("format")) is not None:
            fields["response_format"] = _response_format(fmt)
        if effort := (self.reasoning or {}).get("effort"):
            fields["reasoning_effort"] = effort
        return ChatRequest.from_fields(fields), conversation

    def _refuse_unsupported(self) -> None:
        if self.background:
            raise ApiError(400, "background: responses run while the request waits", "background")
        extra = self.model_extra or {}
        asked = "message.output_text.logprobs" in (extra.get("include") or [])
        if asked or extra.get("top_logprobs") is not None:
            raise ApiError(
                400,
                "logprobs are not served by the Responses API here: ask /v1/chat/completions "
                "with logprobs and top_logprobs",
                "top_logprobs" if not asked else "include",
            )
        for name in ("messages", "conversation", "n"):
            if extra.get(name) is not None:
                raise ApiError(
                    400, f"{name}: not a Responses API field (send the conversation as input)", name
                )


def _part_text(parts: list[Any] | Any, where: str) -> str:
    """Text content parts (input_text, output_text, reasoning_text, text) joined."""
    if isinstance(parts, str):
        return parts
    texts = [p.get("text") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []
    kinds = {"input_text", "output_text", "reasoning_text", "summary_text", "text"}
    if (
        not isinstance(parts, list)
        or len(texts) != len(parts)
        or not all(
            isinstance(t, str) and p.get("type") in kinds for t, p in zip(texts, parts, strict=True)
        )
    ):
        raise ApiError(400, f"{where}: only text content parts are served", where)
    return "".join(texts)


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ApiError(
            400,
            f"input.{i}.role {role!r}: give user, system, developer or assistant",
            f"input.{i}.role",
        )
    content = item.get("content")
    if content is None:
        raise ApiError(400, f"input.{i}.content is missing", f"input.{i}.content")
    text = _part_text(content, f"input.{i}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ApiError(
            400,
            f"tools.{i}: only function tools are served, not {tool.get('type')!r}",
            f"tools.{i}.type",
        )
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if k in tool}}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(
            400,
            "tool_choice: give none, auto, required or {type: function, name: NAME}",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    keys = ("name", "schema", "strict", "description")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object
    conversation: list[dict[str, Any]]  # its input and answer as chat messages, history first
    input_items: list[dict[str, Any]]  # its own input, as items with ids


class ResponseStore:
    """Finished responses by id, the last STORED_RESPONSES of them."""

    def __init__(self, size: int = STORED_RESPONSES):
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.body["id"]] = stored
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.get(response_id, "response_id")
        del self._items[response_id]

    def get(self, response_id: str, param: str) -> StoredResponse:
        if response_id not in self._items:
            raise ApiError(
                404,
                f"response {response_id!r} is not stored here (this server keeps the last "
                f"{self.size} stored responses in memory): send the conversation as input",
                param,
            )
        return self._items[response_id]
