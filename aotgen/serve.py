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
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from aotgen.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    RequestFields,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    usage_of,
)
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import GenerationConfig, GenerationError, GenerationResult
from aotgen.runtime.sampling import SamplingParams
from aotgen.runtime.scheduler import QueueFull


def _error(e: ApiError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": None}}
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(body, status_code=e.status, headers=headers)


class Server:
    """The routes' state: the engine, the served model's name, the speculation mode."""

    def __init__(self, engine: BatchEngine, name: str, speculative: str | None):
        self.engine, self.name, self.speculative = engine, name, speculative
        self.created = int(time.time())

    def config(
        self, req: RequestFields, prompt: list[int], max_tokens: int | None
    ) -> GenerationConfig:
        if req.n != 1:
            raise ApiError(400, f"n={req.n}: only n=1 is supported", "n")
        req.refuse_unsupported()
        if max_tokens == 0 and req.prompt_logprob_count() is None:
            raise ApiError(
                400,
                "max_tokens 0 only scores a prompt: give echo and logprobs (completions)",
                "max_tokens",
            )
        room = self.engine.engine.max_seq_len - len(prompt)
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            sampling = SamplingParams(
                temperature=req.temperature,
                top_k=max(req.top_k, 0),
                top_p=req.top_p,
                seed=req.seed,
                min_p=req.min_p,
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return GenerationConfig(
            max_new_tokens=max_tokens if max_tokens is not None else max(room, 1),
            sampling=sampling,
            stop=stop,
            speculative=self.speculative,
            grammar=req.grammar(),
            penalties=req.penalties(),
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
                    yield _sse(chunk("", finish_reason(value), value))
                    if usage:
                        yield _sse({**chunk(None, None), "choices": [], "usage": usage_of(value)})
                yield "data: [DONE]\n\n"
                return
        finally:
            self.engine.cancel(rid)  # a no-op once the request is done


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


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
            logprobs = completion_logprobs(tok, result, prompt)
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
                choice["logprobs"] = chat_logprobs(engine.tokenizer, result)
            return {**head, "choices": [choice]}

        return await _respond(server, request, req, prompt, config, chunk, chat=True)

    return app


async def _respond(
    server: Server,
    request: Request,
    req: RequestFields,
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
    body = chunk(None, finish_reason(result), result)
    choice = body["choices"][0]
    if chat:
        body["object"] = "chat.completion"
        choice.pop("delta")
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = echo + result.text
    return {**body, "usage": usage_of(result)}


def serve(
    engine: BatchEngine, name: str, host: str, port: int, speculative: str | None = None
) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, name, speculative), host=host, port=port, log_level="warning")
