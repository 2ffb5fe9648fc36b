"""`aotgen serve artifacts/NAME`: an OpenAI-compatible HTTP server over the batch engine.

FastAPI + uvicorn (`pip install 'aotgen[serve]'`). Endpoints: `POST /v1/chat/completions`,
`POST /v1/responses` (aotgen/serve_responses.py), Anthropic's `POST /v1/messages`
(aotgen/serve_messages.py), `POST /v1/completions` (streamed as
server-sent events ending in `data: [DONE]`, or whole), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus), vLLM's `POST /tokenize` and `POST /detokenize`
(aotgen/serve_info.py). Structured
output: OpenAI's `response_format` (`json_object`, `json_schema`) or vLLM's
`structured_outputs` (`json`, `regex`, `grammar`, `choice`). Tool
calls: `tools`, `tool_choice`, in the format the chat template teaches (aotgen/tool_calls.py),
streamed as they form (aotgen/tool_call_stream.py); reasoning apart
(aotgen/runtime/reasoning.py). The engine steps in its own thread; each request is handed its
text through an asyncio queue. A client that goes away has its request cancelled,
so its slot frees at the next step. Errors are OpenAI-shaped: `{"error": {"message", "type",
"param", "code"}}` with a 4xx/5xx status; a full queue is 429 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse

from aotgen.chat_answer import ChatAnswers
from aotgen.messages_api import error_body
from aotgen.metrics import ServeMetrics
from aotgen.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    RequestFields,
    completion_logprobs,
    finish_reason,
    usage_of,
)
from aotgen.responses_api import ResponseStore
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import GenerationConfig, GenerationError, GenerationResult
from aotgen.runtime.harmony import final_answer, head_of
from aotgen.runtime.lookup_cache import SAVE_EVERY_S, PeriodicSave
from aotgen.runtime.reasoning import thinking_of
from aotgen.runtime.sampling import SEED_MAX, SamplingParams
from aotgen.runtime.scheduler import QueueFull
from aotgen.serve_info import info_routes
from aotgen.serve_messages import messages_routes
from aotgen.serve_responses import responses_routes
from aotgen.tool_calls import tool_format


def _error(e: ApiError, path: str = "") -> JSONResponse:
    """OpenAI's error shape; Anthropic's on the Messages API's routes."""
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}
    if path.startswith("/v1/messages"):
        body = error_body(e.status, e.message)
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(body, status_code=e.status, headers=headers)


