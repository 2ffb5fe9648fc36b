"""Anthropic's Messages API (`POST /v1/messages`) as a chat request: content blocks become
chat messages (text, `tool_use` calls, `tool_result` answers, `thinking` as the reasoning of
the turn it leads), custom tools and `tool_choice` become the chat API's, `thinking` the
template's `enable_thinking` (its `budget_tokens` the reasoning budget), and a final
assistant message is continued. The answer's content blocks are aotgen/message_output.py's."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from aotgen.openai_api import ApiError, ChatRequest

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesRequest(BaseModel):
    """The Messages API's request. Fields it does not declare go to the chat request as they
    are: the chat API's extensions (seed, min_p, repetition_penalty, chat_template_kwargs,
    stop_token_ids, ...) are taken, the rest (metadata, service_tier, cache_control, ...)
    ignored, as the chat API ignores unknown fields."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # {"format": {"type": "json_schema", "schema": ...}, "effort": ...}
    output_config: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The system prompt and the messages as chat messages (the chat API's shape); turns
        of one role in a row are one turn, as Anthropic combines them."""
        if not self.messages:
            raise ApiError(400, "messages is empty: give at least one message", "messages")
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            role = message.get("role")
            if role not in ("user", "assistant"):
                raise ApiError(
                    400, f"messages.{i}.role {role!r}: give user or assistant", f"messages.{i}.role"
                )
            content = message.get("content")
            if content is None:
                raise ApiError(400, f"messages.{i}.content is missing", f"messages.{i}.content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            turns = _user_turns(blocks, i) if role == "user" else [_assistant_turn(blocks, i)]
            for turn in turns:
                _append(messages, turn)
        return messages

    def chat_request(self) -> ChatRequest:
        """The chat request that answers this one."""
        extra = dict(self.model_extra or {})
        for name in ("n", "input", "max_completion_tokens"):
            if extra.get(name) is not None:
                raise ApiError(400, f"{name}: not a Messages API field", name)
        messages = self.chat_messages()
        fields = extra | {"messages": messages, "model": self.model}
        if messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
            # A final assistant message is the answer's start (Anthropic's prefill): the
            # answer continues it, as vLLM's continue_final_message.
            fields |= {"continue_final_message": True, "add_generation_prompt": False}
        fields |= {"stream": self.stream, "max_tokens": self.max_tokens}
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        fields |= {k: v for k, v in sampling.items() if v is not None}
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        if self.tools:
            fields["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"], parallel = _chat_tool_choice(self.tool_choice)
            fields["parallel_tool_calls"] = parallel
        fields |= self._output_config()
        if (thinking := self._thinking()) is not None:
            kwargs = {"enable_thinking": thinking} | (extra.get("chat_template_kwargs") or {})
            fields["chat_template_kwargs"] = kwargs
        if thinking and (budget := (self.thinking or {}).get("budget_tokens")) is not None:
            fields["thinking_token_budget"] = budget
        return ChatRequest.from_fields(fields)

    def _output_config(self) -> dict[str, Any]:
        """`output_config` as chat fields: a JSON schema format as `response_format`, the
        effort as `reasoning_effort` (low, medium, high: the levels a template reads; xhigh
        and max as high)."""
        config, fields = self.output_config or {}, {}
        if (fmt := config.get("format")) is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
                raise ApiError(
                    400, "output_config.format: give {type: json_schema, schema}", "output_config"
                )
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"schema": fmt.get("schema")},
            }
        if (effort := config.get("effort")) is not None:
            fields["reasoning_effort"] = "high" if effort in ("xhigh", "max") else effort
        return fields

    def _thinking(self) -> bool | None:
        """`thinking` as the template's enable_thinking; None: the template's default."""
        if self.thinking is None:
            return None
        kind = self.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise ApiError(400, "thinking.type: give enabled, adaptive or disabled", "thinking")
        return kind != "disabled"


def _append(messages: list[dict[str, Any]], turn: dict[str, Any]) -> None:
    """Add a turn; a text turn after one of its own role joins it."""
    last = messages[-1] if messages else None
    if (
        last is not None
        and last["role"] == turn["role"] in ("user", "assistant")
        and set(last) == set(turn) == {"role", "content"}
    ):
        last["content"] = f"{last['content']}\n\n{turn['content']}"
    else:
        messages.append(turn)


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in content
    ):
        raise ApiError(400, f"{where}: give text or text blocks", where)
    return "".join(b["text"] for b in content)


def _blocks(blocks: Any, i: int, served: tuple[str, ...]) -> list[tuple[int, dict[str, Any]]]:
    where = f"messages.{i}.content"
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise ApiError(400, f"{where}: give text or a list of content blocks", where)
    for j, block in enumerate(blocks):
        if block.get("type") not in served:
            raise ApiError(
                400,
                f"{where}.{j}: blocks of type {block.get('type')!r} are not served here "
                f"({', '.join(served)})",
                f"{where}.{j}.type",
            )
    return list(enumerate(blocks))


def _user_turns(blocks: Any, i: int) -> list[dict[str, Any]]:
    """A user message: its tool results as tool messages, then its text as a user one."""
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in _blocks(blocks, i, ("text", "tool_result")):
        where = f"messages.{i}.content.{j}"
        if block["type"] == "text":
            texts.append(_text([block], where))
            continue
        if not isinstance(block.get("tool_use_id"), str):
            raise ApiError(400, f"{where}.tool_use_id is missing", f"{where}.tool_use_id")
        result = _text(block.get("content") or "", f"{where}.content")
        turns.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
    if texts or not turns:
        turns.append({"role": "user", "content": "".join(texts)})
    return turns


def _assistant_turn(blocks: Any, i: int) -> dict[str, Any]:
    """An assistant message: its text, its thinking as reasoning, its tool_use blocks as
    calls. Redacted thinking is opaque: it is left out."""
    served = ("text", "thinking", "redacted_thinking", "tool_use")
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, block in _blocks(blocks, i, served):
        where = f"messages.{i}.content.{j}"
        if block["type"] == "text":
            turn["content"] += _text([block], where)
        elif block["type"] == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise ApiError(400, f"{where}.thinking is missing", f"{where}.thinking")
            turn["reasoning_content"] = turn.get("reasoning_content", "") + block["thinking"]
        elif block["type"] == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise ApiError(400, f"{where}: a tool_use block needs a name and an input", where)
            function = {"name": name, "arguments": json.dumps(arguments)}
            call = {"id": block.get("id"), "type": "function", "function": function}
            turn.setdefault("tool_calls", []).append(call)
    if "tool_calls" in turn and not turn["content"]:
        turn["content"] = None
    return turn


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A custom tool as a chat function; Anthropic's server and client tools (web search,
    bash, the text editor, ...) are refused."""
    if tool.get("type", "custom") != "custom":
        raise ApiError(
            400,
            f"tools.{i}: only custom tools (name, input_schema) are served, not "
            f"{tool.get('type')!r}",
            f"tools.{i}.type",
        )
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise ApiError(400, f"tools.{i}: give a name and an input_schema object", f"tools.{i}")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool]:
    """Anthropic's tool_choice as the chat API's, and whether calls may come in parallel."""
    kind, parallel = choice.get("type"), not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, False
    raise ApiError(
        400,
        "tool_choice: give {type: auto}, {type: any}, {type: none} or {type: tool, name: NAME}",
        "tool_choice",
    )
