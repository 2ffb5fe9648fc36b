"""What `aotgen serve` holds and how it counts: `GET /health`, `GET /metrics` (Prometheus),
`GET /v1/models` and `/v1/models/NAME`, vLLM's `POST /tokenize` and `POST /detokenize`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response

from aotgen.openai_api import ApiError, DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from aotgen.serve import Server


def info_routes(server: Server) -> APIRouter:
    """What the server holds and how it counts: health, metrics, the model, tokenization."""
    router, engine = APIRouter(), server.engine

    @router.get("/health")
    async def health() -> dict[str, Any]:
        s = engine.scheduler
        return {
            "status": "ok",
            "slots": engine.slots,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "finished": dict(engine.finished),  # finish reason -> requests
        }

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    def card(name: str) -> dict[str, Any]:
        """A served name's card: OpenAI's fields (with vLLM's root and max_model_len) and
        Anthropic's (type, display_name, created_at)."""
        created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(server.created))
        return {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "aotgen",
            "root": server.names[0],
            "max_model_len": engine.engine.max_seq_len,
            "type": "model",
            "display_name": name,
            "created_at": created_at,
        }

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The served names, one page (OpenAI's list; Anthropic's has_more, first_id,
        last_id)."""
        names = server.names
        page = {"has_more": False, "first_id": names[0], "last_id": names[-1]}
        return {"object": "list", "data": [card(name) for name in names]} | page

    @router.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        return card(server.model(name))

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        server.model(req.model)
        ids = req.ids(engine.tokenizer)
        return {"count": len(ids), "max_model_len": engine.engine.max_seq_len, "tokens": ids}

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        server.model(req.model)
        vocab = engine.target.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"tokens must be in 0..{vocab - 1}", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    return router