class Server:
    """The routes' state: the engine, the served model's names, the speculation mode, the
    model's sampling defaults."""

    def __init__(
        self,
        engine: BatchEngine,
        names: tuple[str, ...],
        speculative: str | None,
        defaults: dict[str, Any],
    ):
        self.engine, self.names, self.speculative = engine, names, speculative
        self.defaults = defaults  # request fields a request leaves out (sampling_defaults)
        self.created = int(time.time())
        self.metrics = ServeMetrics(engine)
        self.responses = ResponseStore()  # the Responses API's stored responses

    def model(self, requested: str | None) -> str:
        """The name an answer carries: the request's, which must be one this server serves
        (as vLLM checks it: a client pointed at the wrong server hears so), or the first."""
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            served = ", ".join(repr(n) for n in self.names)
            raise ApiError(
                404,
                f"model {requested!r} is not served here: send {served} (GET /v1/models), or "
                "start the server with --served-model-name",
                "model",
                code="model_not_found",
            )
        return requested

    def config(
        self, req: RequestFields, prompt: list[int], max_tokens: int | None
    ) -> GenerationConfig:
        if req.n > self.engine.slots:
            raise ApiError(400, f"n={req.n}: at most {self.engine.slots} (the slots)", "n")
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
            ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            min_tokens=req.min_tokens,
            speculative=self.speculative,
            grammar=req.grammar(),
            penalties=req.penalties(),
            logprobs=req.logprob_count(),
            prompt_logprobs=req.prompt_logprob_count(),
            reasoning_budget=req.thinking_token_budget,
            reasoning_budget_message=req.reasoning_budget_message,
        )

    def chat(
        self, req: ChatRequest
    ) -> tuple[ChatRequest, list[int], GenerationConfig, ChatAnswers]:
        """A chat request with the model's defaults, its prompt, its config (the tool calls'
        grammar, forced or "auto", or a response format's, on the answer, not the reasoning)
        and the answers' shape."""
        tok = self.engine.tokenizer
        name, req = self.model(req.model), req.with_defaults(self.defaults)
        fmt, calls = req.tool_calls(
            tool_format(tok.chat_template, req.tool_dicts()), tok.special_tokens
        )
        prompt = req.prompt_ids(tok)
        config = self.config(req, prompt, req.max_completion_tokens or req.max_tokens)
        if calls is not None:
            config = replace(config, grammar=calls)
        thinking, head = thinking_of(tok, prompt), head_of(tok, prompt)
        if config.grammar is not None:  # the answer's, not the reasoning's
            if head is not None:  # a forced harmony call reasons first already
                config = replace(config, grammar=calls or final_answer(config.grammar))
            elif thinking is not None:
                config = replace(config, grammar=config.grammar.after_reasoning(opened=thinking))
        return req, prompt, config, ChatAnswers(tok, name, req.n, thinking, fmt, head)

    def submit(
        self, prompts: list[list[int]], config: GenerationConfig, n: int
    ) -> tuple[list[int], asyncio.Queue]:
        """Queue each prompt's `n` choices, one engine request each (choice j seeded with
        seed + j, as vLLM does), numbered prompt x n + j; (choice, text piece or result)
        arrive on the returned queue. A prompt's later choices find it in the first one's
        cache row (prefix sharing)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item: tuple[int, str, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def done(index: int, result: GenerationResult) -> None:
            self.metrics.observe(result)
            put((index, "done", result))

        rids: list[int] = []
        base = config.sampling.seed
        try:
            for i in range(len(prompts) * n):
                seed = None if base is None else (base + i % n) % (SEED_MAX + 1)
                sampling = replace(config.sampling, seed=seed)
                rids.append(
                    self.engine.submit(
                        prompts[i // n],
                        replace(config, sampling=sampling),
                        lambda t, i=i: put((i, "text", t)),
                        lambda r, i=i: done(i, r),
                    )
                )
        except (GenerationError, QueueFull) as e:
            for rid in rids:
                self.engine.cancel(rid)
            if isinstance(e, QueueFull):
                raise ApiError(429, str(e), kind="rate_limit_error") from None
            raise ApiError(400, str(e)) from None
        return rids, queue

    async def collect(
        self, request: Request, rids: list[int], queue: asyncio.Queue
    ) -> list[GenerationResult]:
        """Wait for every choice's result, cancelling them if the client goes away."""
        results: dict[int, GenerationResult] = {}
        while len(results) < len(rids):
            try:
                index, kind, value = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    for rid in rids:
                        self.engine.cancel(rid)
                    raise ApiError(400, "the client disconnected") from None
                continue
            if kind == "done":
                results[index] = value
        return [results[i] for i in range(len(rids))]

    async def stream(
        self,
        rids: list[int],
        queue: asyncio.Queue,
        chunk: Any,
        usage: bool,
        openings: list[dict],
        n: int,
    ) -> AsyncIterator[str]:
        """SSE events, each choice's under its index; on disconnect Starlette cancels this
        generator and the requests go."""
        results: dict[int, GenerationResult] = {}
        try:
            for opening in openings:
                yield _sse(opening)
            while len(results) < len(rids):
                index, kind, value = await queue.get()
                if kind == "text":
                    if (piece := chunk(index, value, None)) is not None:
                        yield _sse(piece)
                    continue
                results[index] = value
                if value.finish_reason == "error":
                    yield _sse({"error": {"message": value.error, "type": "server_error"}})
                    break
                yield _sse(chunk(index, "", finish_reason(value), value))
            else:
                if usage:
                    done = [results[i] for i in range(len(rids))]
                    body = chunk(0, None, None) | {"choices": [], "usage": usage_of(done, n)}
                    yield _sse(body)
            yield "data: [DONE]\n\n"
        finally:
            for rid in rids:
                self.engine.cancel(rid)  # a no-op once the request is done


def _prompts(prompt: str | list, tok: Any) -> list[list[int]]:
    """A completions request's prompts as ids: one text or id list, or a batch of them."""
    if isinstance(prompt, str):
        return [tok.prompt_ids(prompt)]
    if not prompt:
        raise ApiError(400, "prompt is empty: give text, token ids or a list of them", "prompt")
    if all(isinstance(x, int) for x in prompt):
        return [prompt]
    return [tok.prompt_ids(x) if isinstance(x, str) else x for x in prompt]


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(
    engine: BatchEngine,
    names: tuple[str, ...],
    speculative: str | None = None,
    defaults: dict[str, Any] | None = None,
    api_key: str | None = None,
    lookup_cache: Path | None = None,
    lookup_cache_every_s: float = SAVE_EVERY_S,
    allowed_origins: tuple[str, ...] = (),
) -> FastAPI:
    """The HTTP app; with `lookup_cache`, the engine's lookup cache is written there every
    `lookup_cache_every_s` seconds while it changes and when the app stops (uvicorn re-raises
    SIGTERM / SIGINT after shutdown, so not after `run`); `allowed_origins`: the web origins
    whose pages may call it from a browser (CORS)."""
    server = Server(engine, names, speculative, defaults or {})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        saver = None
        if lookup_cache is not None and engine.engine.lookup_cache is not None:
            saver = PeriodicSave(engine.engine.lookup_cache, lookup_cache, lookup_cache_every_s)
            saver.start()
        yield
        engine.close()
        if saver is not None:
            saver.close()

    app = FastAPI(title="aotgen", lifespan=lifespan)
    _add_error_handlers(app)
    if api_key:
        _require_api_key(app, api_key)
    if allowed_origins:  # added last, so outermost: a preflight carries no key to check
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
        )
    app.include_router(info_routes(server))
    app.include_router(_generation_routes(server))
    app.include_router(responses_routes(server))
    app.include_router(messages_routes(server))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Invalid bodies and refused requests answer OpenAI-shaped errors, not FastAPI's."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first, path = exc.errors()[0] if exc.errors() else {}, request.url.path
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON ({first.get('msg')})"
            return _error(ApiError(400, message), path)
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        return _error(ApiError(400, message, where), path)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc, request.url.path)


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """Every endpoint but /health and /metrics wants the key: as a bearer token, as OpenAI's
    and vLLM's do, or in `x-api-key`, as Anthropic's clients send it."""

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        path, headers = request.url.path, request.headers
        bearer = hmac.compare_digest(
            headers.get("authorization", "").encode(), f"Bearer {api_key}".encode()
        )
        x_api_key = hmac.compare_digest(headers.get("x-api-key", "").encode(), api_key.encode())
        if path in ("/health", "/metrics") or bearer or x_api_key:
            return await call_next(request)
        message = "missing or wrong API key: send Authorization: Bearer KEY (or x-api-key: KEY)"
        return _error(ApiError(401, message, kind="authentication_error"), path)


