"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API,
answered by the chat machinery (aotgen/responses_api.py turns the request into a chat
request, aotgen/response_output.py the answer into output items). Stored responses (`store`,
the default) are kept in memory, so a later request continues one by `previous_response_id`;
its conversation's tokens are found in the KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from aotgen.response_output import ResponseOutput
from aotgen.responses_api import ResponsesRequest
from aotgen.serve_events import answer

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
        output = ResponseOutput(req, settings, answers.head["model"], tok)

        def store(body: dict[str, Any]) -> None:
            if req.store:
                server.responses.put(body, conversation + [output.conversation_turn()])

        return await answer(server, request, prompt, config, answers, output, req.stream, store)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        return server.responses.get(response_id, "response_id")[0]

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Any:
        server.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
