"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, `GET .../{id}/input_items`:
OpenAI's Responses API, answered by the chat machinery (aotgen/responses_api.py turns the
request into a chat request, aotgen/response_output.py the answer into output items). Stored
responses (`store`, the default) are kept in memory, so a later request continues one by
`previous_response_id`; its conversation's tokens are found in the KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query, Request

from aotgen.openai_api import ApiError
from aotgen.response_output import ResponseOutput
from aotgen.responses_api import ResponsesRequest, StoredResponse
from aotgen.serve_events import answer

if TYPE_CHECKING:
    from aotgen.serve import Server


def responses_routes(server: Server) -> APIRouter:
    router, tok = APIRouter(), server.engine.tokenizer

    @router.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request) -> Any:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            stored = server.responses.get(req.previous_response_id, "previous_response_id")
            history = stored.conversation
        chat, conversation = req.chat_request(history)
        chat, prompt, config, answers = server.chat(chat)
        settings = {"temperature": chat.temperature, "top_p": chat.top_p}
        output = ResponseOutput(req, settings, answers.head["model"], tok)

        def store(body: dict[str, Any]) -> None:
            if req.store:
                turns = conversation + [output.conversation_turn()]
                server.responses.put(StoredResponse(body, turns, req.input_items()))

        return await answer(server, request, prompt, config, answers, output, req.stream, store)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        return server.responses.get(response_id, "response_id").body

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        after: str | None = None,
        limit: int = Query(default=20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        """A stored response's input items, a page at a time (OpenAI's cursor: `after` an
        item's id)."""
        items = server.responses.get(response_id, "response_id").input_items
        items = items[::-1] if order == "desc" else items
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise ApiError(404, f"after: no input item {after!r} in this response", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Any:
        server.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
