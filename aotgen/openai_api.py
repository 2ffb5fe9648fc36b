"""The OpenAI API as `aotgen serve` speaks it: the request bodies it takes (checked by
pydantic; fields it cannot honour refused), and the pieces of its answers (finish reasons,
usage, logprobs in the chat and legacy completion shapes)."""

from __future__ import annotations

import codecs
import itertools
import json
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aotgen.runtime.engine import GenerationResult
from aotgen.runtime.grammar import Grammar
from aotgen.runtime.infill import FimTokens, InfillError, infill_ids
from aotgen.runtime.logprobs import MAX_TOP
from aotgen.runtime.model_sampling import model_values
from aotgen.runtime.rules import Penalties
from aotgen.runtime.sampling import SEED_MAX
from aotgen.runtime.tokenizer import CHAT_VARIABLES, Tokenizer
from aotgen.tool_calls import ToolFormat


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (sent as `extra_body`): exactly one of a JSON schema, a
    regex, a Lark or GBNF grammar, or a list of choices."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


class RequestFields(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI clients send
    many; fields we cannot honour are refused when set to anything but their default."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0: completions' echo scoring only
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # vLLM's extension; 0: off
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)  # choices, each a request of its own (seeds seed + i)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    top_k: int = Field(default=0, ge=-1)  # vLLM's extension; 0 or -1: off
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # vLLM's extension
    logit_bias: dict[int, float] | None = None  # token id -> bias, -100..100
    ignore_eos: bool = False  # vLLM's extension (its benchmarks send it): run to max_tokens
    stop_token_ids: list[int] | None = None  # vLLM's extension: end like eos
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extension: nothing ends the answer sooner
    # vLLM's extension: at most N tokens of reasoning, then its close is forced; the text
    # forced before the close (aotgen's; default: the server's --reasoning-budget-message).
    thinking_token_budget: int | None = Field(default=None, ge=0)
    reasoning_budget_message: str = ""
    # Declared so that a value other than "off" is refused, not silently ignored: best_of,
    # which OpenAI had, and a chat's suffix (completions take one: fill in the middle).
    best_of: int | None = None
    suffix: str | None = None
    # field -> the values meaning off
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"best_of": (None, 1), "suffix": (None, "")}

    def with_defaults(self, defaults: dict[str, Any]) -> Self:
        """This request with `defaults` (the model's, `sampling_defaults`) for the fields it
        does not give."""
        unset = {k: v for k, v in defaults.items() if k not in self.model_fields_set}
        return self.model_copy(update=unset) if unset else self

    def penalties(self) -> Penalties:
        try:
            return Penalties(
                repetition=self.repetition_penalty,
                presence=self.presence_penalty,
                frequency=self.frequency_penalty,
                logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def refuse_unsupported(self) -> None:
        """A sampling field aotgen does not implement, set to anything but "off"."""
        for name, off in self.UNSUPPORTED.items():
            if getattr(self, name) not in off:
                raise ApiError(
                    400, f"{name} is not supported: leave it out (or at {off[-1]!r})", name
                )

    def logprob_count(self) -> int | None:
        """None: no logprobs; N: each token's and its N likeliest alternatives'."""
        return None

    def prompt_logprob_count(self) -> int | None:
        """The same for the prompt's tokens."""
        return None

    def grammar(self) -> Grammar | None:
        """The grammar the answer must match (runtime/grammar.py), or None."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise ApiError(400, "give response_format or structured_outputs, not both")
        if fmt is not None and fmt.type == "json_object":
            return Grammar.json_object()
        if fmt is not None and fmt.type == "json_schema":
            schema = (fmt.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(
                    400,
                    "response_format.json_schema.schema: give the JSON schema as an object",
                    "response_format",
                )
            return Grammar.json_schema(schema)
        if so is None:
            return None
        given = {k: v for k, v in so.model_dump(by_alias=True).items() if v is not None}
        if len(given) != 1:
            raise ApiError(
                400,
                "structured_outputs: give exactly one of json, regex, grammar, choice",
                "structured_outputs",
            )
        ((kind, value),) = given.items()
        if kind == "json":
            return Grammar.json_schema(value)
        if kind == "choice":
            return Grammar.choice(value)
        return Grammar(kind, value)


def sampling_defaults(generation_config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The request fields a model's generation config sets where a request leaves them out
    (vLLM's `--generation-config auto`), and, left out, each value no request could send (out
    of its field's range), as `key=value (why)`."""
    defaults: dict[str, Any] = {}
    refused: list[str] = []
    for key, value in model_values(generation_config).items():
        name = "max_tokens" if key == "max_new_tokens" else key
        try:
            RequestFields.model_validate({name: value})
        except ValidationError as e:
            refused.append(f"{key}={value!r} ({e.errors()[0]['msg']})")
        else:
            defaults[name] = value
    return defaults, refused


class CompletionRequest(RequestFields):
    # One prompt (text or ids), or a batch of them (lm-eval-harness sends a list): every
    # prompt's `n` choices are numbered prompt x n + choice, as OpenAI numbers them.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)
    echo: bool = False  # the prompt before the answer, with its logprobs when asked
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {"best_of": (None, 1)}

    def infills(self, tok: Tokenizer, room: int) -> tuple[list[list[int]], tuple[int, ...]]:
        """Each text prompt as the prefix of a fill-in-the-middle prompt before `suffix`, of at
        most `room` tokens (runtime/infill.py), and the tokens that end an infill."""
        texts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if self.echo or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "suffix goes with a text prompt (or texts), without echo", "suffix")
        try:
            fim = FimTokens.of(tok)
            return [infill_ids(tok, fim, t, self.suffix, room) for t in texts], fim.ends
        except InfillError as e:
            raise ApiError(400, f"suffix: {e}", "suffix") from None

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning, sent back

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        parts = [p.get("text") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(p, str) for p in parts):
            raise ApiError(400, "only text content parts are supported", "messages")
        return "".join(parts)

    def check_content(self, where: str) -> None:
        """OpenAI's rule: system, user and tool messages carry content; an assistant's carries
        content or tool calls. Without it a template renders an empty turn the model answers."""
        if self.content is not None or (self.role == "assistant" and self.tool_calls):
            return
        needs = "content or tool_calls" if self.role == "assistant" else "content"
        raise ApiError(
            400,
            f"{where}.content is missing: a {self.role} message needs {needs}",
            f"{where}.content",
        )

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape): only the keys it
        has (Llama 3's template tests `'tool_calls' in message`), no content as "" (Qwen3's
        template searches it), each call's arguments an object rather than OpenAI's JSON
        text, as vLLM passes them. An earlier answer's reasoning goes as `reasoning_content`
        and as `thinking`, the name gpt-oss's template reads it by (in a turn that called a
        tool)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text() or ""}
        if self.tool_calls:
            message["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        keys = ("tool_call_id", "name", "reasoning_content")
        message |= {k: v for k in keys if (v := getattr(self, k)) is not None}
        if self.reasoning_content is not None:
            message["thinking"] = self.reasoning_content
        return message


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "messages: a tool call needs function.name", "messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise ApiError(
                400, "messages: a tool call's function.arguments is not JSON", "messages"
            ) from None
    return {**call, "function": {**function, "arguments": arguments}}


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: ToolFunction


