"""What a prompt can be, and a conversation through the model's chat template.

A prompt is text (encoded with the tokenizer's own special tokens, so Llama gets
its BOS), token ids (used as given), or a `RenderedChat` (whose start may come with
its tokens already known: `continuing`). Rendering a chat lives
here, in one place for `LLM.chat` and the server. The template writes every special token the model expects (a Llama 2/3 or Mistral
template starts with BOS), so the rendered text must be encoded *without* the
tokenizer adding its own: encoding it like a plain prompt would give such models
two BOS tokens. `RenderedChat` carries that rule to wherever the text is
tokenized (the engine loop thread, for the server).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from PIL import Image

from iterserve.engine.images import ImagesPrompt
from iterserve.engine.prompt_embeds import EmbedsPrompt
from iterserve.engine.template_inputs import fitted_to_template, fitted_tools
from iterserve.sampling_params import InvalidRequestError

# OpenAI's roles that any chat template is expected to take; a template may name more.
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool"})

# A role literal the template compares against: `message['role'] == 'ipython'`,
# `'system' != messages[0].role`, `message.role in ['tool', 'ipython']`.
_ROLE_COMPARED = re.compile(
    r"""role['"]?\]?\s*[!=]=\s*['"](\w+)['"]|['"](\w+)['"]\s*[!=]=\s*[\w.\[\]'"]*role\b"""
)
_ROLE_IN_LIST = re.compile(r"""role['"]?\]?\s+in\s+[\[(]([^\])]*)[\])]""")
_QUOTED = re.compile(r"""['"](\w+)['"]""")


@dataclass(frozen=True)
class KnownTokens:
    """The start of a rendered chat whose tokens are already known: `token_ids` decode to
    its first `chars` characters. An earlier turn's prompt and answer are such a start, and
    their KV may still be in the prefix cache under exactly those tokens; encoding the text
    again could split it otherwise (a model's answer is rarely the tokenizer's own split),
    and other tokens are other blocks."""

    chars: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered by the chat template: text that already holds the
    special tokens the model expects, so it is encoded without adding any."""

    text: str
    known: KnownTokens | None = None  # its start's tokens, used as they are


def continuing(
    rendered: RenderedChat, candidates: Sequence[Sequence[int]], tokenizer: Any
) -> RenderedChat:
    """`rendered`, starting with the first of `candidates` (token sequences, longest first)
    whose text it starts with. A sequence counts only when it decodes, special tokens
    included, to exactly the rendering's start, with ids this tokenizer knows: then those
    tokens are that text for this model, whatever model wrote them down."""
    vocab = len(tokenizer)
    for token_ids in candidates:
        if not token_ids or min(token_ids) < 0 or max(token_ids) >= vocab:
            continue
        text = tokenizer.decode(
            list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        # A strictly shorter text: the rest (at least the generation prompt) is encoded anew.
        if len(text) < len(rendered.text) and rendered.text.startswith(text):
            return RenderedChat(rendered.text, KnownTokens(len(text), tuple(token_ids)))
    return rendered


Prompt = str | RenderedChat | list[int] | EmbedsPrompt | ImagesPrompt

# vLLM's prompt dicts: TextPrompt, TokensPrompt and EmbedsPrompt, and the one key each holds
# (a TextPrompt's images beside its text).
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds")
_IMAGES = "multi_modal_data"
_EXPECTED = {
    "prompt": "a string",
    "prompt_token_ids": "a list of token ids",
    "prompt_embeds": "a [tokens, hidden] tensor",
}


def as_prompt(given: Prompt | Mapping[str, Any]) -> Prompt:
    """A prompt as the engine takes it. vLLM's `{"prompt": text}` (TextPrompt),
    `{"prompt_token_ids": ids}` (TokensPrompt) and `{"prompt_embeds": tensor}` (EmbedsPrompt)
    become their text, ids or rows, and `{"prompt": text, "multi_modal_data": {"image":
    images}}` an ImagesPrompt (the text holding the model's image marker once for each);
    what else such a dict may hold in vLLM (an encoder's prompt, a cache salt, other
    modalities) is refused by name, as is a dict holding two or none."""
    if not isinstance(given, Mapping):
        return given
    if _IMAGES in given:
        return _images_prompt(given)
    unknown = sorted(set(given) - set(_PROMPT_KEYS))
    if unknown:
        raise InvalidRequestError(
            "a prompt dict takes 'prompt', 'prompt_token_ids' or 'prompt_embeds' only, not "
            f"{', '.join(unknown)}",
            unknown[0],
        )
    if len(given) != 1:
        raise InvalidRequestError(
            "a prompt dict holds one of 'prompt' (text), 'prompt_token_ids' (ids) or "
            "'prompt_embeds' (input rows)",
            "prompt",
        )
    key, value = next(iter(given.items()))
    if key == "prompt" and isinstance(value, str):
        return value
    if key == "prompt_token_ids" and isinstance(value, Sequence) and not isinstance(value, str):
        ids = list(value)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return ids
    if key == "prompt_embeds" and isinstance(value, torch.Tensor):
        return EmbedsPrompt(value)
    raise InvalidRequestError(f"'{key}' must be {_EXPECTED[key]}, got {type(value).__name__}", key)


def _images_prompt(given: Mapping[str, Any]) -> ImagesPrompt:
    data, text = given[_IMAGES], given.get("prompt")
    if set(given) != {"prompt", _IMAGES} or not isinstance(text, str):
        raise InvalidRequestError(f"'{_IMAGES}' goes with a text 'prompt' only", _IMAGES)
    if not isinstance(data, Mapping) or set(data) != {"image"}:
        raise InvalidRequestError(f"'{_IMAGES}' takes 'image' only", _IMAGES)
    images = data["image"] if isinstance(data["image"], Sequence) else [data["image"]]
    if not all(isinstance(image, Image.Image) for image in images):
        raise InvalidRequestError(f"'{_IMAGES}.image' takes PIL images", _IMAGES)
    return ImagesPrompt(text, tuple(images))


def prompt_text(prompt: Prompt) -> str | None:
    """vLLM's `RequestOutput.prompt`: the text of a prompt given as text (a rendered chat
    included); None for token ids."""
    if isinstance(prompt, RenderedChat | ImagesPrompt):
        return prompt.text
    return prompt if isinstance(prompt, str) else None


@lru_cache(maxsize=8)
def template_roles(template: str) -> frozenset[str]:
    """The roles a template accepts: OpenAI's, plus any it names itself."""
    named = {a or b for a, b in _ROLE_COMPARED.findall(template)}
    for listed in _ROLE_IN_LIST.findall(template):
        named.update(_QUOTED.findall(listed))
    return STANDARD_ROLES | named


def with_documents(
    template_kwargs: Mapping[str, Any] | None,
    documents: Sequence[Mapping[str, str]] | None,
    template: str | None,
) -> Mapping[str, Any] | None:
    """The template kwargs with a request's `documents` (vLLM's field: retrieved texts that a
    RAG template, Command-R's or Granite's, writes into the prompt in its own format).
    InvalidRequestError naming the field where the template has no place for them, rather
    than an answer that silently never saw them."""
    if not documents:
        return template_kwargs
    if "documents" not in (template or ""):
        raise InvalidRequestError(
            "documents: this model's chat template has no place for documents; put their "
            "text in a message instead",
            "documents",
        )
    return {**(template_kwargs or {}), "documents": [dict(d) for d in documents]}


def render_chat(
    tokenizer: Any,
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    continue_final_message: bool = False,
) -> RenderedChat:
    """Render `messages`; raises InvalidRequestError for a conversation the template
    cannot take (no template, no messages, an unknown role, a template error).

    `continue_final_message` (vLLM's; Anthropic's prefill): the answer goes on from the
    last message's text, an assistant's, instead of opening a turn of its own."""
    if continue_final_message:
        if add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message continues the last message; it cannot be set "
                "together with add_generation_prompt",
                "continue_final_message",
            )
        rendered = render_chat(tokenizer, template, messages, False, template_kwargs, tools)
        return RenderedChat(_cut_after_final_message(rendered.text, messages[-1]))
    if not template:
        raise InvalidRequestError(
            "this model has no chat template; send a plain prompt, or give the server one "
            "(--chat-template)"
        )
    if not messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    roles = template_roles(template)
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in roles:
            raise InvalidRequestError(
                f"messages[{index}] has role {role!r}; this model's chat template takes "
                f"{', '.join(sorted(roles))}",
                f"messages.{index}.role",
            )
    try:
        text = tokenizer.apply_chat_template(
            [dict(message) for message in fitted_to_template(template, messages)],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=[dict(tool) for tool in fitted_tools(template, tools)] if tools else None,
            **(template_kwargs or {}),  # a clash with the names above is a TypeError: a 400
        )
    except Exception as error:  # jinja raises for conversations the template forbids
        raise InvalidRequestError(
            f"the chat template cannot render these messages: {error}", "messages"
        ) from error
    if not isinstance(text, str):  # chat_template_kwargs asked for something else
        raise InvalidRequestError(
            "the chat template did not render to text; check chat_template_kwargs",
            "chat_template_kwargs",
        )
    return RenderedChat(text)


