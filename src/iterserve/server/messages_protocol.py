"""Anthropic's Messages API (`POST /v1/messages`), read as the chat request it amounts to.

A Messages request is a conversation of `user` and `assistant` turns whose content is a
string or a list of blocks (`text`; an assistant's `thinking` and `tool_use`; a user's
`tool_result`), plus `system`, client tools with an `input_schema`, `tool_choice`,
`thinking` and `output_config`. It is translated into a `ChatCompletionRequest`, so it runs
exactly the chat path (template, tools, thinking, structured output, sampling);
messages.py shapes the answer as content blocks. Fields are named as this API spells them
in errors.

How the two APIs' ideas meet:
- a `tool_use` block is a call in the assistant's `tool_calls` (its `input` as the
  arguments), a `tool_result` block a `tool` message, and `thinking` the assistant's
  `reasoning_content`: the chat template writes them as the model was taught;
- a conversation ending with an assistant turn is Anthropic's prefill: the answer continues
  its text (chat's `continue_final_message`);
- `thinking` and `output_config.effort` set the chat template's thinking switch (or the
  effort itself, gpt-oss), as `reasoning_effort` does; `budget_tokens` caps the thinking;
- `max_tokens` is an upper bound: where the context window ends first, the answer stops
  there with `stop_reason: "model_context_window_exceeded"`, as Anthropic's API does;
  `max_tokens: 0` fills the prefix cache and answers nothing (Anthropic's cache warming).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from iterserve.sampling_params import InvalidRequestError
from iterserve.server.error_paths import field_path, renamed_chat_field, validated
from iterserve.server.protocol import ChatCompletionRequest, ReasoningEffort

# Anthropic's request fields that change nothing here: prompt caching is automatic (every
# prompt's blocks stay in the prefix cache while there is room), and there is one tier.
_NO_EFFECT = frozenset(
    {
        "cache_control",
        "diagnostics",
        "inference_geo",
        "metadata",
        "service_tier",
        "speed",
        "user_profile_id",
        "workspace_id",
    }
)
# Fields that ask for what this server does not run -> what to do instead.
_NOT_RUN = {
    "container": "server-side code execution is not run here; give client tools instead",
    "mcp_servers": "this server connects to no MCP servers; give their tools as client tools",
}
# A Messages answer is one message: these chat extensions have no place in it.
_ONE_ANSWER = {"n": (1, None), "logprobs": (False, None), "top_logprobs": (None, 0)}

# ---- request ----------------------------------------------------------------------------


class _Lenient(BaseModel):
    # Anthropic adds fields to its blocks (cache_control, citations, ...) that change
    # nothing here: ignored, not refused.
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool = False


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]
    data: str


class ImageSource(_Lenient):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Lenient):
    type: Literal["image"]
    source: ImageSource

    def as_chat_part(self, where: str) -> dict[str, Any]:
        """OpenAI's image_url part of it: base64 as a data URL (a web address is refused
        where chat/image_parts.py decodes it)."""
        source = self.source
        if source.type == "url":
            return {"type": "image_url", "image_url": {"url": source.url or ""}}
        if source.data is None:
            raise InvalidRequestError("a base64 image needs its data", f"{where}.source.data")
        media = source.media_type or "image"
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source.data}"}}


_BLOCKS: dict[str, dict[str, type[BaseModel]]] = {
    "system": {"text": TextBlock},
    "user": {"text": TextBlock, "tool_result": ToolResultBlock, "image": ImageBlock},
    "assistant": {
        "text": TextBlock,
        "tool_use": ToolUseBlock,
        "thinking": ThinkingBlock,
        "redacted_thinking": RedactedThinkingBlock,
    },
}


class InputMessage(BaseModel):
    # `system`: an instruction given mid-conversation (Anthropic's, beside the top-level one).
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


@dataclass(frozen=True)
class ModelTraits:
    """What of the served model the translation depends on."""

    thinks: bool = True  # its thinking is read (a reasoning parser)
    # Its chat template writes a system message after the conversation has started
    # (engine/prompts.py `takes_system_anywhere`); else such a one joins the nearest user turn.
    system_anywhere: bool = True
    images: bool = False  # it takes images (docs/images.md)


class Tool(_Lenient):
    """A client tool: the model writes its `input`, the client runs it."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    type: Literal["custom"] | None = None
    # Anthropic's tool search: the model is shown the tool only once a `tool_reference`
    # block in a tool result has named it.
    defer_loading: bool = False

    def as_chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    def as_chat_choice(self) -> str | dict[str, Any]:
        if self.type == "tool":
            if not self.name:
                raise InvalidRequestError(
                    "tool_choice of type 'tool' names the tool", "tool_choice.name"
                )
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class ThinkingConfig(BaseModel):
    """`enabled` and `adaptive` think (the model's own measure, for a model whose template
    has a switch: thinking on), `disabled` does not; `budget_tokens` caps the thinking."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    # "omitted": the thinking blocks come back empty (their text is not sent).
    display: Literal["summarized", "omitted"] | None = None

    @property
    def thinks(self) -> bool:
        return self.type != "disabled"


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class MessagesRequest(BaseModel):
    # Unknown fields pass on to the chat request: vLLM's sampling extensions (min_p, seed,
    # repetition_penalty, ...) work here too, and ones that would change the output and
    # are not honoured are refused there, by name.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Edits of what the model reads (context_edits.py), applied by the route.
    context_management: dict[str, Any] | None = None

    def check_supported(self) -> None:
        extra = self.model_extra or {}
        for name, instead in _NOT_RUN.items():
            if extra.get(name):
                raise InvalidRequestError(f"{name} is not supported: {instead}", name)
        for name, neutral in _ONE_ANSWER.items():
            if extra.get(name) not in neutral:
                raise InvalidRequestError(f"a message is one answer, without {name}", name)
        if self.max_tokens < 0:
            raise InvalidRequestError(
                f"max_tokens must be at least 0, got {self.max_tokens}", "max_tokens"
            )
        thinking = self.thinking
        if thinking is not None and thinking.budget_tokens is not None:
            if thinking.type != "enabled":
                raise InvalidRequestError(
                    "budget_tokens belongs to thinking of type 'enabled'",
                    "thinking.budget_tokens",
                )
            if thinking.budget_tokens < 1:
                raise InvalidRequestError(
                    f"thinking.budget_tokens must be at least 1, got {thinking.budget_tokens}",
                    "thinking.budget_tokens",
                )

    @contextlib.contextmanager
    def naming_fields(self) -> Iterator[None]:
        """InvalidRequestErrors raised within name the field as this request spells it
        (the chat path names its own)."""
        try:
            yield
        except InvalidRequestError as error:
            error.param = self.param(error.param)
            raise

    def param(self, chat_param: str | None) -> str | None:
        """A chat-request field name, in this request's terms (best effort: a message
        index counts `system` and split tool results, so it names `messages` alone)."""
        # The thinking switch is set by `thinking`, or else by `output_config.effort`.
        switch = "thinking" if self.thinking is not None else "output_config.effort"
        names = {**_PARAMS, "reasoning_effort": switch, "chat_template_kwargs": switch}
        return renamed_chat_field(chat_param, names, _tool_field)

    @property
    def warms_only(self) -> bool:
        """max_tokens 0: the prompt goes into the prefix cache, no answer is made."""
        return self.max_tokens == 0

    @property
    def thinking_budget(self) -> int | None:
        thinking = self.thinking
        return thinking.budget_tokens if thinking is not None and thinking.thinks else None

    @property
    def shows_thinking(self) -> bool:
        return self.thinking is None or self.thinking.display != "omitted"

    def effort(self, model_thinks: bool) -> ReasoningEffort | None:
        """The chat request's `reasoning_effort`: `thinking` says whether, `output_config`
        how much (gpt-oss's efforts). Adaptive thinking is the model's to choose: one that
        does not think takes it, and an effort, as asking for none (Claude Code sends both
        whatever the model)."""
        effort = self.output_config.effort if self.output_config else None
        thinking = self.thinking
        if thinking is None or thinking.type == "adaptive":
            return effort if model_thinks else None
        if not thinking.thinks:
            if effort is not None:
                raise InvalidRequestError(
                    "output_config.effort asks for thinking that thinking 'disabled' turns off",
                    "output_config.effort",
                )
            return "none"
        return effort or "high"

    def to_chat_request(self, model: ModelTraits) -> ChatCompletionRequest:
        """The chat request this one amounts to, for `model` (raises InvalidRequestError
        naming the Messages field)."""
        self.check_supported()
        messages = self.chat_messages(model.system_anywhere, model.images)
        prefill = messages[-1]["role"] == "assistant"
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in _NO_EFFECT}
        chat: dict[str, Any] = {
            **extra,
            "model": self.model,
            "messages": messages,
            # The engine always samples a token: with max_tokens 0 it is left out.
            "max_tokens": max(1, self.max_tokens),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "stream": self.stream,
            "add_generation_prompt": not prefill,
            "continue_final_message": prefill,
            "reasoning_effort": self.effort(model.thinks),
            "thinking_token_budget": self.thinking_budget,
        }
        if self.tools:
            tools = [_tool(raw, index) for index, raw in enumerate(self.tools)]
            loaded = _referenced_tools(self.messages, {tool.name for tool in tools})
            chat["tools"] = [
                tool.as_chat_tool()
                for tool in tools
                if not tool.defer_loading or tool.name in loaded
            ]
        if self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice.as_chat_choice()
            chat["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        output_format = self.output_config.format if self.output_config else None
        if output_format is not None:
            schema = {"name": "output", "schema": output_format.json_schema}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as error:  # an extension field of the wrong type
            first = error.errors()[0]
            param = self.param(field_path(first["loc"]))
            raise InvalidRequestError(
                f"invalid value for '{param}': {first['msg']}", param
            ) from None

    def chat_messages(
        self, system_anywhere: bool = True, images: bool = False
    ) -> list[dict[str, Any]]:
        """`system` and the turns as chat messages."""
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "\n".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        # Instructions given mid-conversation to a template that writes system messages only
        # at the start: they join the next user turn's text (before an assistant turn, or at
        # the end, the last one's), so that a tool call still meets its result first.
        held: list[TextBlock] = []
        for index, message in enumerate(self.messages):
            blocks = _blocks(message, f"messages.{index}", images)
            if message.role == "system":
                text = "\n".join(block.text for block in blocks if isinstance(block, TextBlock))
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "system":
                    last["content"] = f"{last['content']}\n{text}"
                elif system_anywhere or last is None:
                    messages.append({"role": "system", "content": text})
                else:
                    held.append(TextBlock(type="text", text=text))
                continue
            if message.role == "assistant" and held:
                _add_user_turn(messages, held, "")
                held = []
            if message.role == "user":
                _add_user_turn(messages, [*blocks, *held], f"messages.{index}")
                held = []
            else:
                _add_assistant_turn(messages, blocks)
        if held:
            _add_user_turn(messages, held, "")
        if messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
            raise InvalidRequestError(
                "the last message is an assistant's tool_use: send its tool_result in a "
                "user message after it",
                f"messages.{len(self.messages) - 1}",
            )
        return messages


def _tool(raw: dict[str, Any], index: int) -> Tool:
    kind = raw.get("type")
    if kind not in (None, "custom"):
        raise InvalidRequestError(
            f"tools of type {kind!r} are run by Anthropic's servers, not here: give a "
            "client tool (a name and an input_schema)",
            f"tools.{index}.type",
        )
    return validated(Tool, raw, f"tools.{index}")


class ToolReference(_Lenient):
    """In a tool result: a deferred tool the client's tool search found, shown from then on."""

    type: Literal["tool_reference"]
    tool_name: str


def _referenced_tools(messages: Sequence[InputMessage], names: set[str]) -> set[str]:
    """The tools that `tool_reference` blocks in tool results name (each one of `names`)."""
    found = set()
    for index, message in enumerate(messages):
        if message.role != "user" or isinstance(message.content, str):
            continue
        for at, block in enumerate(message.content):
            content = block.get("content") if block.get("type") == "tool_result" else None
            for part, raw in enumerate(content if isinstance(content, list) else []):
                if not isinstance(raw, dict) or raw.get("type") != "tool_reference":
                    continue
                where = f"messages.{index}.content.{at}.content.{part}"
                name = validated(ToolReference, raw, where).tool_name
                if name not in names:
                    raise InvalidRequestError(
                        f"tool_reference names {name!r}, which is not among the tools",
                        f"{where}.tool_name",
                    )
                found.add(name)
    return found


def _blocks(message: InputMessage, where: str, images: bool = False) -> list[BaseModel]:
    """The message's blocks; an image only where the model takes images."""
    content = message.content
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    known = {k: v for k, v in _BLOCKS[message.role].items() if images or v is not ImageBlock}
    blocks = []
    for index, raw in enumerate(content):
        kind = raw.get("type")
        model = known.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise InvalidRequestError(
                f"{message.role} content blocks of type {kind!r} are not supported here "
                f"(only {', '.join(known)})",
                f"{where}.content.{index}.type",
            )
        blocks.append(validated(model, raw, f"{where}.content.{index}"))
    return blocks


def _add_user_turn(messages: list[dict[str, Any]], blocks: Sequence[BaseModel], where: str) -> None:
    """A user turn: each tool result a `tool` message, the text one user message (with its
    images, chat's parts in order). Consecutive user turns are one (Anthropic's rule), their
    texts a line apart."""
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        if not parts:
            return
        content: str | list[dict[str, Any]] = parts[:]
        if all(part["type"] == "text" for part in parts):
            content = "\n".join(part["text"] for part in parts)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "user":
            last["content"] = _joined(last["content"], content)
        else:
            messages.append({"role": "user", "content": content})
        parts.clear()

    for index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):  # _blocks takes them where the model does
            parts.append(block.as_chat_part(f"{where}.content.{index}"))
        elif isinstance(block, ToolResultBlock):
            flush()
            content = _result_text(block, f"{where}.content.{index}.content")
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
    flush()