def _generation_routes(server: Server) -> APIRouter:
    """/v1/completions and /v1/chat/completions."""
    router, tok = APIRouter(), server.engine.tokenizer

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        name, req = server.model(req.model), req.with_defaults(server.defaults)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if req.suffix:
            prompts, ends = req.infills(tok, server.engine.engine.max_seq_len - max_tokens)
        else:
            prompts, ends = _prompts(req.prompt, tok), ()
        longest = max(prompts, key=len)
        config = server.config(req, longest, max_tokens)
        if ends:  # an infill ends at the FIM pad, repo and file-separator tokens too
            config = replace(config, stop_token_ids=(*config.stop_token_ids, *ends))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
        head |= {"created": int(time.time()), "model": name}

        def chunk(
            index: int, text: str | None, finish: str | None, result: GenerationResult | None = None
        ) -> dict[str, Any]:
            logprobs = completion_logprobs(tok, result, prompts[index // req.n])
            choice = {"index": index, "text": text or "", "logprobs": logprobs}
            choice["finish_reason"] = finish
            if finish is not None and result is not None:
                choice["stop_reason"] = result.stop_reason  # vLLM's: the stop string or token
            return {**head, "choices": [choice]}

        echoes = [tok.decode(p) if req.echo else "" for p in prompts]
        return await _respond(server, request, req, prompts, config, chunk, echoes)

    @router.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        req, prompt, config, answers = server.chat(req)
        return await _respond(
            server, request, req, [prompt], config, answers.chunk, choice=answers.choice
        )

    return router


async def _respond(
    server: Server,
    request: Request,
    req: RequestFields,
    prompts: list[list[int]],
    config: GenerationConfig,
    chunk: Any,
    echoes: list[str] | None = None,
    choice: Callable[[int, GenerationResult], dict[str, Any]] | None = None,
) -> Any:
    """Submit the request's choices; stream their chunks or answer whole. `echoes`: each
    prompt's text before its answers (completions' echo); `choice`: a chat's whole choice."""
    n, chat = req.n, choice is not None
    echo = [""] * len(prompts) if echoes is None else echoes
    rids, queue = server.submit(prompts, config, n)
    if req.stream:
        usage = bool((req.stream_options or {}).get("include_usage"))
        openings = [chunk(i, echo[i // n], None) for i in range(len(rids)) if echo[i // n]]
        if chat:  # each choice's first chat chunk names the role, as OpenAI's do
            openings = [chunk(i, None, None) for i in range(len(rids))]
            for opening in openings:
                opening["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        events = server.stream(rids, queue, chunk, usage, openings, n)
        return StreamingResponse(events, media_type="text/event-stream")
    results = await server.collect(request, rids, queue)
    if failed := [r for r in results if r.finish_reason == "error"]:
        raise ApiError(500, f"generation failed: {failed[0].error}")
    choices = []
    for i, result in enumerate(results):
        if choice is not None:
            choices.append(choice(i, result))
            continue
        text_choice = chunk(i, None, finish_reason(result), result)["choices"][0]
        choices.append(text_choice | {"text": echo[i // n] + result.text})
    body = {**chunk(0, None, None), "choices": choices, "usage": usage_of(results, n)}
    return body | ({"object": "chat.completion"} if chat else {})


def serve(
    engine: BatchEngine,
    names: tuple[str, ...],
    listener: socket.socket,
    speculative: str | None = None,
    defaults: dict[str, Any] | None = None,
    api_key: str | None = None,
    lookup_cache: Path | None = None,
    lookup_cache_every_s: float = SAVE_EVERY_S,
    allowed_origins: tuple[str, ...] = (),
) -> None:
    """Serve on `listener`, a socket already bound (the command line binds it before loading)."""
    import uvicorn

    app = create_app(
        engine,
        names,
        speculative,
        defaults,
        api_key,
        lookup_cache,
        lookup_cache_every_s,
        allowed_origins,
    )
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
