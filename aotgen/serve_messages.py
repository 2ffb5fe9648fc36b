"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API,
answered by the chat machinery (aotgen/messages_api.py turns the request into a chat request,
aotgen/message_output.py the answer into content blocks). Errors on these routes are
Anthropic-shaped (serve.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from aotgen.message_output import MessageOutput
from aotgen.messages_api import MessagesRequest
from aotgen.runtime.reasoning_budget import has_reasoning
from aotgen.serve_events import answer

if TYPE_CHECKING:
    from aotgen.serve import Server


class TokenCountRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages request without its length."""

    max_tokens: int | None = None  # type: ignore[assignment]


def messages_routes(server: Server) -> APIRouter:
    router, tok = APIRouter(), server.engine.tokenizer

    @router.post("/v1/messages")
    async def create(req: MessagesRequest, request: Request) -> Any:
        chat = req.chat_request()
        if not has_reasoning(tok):  # thinking's budget, as thinking itself, has nothing to bound
            chat = chat.model_copy(update={"thinking_token_budget": None})
        _, prompt, config, answers = server.chat(chat)
        # max_tokens is required and clients send their model's output limit (32,000 and
        # more): past the context the answer ends as Anthropic's does at its context window.
        room = server.engine.engine.max_seq_len - len(prompt)
        window = 0 < room < config.max_new_tokens
        if window:
            config = replace(config, max_new_tokens=room)
        output = MessageOutput(answers.head["model"], len(prompt), window)
        return await answer(server, request, prompt, config, answers, output, req.stream)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(req: TokenCountRequest) -> dict[str, int]:
        chat = req.chat_request()
        server.model(chat.model)
        return {"input_tokens": len(chat.prompt_ids(tok))}

    return router
