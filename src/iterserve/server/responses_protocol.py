"""OpenAI's Responses API (`POST /v1/responses`), read as the chat request it amounts to.

A Responses request is a conversation (`input`: a string, or items: messages, the
function calls an assistant made and their outputs, its reasoning) plus `instructions`,
function tools and a text format. It is translated into a `ChatCompletionRequest`, so it runs exactly
the chat path (template, tools, structured output, sampling); responses.py shapes the
answer as Responses output items. Fields are named as this API spells them in errors.

A request chained with `previous_response_id` continues the stored history that
response_chain.py finds: those items come first, then this request's `input`;
`instructions` are this request's own (OpenAI's rule: they do not carry over).
`reasoning.effort` becomes chat's `reasoning_effort` (the chat template's thinking
switch, docs/reasoning.md).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from iterserve.sampling_params import InvalidRequestError
from iterserve.server.error_paths import renamed_chat_field, validated
from iterserve.server.protocol import ChatCompletionRequest, ReasoningEffort

# The `include` value that adds to an answer here: the output text's token logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The others OpenAI defines ask for parts of items this server never makes (reasoning's
# encrypted content, built-in tools' calls, input images): there is nothing to add, so
# they are accepted. Codex-style clients send "reasoning.encrypted_content" with every
# stateless request.
_VACUOUS_INCLUDES = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
    }
)


def new_item_id(kind: str) -> str:
    """An id for an item (`msg`, `fc`, ...), unique as OpenAI's are."""
    return f"{kind}_{secrets.token_hex(12)}"


_ITEM_ID_PREFIXES = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists one (a response's input_items, a conversation's items):
    with an id, and a message's string content as its one text part."""
    kind = item.get("type", "message")
    listed = {"id": new_item_id(_ITEM_ID_PREFIXES.get(kind, "msg")), **item}
    if kind == "message":
        listed["type"] = "message"
        content = listed.get("content")
        if isinstance(content, str):
            part = "output_text" if listed.get("role") == "assistant" else "input_text"
            listed["content"] = [{"type": part, "text": content}]
        listed.setdefault("status", "completed")
    return listed


# Responses fields naming objects kept by OpenAI's other APIs -> what to send instead.
_NOT_KEPT = {"prompt": "send the instructions and input themselves"}

# ---- request ----------------------------------------------------------------------------


