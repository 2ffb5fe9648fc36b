"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API,
answered by the chat machinery (aotgen/responses_api.py turns the request into a chat
request, aotgen/response_output.py the answer into output items). Stored responses (`store`,
the default) are kept in memory, so a later request continues one by `previous_response_id`;
its conversation's tokens are found in the KV cache."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from aotgen.chat_answer import ChatAnswers
from aotgen.openai_api import ApiError, finish_reason
from aotgen.response_output import Event, ResponseOutput
from aotgen.responses_api import ResponsesRequest
from aotgen.runtime.engine import GenerationResult

if TYPE_CHECKING:
    from aotgen.serve import Server


def responses_routes(server: Server) -> APIRouter:
    router, tok = APIRouter(), server.engine.tokenizer

    @router.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request) -> Any:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            _, history = server.responses.get(req.previous_response_id, "previous_response_id")
        chat, conversation = req.chat_request(history)
        chat, prompt, config, answers = server.chat(chat)
        settings = {"temperature": chat.temperature, "top_p": chat.top_p}
        output = ResponseOutput(req, settings, answers.head["model"])
        rids, queue = server.submit([prompt], config, 1)

        def finished(result: GenerationResult) -> list[Event]:
            last = answers.chunk(0, "", finish_reason(result), result)
            events, body = output.finish(last["choices"][0]["delta"], result, tok)
            if req.store:
                server.responses.put(body, conversation + [output.conversation_turn()])
            return events

        if req.stream:
            events = _events(server, rids, queue, answers, output, finished)
            return StreamingResponse(events, media_type="text/event-stream")
        (result,) = await server.collect(request, rids, queue)
        if result.finish_reason == "error":
            raise ApiError(500, f"generation failed: {result.error}")
        if (chunk := answers.chunk(0, result.text, None)) is not None:
            output.feed(chunk["choices"][0]["delta"])  # the whole text as one streamed piece
        return finished(result)[-1]["response"]

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        return server.responses.get(response_id, "response_id")[0]

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Any:
        server.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


async def _events(
    server: Server,
    rids: list[int],
    queue: Any,
    answers: ChatAnswers,
    output: ResponseOutput,
    finished: Any,
) -> AsyncIterator[str]:
    """The stream's events as server-sent events, each named by its type; on disconnect
    Starlette cancels this generator and the request goes."""
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
                error = {"type": "error", "code": "server_error", "message": value.error}
                yield _sse(error | {"param": None, "sequence_number": output.sequence})
                break
            for event in finished(value):
                yield _sse(event)
            break
    finally:
        for rid in rids:
            server.engine.cancel(rid)  # a no-op once the request is done


def _sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