def _joined(
    first: str | list[dict[str, Any]], then: str | list[dict[str, Any]]
) -> str | list[dict[str, Any]]:
    """Two user turns' contents as one: texts a line apart, parts one after the other."""
    if isinstance(first, str) and isinstance(then, str):
        return f"{first}\n{then}"

    def parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"type": "text", "text": content}] if isinstance(content, str) else content

    return [*parts(first), *parts(then)]


def _result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for index, raw in enumerate(content):
        if raw.get("type") == "tool_reference":  # the tool itself joins the prompt's tools
            texts.append(
                f"Tool loaded: {validated(ToolReference, raw, f'{where}.{index}').tool_name}"
            )
            continue
        if raw.get("type") != "text":
            raise InvalidRequestError(
                f"tool_result content blocks of type {raw.get('type')!r} are not supported "
                "here (only text and tool_reference)",
                f"{where}.{index}.type",
            )
        texts.append(validated(TextBlock, raw, f"{where}.{index}").text)
    return "\n".join(texts)


def _add_assistant_turn(messages: list[dict[str, Any]], blocks: Sequence[BaseModel]) -> None:
    """An assistant turn: its text the content, its thinking the `reasoning_content`, its
    tool uses the `tool_calls` (redacted thinking has nothing to show the template).
    Consecutive assistant turns are one."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    for block in blocks:
        if isinstance(block, TextBlock):
            before = last["content"]
            last["content"] = f"{before}\n{block.text}" if before else block.text
        elif isinstance(block, ThinkingBlock):
            before = last.get("reasoning_content")
            last["reasoning_content"] = f"{before}\n{block.thinking}" if before else block.thinking
        elif isinstance(block, ToolUseBlock):
            call = {
                "id": block.id,
                "type": "function",
                "function": {"name": block.name, "arguments": json.dumps(block.input)},
            }
            last.setdefault("tool_calls", []).append(call)


class TokenCountRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without `max_tokens`."""

    max_tokens: int = 1


# How the chat request names a field -> how this API does.
_PARAMS = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "continue_final_message": "messages",
    "add_generation_prompt": "messages",
    "thinking_token_budget": "thinking.budget_tokens",
}


def _tool_field(param: str) -> str:
    """`tools.N.function.parameters...` -> `tools.N.input_schema...`."""
    param = re.sub(r"^tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema", param)
    return re.sub(r"^tools\.(\d+)\.function", r"tools.\1", param)
