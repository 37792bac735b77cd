"""POST /v1/rerank and /v1/score (also at /rerank, /v2/rerank and /score, vLLM's paths): how
relevant each document is to a query; and POST /classify (vLLM's): a classifier's labels'
probabilities for each input.

A reranker (a model with a score head, model/score_head.py) reads each (query, document)
pair as one prompt (engine/score_prompts.py) and answers the sigmoid of its head: a
cross-encoder, each pair one prefill-only request in the embed lane, all queued as one
group (server/pooled_requests.py). A server that only embeds scores as vLLM's does for an
embedding model: the cosine of the query's and the document's embeddings (a bi-encoder).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from iterserve.engine.outputs import RequestOutput
from iterserve.engine.score_prompts import score_pairs
from iterserve.pooling_params import PoolingParams
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.pooled_requests import run_pooled
from iterserve.server.scoring_protocol import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoringUsage,
    TEIRank,
)
from iterserve.server.serving import ServingContext, access_record


def scoring_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await create_rerank(body, request, ctx)

    async def score(body: ScoreRequest, request: Request) -> Response:
        return await create_score(body, request, ctx)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"])
    for path in ("/v1/score", "/score"):
        router.add_api_route(path, score, methods=["POST"])

    async def classify(body: ClassifyRequest, request: Request) -> Response:
        return await create_classification(body, request, ctx)

    for path in ("/classify", "/v1/classify"):
        router.add_api_route(path, classify, methods=["POST"])
    return router


async def create_rerank(body: RerankRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.resolve_model(body.model)
    documents = body.document_texts()
    request_id = f"rerank-{uuid.uuid4().hex}"
    access_record(raw).request_id = request_id
    pairs = [(body.query, document) for document in documents]
    scores, tokens = await _relevance(ctx, pairs, request_id, raw, body.field, model)
    ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[: body.top_n or None]
    text = body.returns_text()
    headers = {"X-Request-Id": request_id}
    if body.tei:
        ranks = [
            TEIRank(index=i, score=scores[i], text=documents[i] if text else None) for i in ranked
        ]
        return JSONResponse([r.model_dump(exclude_none=True) for r in ranks], headers=headers)
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            document=RerankDocument(text=documents[i]) if text else None,
        )
        for i in ranked
    ]
    response = RerankResponse(
        id=request_id,
        model=model,
        results=results,
        usage=ScoringUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return JSONResponse(response.model_dump(mode="json", exclude_none=True), headers=headers)


async def create_score(body: ScoreRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.resolve_model(body.model)
    pairs = score_pairs(body.text_1, body.text_2)
    request_id = f"score-{uuid.uuid4().hex}"
    access_record(raw).request_id = request_id
    scores, tokens = await _relevance(ctx, pairs, request_id, raw, "text_2", model)
    response = ScoreResponse(
        id=request_id,
        created=int(time.time()),
        model=model,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=ScoringUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return JSONResponse(response.model_dump(mode="json"), headers={"X-Request-Id": request_id})


async def create_classification(
    body: ClassifyRequest, raw: Request, ctx: ServingContext
) -> Response:
    model = ctx.resolve_model(body.model)
    prompts = body.prompts()
    request_id = f"classify-{uuid.uuid4().hex}"
    access_record(raw).request_id = request_id
    classify = PoolingParams(task="classify")
    outputs = await run_pooled(ctx, prompts, classify, request_id, raw, "input", model)
    data = []
    for i, out in enumerate(outputs):
        probs = out.probs or []
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(
            ClassifyData(index=i, label=ctx.labels[best], probs=probs, num_classes=len(probs))
        )
    tokens = _tokens(outputs)
    response = ClassifyResponse(
        id=request_id,
        created=int(time.time()),
        model=model,
        data=data,
        usage=ScoringUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return JSONResponse(response.model_dump(mode="json"), headers={"X-Request-Id": request_id})


async def _relevance(
    ctx: ServingContext,
    pairs: Sequence[tuple[str, str]],
    request_id: str,
    raw: Request,
    field: str,
    model: str,
) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens it took: by the reranker's head, or by the
    cosine of embeddings where the server only embeds (with `model`'s LoRA adapter, where
    it names one)."""
    if ctx.pair_prompts is not None:
        prompts = [ctx.pair_prompts(query, document) for query, document in pairs]
        score = PoolingParams(task="score")
        outputs = await run_pooled(ctx, prompts, score, request_id, raw, field, model)
        return [out.score or 0.0 for out in outputs], _tokens(outputs)
    if not ctx.embeds:
        raise InvalidRequestError(
            "this server neither reranks nor embeds (--task generate): serve a reranker or an "
            "embedding model",
            "model",
        )
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    embed = PoolingParams(normalize=True)
    outputs = await run_pooled(ctx, texts, embed, request_id, raw, field, model)
    vectors = {text: out.embedding or [] for text, out in zip(texts, outputs, strict=True)}
    scores = [
        math.fsum(a * b for a, b in zip(vectors[q], vectors[d], strict=True)) for q, d in pairs
    ]
    return scores, _tokens(outputs)


def _tokens(outputs: Sequence[RequestOutput]) -> int:
    return sum(len(out.prompt_token_ids) for out in outputs)
