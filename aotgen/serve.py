"""`aotgen serve artifacts/NAME`: an OpenAI-compatible HTTP server over the batch engine.

FastAPI + uvicorn (`pip install 'aotgen[serve]'`). Endpoints: `POST /v1/chat/completions`,
`POST /v1/completions` (streamed as server-sent events ending in `data: [DONE]`, or whole),
`GET /v1/models`, `GET /health`. Structured output: OpenAI's `response_format` (`json_object`,
`json_schema`) or vLLM's `structured_outputs` (`json`, `regex`, `grammar`, `choice`). The
engine steps in its own thread; each request is handed its text through an asyncio queue. A
client that goes away has its request cancelled, so its slot frees at the next step. Errors
are OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status; a
full queue is 429 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import codecs
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import GenerationConfig, GenerationError, GenerationResult
from aotgen.runtime.grammar import Grammar
from aotgen.runtime.logprobs import MAX_TOP
from aotgen.runtime.sampling import SEED_MAX, SamplingParams
from aotgen.runtime.scheduler import QueueFull
from aotgen.runtime.tokenizer import Tokenizer


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def _error(e: ApiError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": None}}
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(body, status_code=e.status, headers=headers)


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


class _Sampling(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI clients send
    many; fields we cannot honour are refused when set to anything but their default."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0: completions' echo scoring only
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

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


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)
    echo: bool = False  # the prompt before the answer, with its logprobs when asked

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = [p.get("text") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(p, str) for p in parts):
            raise ApiError(400, "only text content parts are supported", "messages")
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class Server:
    """The routes' state: the engine, the served model's name, the speculation mode."""

    def __init__(self, engine: BatchEngine, name: str, speculative: str | None):
        self.engine, self.name, self.speculative = engine, name, speculative
        self.created = int(time.time())

    def config(self, req: _Sampling, prompt: list[int], max_tokens: int | None) -> GenerationConfig:
        if req.n != 1:
            raise ApiError(400, f"n={req.n}: only n=1 is supported", "n")
        if max_tokens == 0 and req.prompt_logprob_count() is None:
            raise ApiError(
                400,
                "max_tokens 0 only scores a prompt: give echo and logprobs (completions)",
                "max_tokens",
            )
        room = self.engine.engine.max_seq_len - len(prompt)
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=req.seed)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return GenerationConfig(
            max_new_tokens=max_tokens if max_tokens is not None else max(room, 1),
            sampling=sampling,
            stop=stop,
            speculative=self.speculative,
            grammar=req.grammar(),
            logprobs=req.logprob_count(),
            prompt_logprobs=req.prompt_logprob_count(),
        )

    def submit(self, prompt: list[int], config: GenerationConfig) -> tuple[int, asyncio.Queue]:
        """Queue the request; its text pieces and its result arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item: tuple[str, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        try:
            rid = self.engine.submit(
                prompt, config, lambda t: put(("text", t)), lambda r: put(("done", r))
            )
        except GenerationError as e:
            raise ApiError(400, str(e)) from None
        except QueueFull as e:
            raise ApiError(429, str(e), kind="rate_limit_error") from None
        return rid, queue

    async def collect(self, request: Request, rid: int, queue: asyncio.Queue) -> GenerationResult:
        """Wait for the whole result, cancelling the request if the client goes away."""
        while True:
            try:
                kind, value = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    self.engine.cancel(rid)
                    raise ApiError(400, "the client disconnected") from None
                continue
            if kind == "done":
                return value

    async def stream(
        self, rid: int, queue: asyncio.Queue, chunk: Any, usage: bool, opening: dict | None
    ) -> AsyncIterator[str]:
        """SSE events; on disconnect Starlette cancels this generator and the request goes."""
        try:
            if opening is not None:
                yield _sse(opening)
            while True:
                kind, value = await queue.get()
                if kind == "text":
                    yield _sse(chunk(value, None))
                    continue
                if value.finish_reason == "error":
                    yield _sse({"error": {"message": value.error, "type": "server_error"}})
                else:
                    yield _sse(chunk("", _finish(value), value))
                    if usage:
                        yield _sse({**chunk(None, None), "choices": [], "usage": _usage(value)})
                yield "data: [DONE]\n\n"
                return
        finally:
            self.engine.cancel(rid)  # a no-op once the request is done


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _finish(result: GenerationResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _completion_logprobs(
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
        "tokens": [_token_text(r) for r in raw],
        "token_logprobs": [None if lp is None else lp.logprob for lp in scored],
        "top_logprobs": [
            None if lp is None else {_token_text(tok.token_bytes(i)): v for i, v in lp.top}
            for lp in scored
        ],
        "text_offset": offsets,
    }


def _token_text(raw: bytes) -> str:
    """A token's text; a piece of a character as OpenAI writes it: `bytes:\\xe2\\x80`."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _chat_logprobs(tok: Tokenizer, result: GenerationResult) -> dict:
    """Chat's `logprobs.content`: per token its text, logprob, UTF-8 bytes and alternatives."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        raw = tok.token_bytes(token)
        return {"token": _token_text(raw), "logprob": logprob, "bytes": list(raw)}

    content = [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for lp in result.logprobs or []
    ]
    return {"content": content}


def _usage(result: GenerationResult) -> dict[str, Any]:
    n = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": result.prompt_tokens + n,
        # OpenAI's field: prompt tokens found in the KV cache (runtime/cached_tokens.py).
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def create_app(engine: BatchEngine, name: str, speculative: str | None = None) -> FastAPI:
    server = Server(engine, name, speculative)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.close()

    app = FastAPI(title="aotgen", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(ApiError(400, f"the request body is not valid JSON ({first.get('msg')})"))
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(
            ApiError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where)
        )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = engine.scheduler
        return {
            "status": "ok",
            "slots": engine.slots,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "finished": dict(engine.finished),  # finish reason -> requests
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": server.created, "owned_by": "aotgen"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        tok = engine.tokenizer
        prompt = req.prompt if isinstance(req.prompt, list) else tok.prompt_ids(req.prompt)
        config = server.config(req, prompt, 16 if req.max_tokens is None else req.max_tokens)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
        head |= {"created": int(time.time()), "model": name}

        def chunk(
            text: str | None, finish: str | None, result: GenerationResult | None = None
        ) -> dict[str, Any]:
            logprobs = _completion_logprobs(tok, result, prompt)
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            return {**head, "choices": [choice]}

        echo = tok.decode(prompt) if req.echo else ""
        return await _respond(server, request, req, prompt, config, chunk, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        if not req.messages:
            raise ApiError(400, "messages is empty: give at least one message", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = engine.tokenizer.encode_chat(messages)
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", "messages") from None
        config = server.config(req, prompt, req.max_completion_tokens or req.max_tokens)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk"}
        head |= {"created": int(time.time()), "model": name}

        def chunk(
            text: str | None, finish: str | None, result: GenerationResult | None = None
        ) -> dict[str, Any]:
            delta = {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            if result is not None and result.logprobs is not None:
                choice["logprobs"] = _chat_logprobs(engine.tokenizer, result)
            return {**head, "choices": [choice]}

        return await _respond(server, request, req, prompt, config, chunk, chat=True)

    return app


async def _respond(
    server: Server,
    request: Request,
    req: _Sampling,
    prompt: list[int],
    config: GenerationConfig,
    chunk: Any,
    chat: bool,
    echo: str = "",
) -> Any:
    """Submit the request; stream its chunks or answer whole. `echo`: text before the answer
    (completions' echo of the prompt)."""
    rid, queue = server.submit(prompt, config)
    if req.stream:
        usage = bool((req.stream_options or {}).get("include_usage"))
        opening = chunk(echo, None) if echo else None
        if chat:  # the first chat chunk names the role, as OpenAI's do
            opening = chunk(None, None)
            opening["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        events = server.stream(rid, queue, chunk, usage, opening)
        return StreamingResponse(events, media_type="text/event-stream")
    result = await server.collect(request, rid, queue)
    if result.finish_reason == "error":
        raise ApiError(500, f"generation failed: {result.error}")
    body = chunk(None, _finish(result), result)
    choice = body["choices"][0]
    if chat:
        body["object"] = "chat.completion"
        choice.pop("delta")
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = echo + result.text
    return {**body, "usage": _usage(result)}


def serve(
    engine: BatchEngine, name: str, host: str, port: int, speculative: str | None = None
) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, name, speculative), host=host, port=port, log_level="warning")