class FunctionTool(BaseModel):
    """A Responses tool: the function's fields at the top level (chat nests them)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    """`reasoning`: `effort` sets the chat template's thinking switch; a summary is never
    made (a reasoning item's `summary` is empty, its whole text is in `content`), so
    asking for one changes nothing. Other keys OpenAI may add are refused by name."""

    model_config = ConfigDict(extra="allow")

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @property
    def asks_for_thinking(self) -> bool:
        """Whether it asks anything of a model that does not think (effort 'none' does not)."""
        effort = self.effort not in (None, "none")
        return effort or self.summary is not None or self.generate_summary is not None


class _ContentPart(BaseModel):
    type: str
    text: str | None = None
    image_url: str | None = None  # an input_image's (a data URL)
    file_id: str | None = None  # an input_image's file, which this server does not keep


class _MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_ContentPart]


class _FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_ContentPart]


class _ReasoningItem(BaseModel):
    """An earlier answer's thinking, sent back by clients that keep the whole output: its
    text is in `content` (this server's items) or only in `summary` (OpenAI's)."""

    type: Literal["reasoning"]
    content: list[_ContentPart] | None = None
    summary: list[_ContentPart] = []

    def text(self) -> str:
        parts = self.content or self.summary
        return "\n".join(part.text for part in parts if part.text)


_ITEMS: dict[str, type[BaseModel]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionCallOutputItem,
    "reasoning": _ReasoningItem,
}
_TEXT_PARTS = {"input_text", "output_text", "text", "reasoning_text", "summary_text"}


class ConversationRef(BaseModel):
    id: str


class ResponsesRequest(BaseModel):
    # Unknown fields pass on to the chat request: vLLM's sampling extensions (top_k, seed,
    # repetition_penalty, ...) work here too, and ones that would change the output and
    # are not honoured are refused there, by name.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    # A kept conversation (server/conversation_store.py): its items are read before `input`,
    # and this response's input and output are added to it. Its id, or {"id": ...}.
    conversation: str | ConversationRef | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        for key, value in (self.reasoning.model_extra or {}).items() if self.reasoning else ():
            if value is not None:
                raise InvalidRequestError(
                    f"reasoning.{key} is not supported by this server", f"reasoning.{key}"
                )
        for value in self.include or ():
            if value != LOGPROBS_INCLUDE and value not in _VACUOUS_INCLUDES:
                raise InvalidRequestError(f"include {value!r} is not a known value", "include")
        if self.model_extra and self.model_extra.get("n", 1) != 1:
            raise InvalidRequestError("a response has one answer: n must be 1", "n")
        # Server-side objects this server does not keep; ignored, they would give an
        # answer that silently lacks the conversation or prompt they name.
        for name, instead in _NOT_KEPT.items():
            if (self.model_extra or {}).get(name) is not None:
                raise InvalidRequestError(f"this server keeps no {name}s: {instead}", name)

    @property
    def wants_logprobs(self) -> bool:
        """The output text's token logprobs, asked for by `include` (or by top_logprobs,
        which would mean nothing otherwise)."""
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    def settings(self) -> dict[str, Any]:
        """The request's own settings, as a Response object repeats them."""
        text_format = self.text.format if self.text else None
        tool_choice = self.tool_choice or "auto"
        reasoning = self.reasoning
        return {
            "reasoning": None
            if reasoning is None
            else {"effort": reasoning.effort, "summary": reasoning.summary},
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format
                else {"type": "text"}
            },
            "tool_choice": tool_choice
            if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
            "metadata": self.metadata or {},
            "conversation": None if self.conversation_id is None else {"id": self.conversation_id},
            "user": self.user,
            "top_logprobs": self.top_logprobs,
        }

    @property
    def conversation_id(self) -> str | None:
        given = self.conversation
        return given.id if isinstance(given, ConversationRef) else given

    @property
    def stored(self) -> bool:
        """Whether the answer is kept (OpenAI's default: it is)."""
        return self.store is not False

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as items: a string is one user message."""
        if isinstance(self.input, str):
            text = {"type": "input_text", "text": self.input}
            return [{"type": "message", "role": "user", "content": [text]}]
        return list(self.input)

    def to_chat_request(
        self, history: Sequence[dict[str, Any]] = (), images: bool = False
    ) -> ChatCompletionRequest:
        """The chat request this one amounts to, after the `history` of the response it
        continues (raises InvalidRequestError naming the Responses field). `images`: the
        model takes them, so an input_image is an image_url part of its message."""
        self.check_supported()
        chat: dict[str, Any] = {
            **(self.model_extra or {}),
            "model": self.model,
            "messages": self.chat_messages(history, images),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
        }
        if self.wants_logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs or 0
        if self.reasoning is not None and self.reasoning.effort is not None:
            chat["reasoning_effort"] = self.reasoning.effort
        if self.tools:
            chat["tools"] = [tool.as_chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, FunctionToolChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text else None
        if text_format is not None and text_format.type != "text":
            schema = {"name": text_format.name, "schema": text_format.json_schema}
            chat["response_format"] = {"type": text_format.type, "json_schema": schema}
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as error:  # an extension field of the wrong type
            first = error.errors()[0]
            param = responses_param(".".join(str(part) for part in first["loc"]))
            raise InvalidRequestError(
                f"invalid value for '{param}': {first['msg']}", param
            ) from None

    def chat_messages(
        self, history: Sequence[dict[str, Any]] = (), images: bool = False
    ) -> list[dict[str, Any]]:
        """`instructions`, the `history` and `input` as chat messages."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        # The history was read (as input) or written (as output) here before: a problem in
        # it is not this request's field, so it is named by the response it came from.
        _add_items(messages, history, lambda _: "previous_response_id", images)
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        elif not self.input:
            raise InvalidRequestError("input is empty", "input")
        else:
            _add_items(messages, self.input, lambda index: f"input.{index}", images)
        # Thinking that nothing followed (an answer cut short in it) is no turn of its own.
        return [message for message in messages if not _is_thinking_only(message)]


