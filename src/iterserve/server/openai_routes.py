"""OpenAI's routes under /v1: the model list (and one model), completions, chat completions,
responses and embeddings."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from iterserve.server.chat import create_chat_completion
from iterserve.server.completions import create_completion
from iterserve.server.embeddings import create_embeddings
from iterserve.server.embeddings_protocol import EmbeddingRequest
from iterserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from iterserve.server.responses import create_response
from iterserve.server.responses_protocol import ResponsesRequest
from iterserve.server.serving import ServingContext


def openai_routes(ctx: ServingContext) -> APIRouter:
    v1 = APIRouter(prefix="/v1")

    def cards() -> list[ModelCard]:
        return [
            ModelCard(id=name, root=ctx.served_model_names[0], max_model_len=ctx.max_model_len)
            for name in ctx.served_model_names
        ] + [
            ModelCard(
                id=name,
                root=lora.lora_path,
                parent=ctx.served_model_names[0],
                max_model_len=ctx.max_model_len,
            )
            for name, lora in ctx.loras.items()
        ]

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=cards())

    # OpenAI's `client.models.retrieve(id)`; a name may hold slashes ("org/model").
    @v1.get("/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        ctx.resolve_model(model)  # 404 model_not_found, as OpenAI's
        return next(card for card in cards() if card.id == model)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, ctx)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, ctx)

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(body, request, ctx)

    @v1.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embeddings(body, request, ctx)

    return v1