def takes_system_anywhere(tokenizer: Any, template: str | None) -> bool:
    """Whether `template` writes a system message that comes after the conversation has
    started (ChatML's and Llama 3's do; Gemma's refuses one, and some drop it unwritten)."""
    mark = "iterserve-probe-mid-conversation"
    conversation = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "system", "content": mark},
        {"role": "user", "content": "v"},
    ]
    try:
        return mark in render_chat(tokenizer, template, conversation).text
    except InvalidRequestError:
        return False


def _cut_after_final_message(text: str, final: Mapping[str, Any]) -> str:
    """The rendering up to the end of the last message's text: what the template writes
    after it (the end of the turn) is left for the model to write."""
    content = final.get("content")
    if final.get("role") != "assistant" or not isinstance(content, str) or not content:
        raise InvalidRequestError(
            "continue_final_message needs the last message to be an assistant's, with text",
            "messages",
        )
    # Templates that trim a message's whitespace keep it without its trailing whitespace.
    for written in dict.fromkeys((content, content.rstrip())):
        at = text.rfind(written) if written else -1
        if at != -1:
            return text[: at + len(written)]
    raise InvalidRequestError(
        "the chat template does not write the last message's text as it was sent, so "
        "the answer cannot continue it",
        "messages",
    )


def encode_prompt(tokenizer: Any, prompt: str | RenderedChat) -> list[int]:
    """The token ids of a text prompt or a rendered chat: one rule for the engine and for a
    data-parallel front end, which tokenizes to route (both must see the same ids)."""
    if isinstance(prompt, RenderedChat):
        # The chat template already wrote BOS and the rest; adding more would double them.
        known = prompt.known
        if known is None:
            return encode_text(tokenizer, prompt.text, False, "messages")
        rest = encode_text(tokenizer, prompt.text[known.chars :], False, "messages")
        return [*known.token_ids, *rest]
    # The tokenizer's own settings decide on BOS (Llama adds it, SmolLM2 does not).
    return encode_text(tokenizer, prompt, True, "prompt")


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool, field: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError) as error:
        # JSON can carry what Unicode cannot: a lone surrogate ("\ud800") is a valid
        # JSON string, and the tokenizer refuses it.
        if any("\ud800" <= ch <= "\udfff" for ch in text):
            raise InvalidRequestError(
                f"the {field} is not valid Unicode text (it holds a lone surrogate)", field
            ) from error
        raise
