"""POST /tokenize and /detokenize, vLLM's shapes: a prompt (or a conversation through the
chat template) to token ids, and token ids back to text; and GET /tokenizer_info, vLLM's
tokenizer_config.json of the served tokenizer, through which evaluation harnesses
(lm-evaluation-harness' remote tokenizer) tokenize with the server's own tokenizer instead
of loading one from a hub."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel
from tokenizers import AddedToken

from iterserve.chat.image_parts import take_images
from iterserve.chat.messages import ChatMessage
from iterserve.engine.images import ImagesPrompt
from iterserve.engine.prompts import encode_text, render_chat, with_documents
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.chat import read_images_now
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


class LlamaTokenizeRequest(BaseModel):
    """llama-server's shape of the same request (its clients send `content`)."""

    content: str
    add_special: bool = False
    parse_special: bool = True  # false: special tokens' text is read as plain text
    with_pieces: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int] | list[dict[str, Any]]  # ids; llama-server's {id, piece} with_pieces
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
    content: str  # the same text under llama-server's name


# A tokenizer's own settings that name files on the server or hold its built object: not the
# client's business, and not JSON.
_PRIVATE_SETTINGS = frozenset(
    {"tokenizer_object", "tokenizer_file", "vocab_file", "merges_file", "name_or_path"}
)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _as_json(value: object) -> Any:
    """A tokenizer setting as tokenizer_config.json writes it (an AddedToken as its fields);
    None for what JSON cannot hold."""
    if isinstance(value, AddedToken):
        return {
            "content": value.content, "lstrip": value.lstrip, "normalized": value.normalized,
            "rstrip": value.rstrip, "single_word": value.single_word, "special": value.special,
        }  # fmt: skip
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_as_json(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _as_json(item) for key, item in value.items()}
    return None


def tokenizer_config(ctx: ServingContext) -> dict[str, Any]:
    """What GET /tokenizer_info answers: the served tokenizer's settings as its
    tokenizer_config.json holds them (a GGUF's tokenizer has none of its own: its special
    tokens), its special tokens as text, the chat template chats are rendered with, and the
    served context as model_max_length (HF's own is often a placeholder of 10^30)."""
    tokenizer = ctx.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for key, value in getattr(tokenizer, "init_kwargs", {}).items():
        if key not in _PRIVATE_SETTINGS and (converted := _as_json(value)) is not None:
            info[key] = converted
    for key in _SPECIAL_TOKENS:
        info[key] = getattr(tokenizer, key, None)
    info["model_max_length"] = ctx.max_model_len
    info["chat_template"] = ctx.template_text
    return info


def _chat_tokens(body: TokenizeChatRequest, ctx: ServingContext) -> list[int]:
    """The conversation's token ids as a chat runs it: each image laid out by its size, as
    vLLM's /tokenize counts them (image URLs read where the server may read them)."""
    read_images_now(body.messages, ctx)  # on FastAPI's thread pool
    messages = [m.as_template_input(i) for i, m in enumerate(body.messages)]
    messages, images = take_images(messages)
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
    if images:
        rendered = not body.add_special_tokens
        return ctx.prompt_token_ids(ImagesPrompt(text, tuple(images), rendered=rendered))
    return encode_text(ctx.tokenizer, text, body.add_special_tokens, "messages")


def tokenizer_routes(ctx: ServingContext, info: bool = True) -> APIRouter:
    """The routes; `info`: GET /tokenizer_info too (--enable-tokenizer-info-endpoint)."""
    router = APIRouter()

    if info:

        @router.get("/tokenizer_info")
        def tokenizer_info() -> dict[str, Any]:
            return tokenizer_config(ctx)

    # Plain `def`: FastAPI runs them on its thread pool, so a long text does not hold
    # up the event loop while it is tokenized.
    @router.post("/tokenize")
    def tokenize(
        body: TokenizeCompletionRequest | TokenizeChatRequest | LlamaTokenizeRequest,
    ) -> TokenizeResponse:
        if isinstance(body, LlamaTokenizeRequest):
            return _llama_tokenize(body)
        ctx.resolve_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            tokens = _chat_tokens(body, ctx)
        else:
            tokens = encode_text(ctx.tokenizer, body.prompt, body.add_special_tokens, "prompt")
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
        text = ctx.tokenizer.decode(body.tokens)
        return DetokenizeResponse(prompt=text, content=text)

    def _llama_tokenize(body: LlamaTokenizeRequest) -> TokenizeResponse:
        tokens = ctx.tokenizer(
            body.content,
            add_special_tokens=body.add_special,
            split_special_tokens=not body.parse_special,
        )["input_ids"]
        if not body.with_pieces:
            return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len,
                                    tokens=tokens)  # fmt: skip
        # A piece that is not whole UTF-8 by itself is given as its bytes, as llama-server.
        pieces: list[dict[str, Any]] = []
        for token_id in tokens:
            raw = ctx.token_bytes(token_id)
            try:
                piece: str | list[int] = raw.decode()
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": token_id, "piece": piece})
        return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=pieces)

    return router