def _add_items(
    messages: list[dict[str, Any]],
    items: Sequence[dict[str, Any]],
    param: Callable[[int], str],
    images: bool = False,
) -> None:
    """Items as chat messages: a reasoning item is the `reasoning_content` of the assistant
    message it comes before (templates show it, or drop it, as they do chat's); an
    assistant's function calls join its message (or start one); each call's output
    becomes a tool message."""
    for index, raw in enumerate(items):
        item = _parse_item(raw, param(index))
        last = messages[-1] if messages else None
        thinking_only = last is not None and _is_thinking_only(last)
        if isinstance(item, _ReasoningItem):
            messages.append(
                {"role": "assistant", "content": None, "reasoning_content": item.text()}
            )
        elif isinstance(item, _MessageItem):
            role = "system" if item.role == "developer" else item.role
            content = _content_of(item.content, f"{param(index)}.content", images)
            if role == "assistant" and thinking_only and last is not None:
                last["content"] = content
            else:
                messages.append({"role": role, "content": content})
        elif isinstance(item, _FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, _FunctionCallOutputItem):
            output = _text_of(item.output, f"{param(index)}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})


def _is_thinking_only(message: dict[str, Any]) -> bool:
    """An assistant message made of a reasoning item alone (so far)."""
    return (
        message["role"] == "assistant"
        and "reasoning_content" in message
        and message["content"] is None
        and not message.get("tool_calls")
    )


def check_items(items: Sequence[dict[str, Any]], field: str) -> None:
    """InvalidRequestError naming `field.N` for an item this server cannot read: what a
    conversation is given is checked when it is given, not when a response reads it."""
    _add_items([], items, lambda index: f"{field}.{index}")


def _parse_item(raw: dict[str, Any], where: str) -> BaseModel:
    kind = raw.get("type", "message" if "role" in raw else None)
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        known = ", ".join(_ITEMS)
        raise InvalidRequestError(
            f"input items of type {kind!r} are not supported (only {known})", f"{where}.type"
        )
    return validated(model, raw, where)


def _content_of(
    content: str | list[_ContentPart], param: str, images: bool
) -> str | list[dict[str, Any]]:
    """A message's content as chat's: its text, or, with input_image parts where the model
    takes images, chat's parts in order (image_url's; chat/image_parts.py decodes them)."""
    if isinstance(content, str) or not any(p.type == "input_image" for p in content):
        return _text_of(content, param)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if part.type in _TEXT_PARTS and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type != "input_image":
            raise InvalidRequestError(
                f"a content part is text or input_image, not {part.type!r}", f"{param}.{i}"
            )
        elif not images:
            raise InvalidRequestError("this model takes no images (text only)", f"{param}.{i}")
        elif part.image_url is None:
            raise InvalidRequestError(
                "give the image as image_url, a data URL: files are not kept here",
                f"{param}.{i}.file_id" if part.file_id else f"{param}.{i}.image_url",
            )
        else:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


def _text_of(content: str | list[_ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    for i, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise InvalidRequestError(
                f"only text content parts are supported by this model, not {part.type!r}",
                f"{param}.{i}",
            )
    return "\n".join(part.text or "" for part in content)  # as chat's parts (chat/messages.py)


# How the chat request names a field -> how this API does; `messages.N` is handled apart.
_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "reasoning_effort": "reasoning.effort",
}


def responses_param(param: str | None) -> str | None:
    """A chat-request field name, in the Responses request's terms (best effort: a
    message index counts instructions and merged calls, so it names `input` alone)."""
    return renamed_chat_field(param, _PARAMS, _tool_field)


def _tool_field(param: str) -> str:
    return re.sub(r"^tools\.(\d+)\.function", r"tools.\1", param)
