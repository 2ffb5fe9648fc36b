"""One chat answer served as an API's typed events (the Responses API's, Anthropic's
Messages API's): the chat machinery's deltas fed to an output that turns them into events,
streamed as named server-sent events or, whole, fed at once into the final object."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from aotgen.openai_api import ApiError, finish_reason
from aotgen.runtime.engine import GenerationConfig, GenerationResult

if TYPE_CHECKING:
    from aotgen.chat_answer import ChatAnswers
    from aotgen.serve import Server

Event = dict[str, Any]


class EventOutput(Protocol):
    """An answer's output as it forms: the events each delta makes, and the final object."""

    def opening(self) -> list[Event]: ...

    def feed(self, delta: dict[str, Any]) -> list[Event]: ...

    def finish(
        self, delta: dict[str, Any], result: GenerationResult
    ) -> tuple[list[Event], dict[str, Any]]: ...

    def error(self, message: str) -> Event: ...


async def answer(
    server: Server,
    request: Request,
    prompt: list[int],
    config: GenerationConfig,
    answers: ChatAnswers,
    output: EventOutput,
    stream: bool,
    done: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """Run the prompt; stream its events, or return the final object. `done` is handed the
    final object of an answer that ends (a stored response's)."""
    rids, queue = server.submit([prompt], config, 1)

    def finished(result: GenerationResult) -> tuple[list[Event], dict[str, Any]]:
        last = answers.chunk(0, "", finish_reason(result), result)
        events, body = output.finish(last["choices"][0]["delta"], result)
        if done is not None:
            done(body)
        return events, body

    if stream:
        events = _events(server, rids, queue, answers, output, finished)
        return StreamingResponse(events, media_type="text/event-stream")
    (result,) = await server.collect(request, rids, queue)
    if result.finish_reason == "error":
        raise ApiError(500, f"generation failed: {result.error}")
    if (chunk := answers.chunk(0, result.text, None)) is not None:
        output.feed(chunk["choices"][0]["delta"])  # the whole text as one streamed piece
    return finished(result)[1]


async def _events(
    server: Server,
    rids: list[int],
    queue: Any,
    answers: ChatAnswers,
    output: EventOutput,
    finished: Callable[[GenerationResult], tuple[list[Event], dict[str, Any]]],
) -> AsyncIterator[str]:
    """The events as server-sent events, each named by its type; on disconnect Starlette
    cancels this generator and the request goes."""
    try:
        for event in output.opening():
            yield _sse(event)
        while True:
            _, kind, value = await queue.get()
            if kind == "text":
                if (chunk := answers.chunk(0, value, None)) is not None:
                    for event in output.feed(chunk["choices"][0]["delta"]):
                        yield _sse(event)
                continue
            if value.finish_reason == "error":
                yield _sse(output.error(f"generation failed: {value.error}"))
                break
            for event in finished(value)[0]:
                yield _sse(event)
            break
    finally:
        for rid in rids:
            server.engine.cancel(rid)  # a no-op once the request is done


def _sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