class ChatRequest(RequestFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)
    tools: list[Tool] | None = None
    # "none", "auto" (the default with tools), "required", or one function by name.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false}
    # OpenAI's, which gpt-oss's template reads (as the template keyword of that name).
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's: the prompt ends inside the final assistant message, which the answer continues.
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> ChatRequest:
        """The chat request another API's request maps to (the Responses and Messages APIs):
        a field of the wrong type is a 400 naming it."""
        try:
            return cls.model_validate(fields)
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(p) for p in error["loc"])
            raise ApiError(400, f"{where}: {error['msg']}", where) from None

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any] | None:
        reserved = {*CHAT_VARIABLES, "tools"}
        if taken := sorted(reserved & set(self.chat_template_kwargs or {})):
            raise ApiError(
                400,
                f"chat_template_kwargs: {', '.join(taken)} are set by the request itself",
                "chat_template_kwargs",
            )
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort} | (self.chat_template_kwargs or {})

    def prompt_ids(self, tok: Tokenizer) -> list[int]:
        """The chat rendered by the package's template (with the tools), as ids."""
        if not self.messages:
            raise ApiError(400, "messages is empty: give at least one message", "messages")
        for i, m in enumerate(self.messages):
            m.check_content(f"messages.{i}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                400,
                "continue_final_message: set add_generation_prompt to false as well",
                "continue_final_message",
            )
        try:
            return tok.encode_chat(
                [m.for_template() for m in self.messages],
                add_generation_prompt=self.add_generation_prompt,
                tools=self.tool_dicts() or None,
                template_kwargs=self.template_kwargs(),
                continue_final=self.continue_final_message,
            )
        except ValueError as e:  # jinja2's TemplateError is one
            raise ApiError(400, f"messages: {e}", "messages") from None

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_calls(
        self, fmt: ToolFormat | None, specials: dict[str, int] | None = None
    ) -> tuple[ToolFormat | None, Grammar | None]:
        """The format to read calls back in (None: no calls expected) and the grammar of the
        answer's calls: one that forces a call (tool_choice "required" or a named function),
        or, for "auto" without a response format, one that leaves text free and makes a call
        the model opens well formed (`auto_grammar`; none for harmony). `specials`: the
        vocabulary's special tokens (Tokenizer.special_tokens), which a marker may be."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice != "none" and not self.tools:
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        if self.tools and fmt is None:
            raise ApiError(
                400, "this model's chat template does not take tools: leave tools out", "tools"
            )
        if choice == "none":
            return None, None
        assert fmt is not None
        tools = self.tool_dicts()
        parallel = self.parallel_tool_calls
        if choice == "auto":
            if self.grammar() is not None:  # a response format wins
                return fmt, None
            return fmt, fmt.auto_grammar(tools, parallel, specials)
        if isinstance(choice, dict):
            wanted = (choice.get("function") or {}).get("name")
            tools = [t for t in tools if t["function"]["name"] == wanted]
            if choice.get("type") != "function" or not tools:
                raise ApiError(
                    400,
                    'tool_choice: give {"type": "function", "function": {"name": '
                    "NAME}} with NAME one of tools",
                    "tool_choice",
                )
            parallel = False
        if self.grammar() is not None:
            raise ApiError(400, "a forced tool call takes no response_format", "tool_choice")
        return fmt, fmt.grammar(tools, parallel, specials)


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a prompt (as `/v1/completions` reads it) or a chat (as
    `/v1/chat/completions` renders it)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # a prompt: led by bos where the checkpoint asks
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def ids(self, tok: Tokenizer) -> list[int]:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give prompt or messages")
        if self.prompt is not None:
            return (
                tok.prompt_ids(self.prompt) if self.add_special_tokens else tok.encode(self.prompt)
            )
        fields = ("messages", "tools", "chat_template_kwargs", "add_generation_prompt")
        fields += ("continue_final_message",)
        return ChatRequest(**{k: getattr(self, k) for k in fields}).prompt_ids(tok)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def completion_logprobs(
    tok: Tokenizer, result: GenerationResult | None, prompt: list[int]
) -> dict | None:
    """The legacy completions' `logprobs`: token strings, their logprobs, the top
    alternatives as {token: logprob}, and each token's offset in the text; with echo, the
    prompt's tokens first (the first has none)."""
    if result is None or result.logprobs is None:
        return None
    scored = [*(result.prompt_logprobs or []), *result.logprobs]
    ids = [*(prompt if result.prompt_logprobs else []), *result.token_ids]
    raw = [tok.token_bytes(t) for t in ids]
    # Characters before each token; one that starts inside a character is at that character.
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets = list(itertools.accumulate((len(utf8.decode(r)) for r in raw[:-1]), initial=0))
    return {
        "tokens": [token_text(r) for r in raw],
        "token_logprobs": [None if lp is None else lp.logprob for lp in scored],
        "top_logprobs": [
            None if lp is None else {token_text(tok.token_bytes(i)): v for i, v in lp.top}
            for lp in scored
        ],
        "text_offset": offsets,
    }


def token_text(raw: bytes) -> str:
    """A token's text; a piece of a character as OpenAI writes it: `bytes:\\xe2\\x80`."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(tok: Tokenizer, result: GenerationResult) -> dict:
    """Chat's `logprobs.content`: per token its text, logprob, UTF-8 bytes and alternatives."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        raw = tok.token_bytes(token)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

    content = [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for lp in result.logprobs or []
    ]
    return {"content": content}


def usage_of(results: list[GenerationResult], n: int = 1) -> dict[str, Any]:
    """A request's usage over its choices (`n` a prompt): each prompt once, every choice's
    tokens."""
    firsts = results[::n]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # OpenAI's field: prompt tokens found in the KV cache (runtime/cached_tokens.py), by
        # each prompt's first choice (the others find the prompt it ran).
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
    }
