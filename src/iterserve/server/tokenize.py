"""POST /tokenize and /detokenize, vLLM's shapes: a prompt (or a conversation through the
chat template) to token ids, and token ids back to text."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from iterserve.chat.messages import ChatMessage
from iterserve.engine.prompts import encode_text, render_chat, with_documents
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.serving import ServingContext


class TokenizeCompletionRequest(BaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The template writes BOS and the rest itself (vLLM's default too).
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, object] | None = None
    chat_template: str | None = None  # behind --trust-request-chat-template, as for chats
    documents: list[dict[str, str]] | None = None  # as for chats


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenizer_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    # Plain `def`: FastAPI runs them on its thread pool, so a long text does not hold
    # up the event loop while it is tokenized.
    @router.post("/tokenize")
    def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        ctx.resolve_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            messages = [m.as_template_input(i) for i, m in enumerate(body.messages)]
            template = ctx.chat_template_for(body.chat_template)
            text = render_chat(
                ctx.tokenizer,
                template,
                messages,
                body.add_generation_prompt,
                with_documents(
                    ctx.template_kwargs(body.chat_template_kwargs, None), body.documents, template
                ),
                continue_final_message=body.continue_final_message,
            ).text
            field = "messages"
        else:
            text, field = body.prompt, "prompt"
        tokens = encode_text(ctx.tokenizer, text, body.add_special_tokens, field)
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=ctx.max_model_len,
            tokens=tokens,
            token_strs=ctx.tokenizer.convert_ids_to_tokens(tokens)
            if body.return_token_strs
            else None,
        )

    @router.post("/detokenize")
    def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.resolve_model(body.model)
        vocab = len(ctx.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise InvalidRequestError(f"tokens must be token ids in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))

    return router
