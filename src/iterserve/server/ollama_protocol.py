"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, ...), read as what it amounts to
here: the requests of the `ollama` client, LangChain's ChatOllama and the apps written for
Ollama (Open WebUI, Continue, ...).

A chat (and a templated /api/generate prompt, a one-turn chat) becomes a
`ChatCompletionRequest` and runs the chat path (template, tools, thinking, structured
output); ollama_routes.py shapes the answer. How the two APIs' ideas meet:
- `options` are the sampling settings; one a request leaves out takes the model's own
  (generation_config.json, a GGUF's general.sampling.*: what an Ollama Modelfile's
  PARAMETERs carry), else Ollama's documented default (temperature 0.8, top_k 40, top_p 0.9,
  repeat_penalty 1.1 over the last 64 tokens, min_p 0). `num_predict` < 0: until the end
  of the context;
- the runner's options (`num_ctx`, `num_thread`, `num_gpu`, `use_mmap`, ...) configure how
  Ollama loads a model: the server's own flags do that here (`--max-model-len`,
  `--num-threads`), so they are accepted and change nothing; `typical_p`, `mirostat` and
  `tfs_z` would change the answer and are not implemented: a 400 naming the option unless
  sent at their neutral value;
- `think`: true separates the thinking into `thinking` (the default wherever the server reads
  the model's thinking), false turns the chat template's thinking switch off, and "low" /
  "medium" / "high" are gpt-oss's effort: `reasoning_effort`'s values;
- `format`: "json" or a JSON schema, enforced by the grammar;
- a message's `tool_calls` carry their arguments as an object (OpenAI's as JSON text), and a
  `tool` message answers the calls of the turn before it in order (its `tool_name` the
  call's name).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from iterserve.chat.messages import ChatMessage, ContentPart, ImageURL
from iterserve.chat.tool_protocol import FunctionCall, ToolCall, ToolDefinition
from iterserve.engine.request_stream import ALL_THE_CONTEXT
from iterserve.sampling_defaults import SamplingDefaults
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.server.protocol import ChatCompletionRequest, ReasoningEffort
from iterserve.structured_output import StructuredOutput

# The Ollama API version /api/version reports: the level whose requests this module reads
# (`think`, `logprobs`, `tool_name`); clients gate features on it.
OLLAMA_API_VERSION = "0.12.6"

# Ollama's defaults (its Modelfile documentation), for options neither the request nor the
# model sets.
_OLLAMA_DEFAULTS: dict[str, float | int] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repetition_penalty": 1.1,
}
_REPEAT_LAST_N = 64
# Options that would change the answer and are not implemented, at their neutral values.
_UNHONOURED_NEUTRAL: dict[str, float] = {"typical_p": 1.0, "mirostat": 0, "tfs_z": 1.0}
# SamplingParams' names as Ollama spells them, for errors.
_OPTION_NAMES = {
    "max_tokens": "num_predict",
    "repetition_penalty": "repeat_penalty",
    "penalty_last_n": "repeat_last_n",
}

Think = bool | Literal["low", "medium", "high"]
Format = Literal["", "json"] | dict[str, Any]


class OllamaOptions(BaseModel):
    """`options`: the sampling settings read here; the runner's (num_ctx, num_thread,
    num_gpu, use_mmap, ...) are accepted and change nothing."""

    model_config = ConfigDict(extra="allow")

    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def check_supported(self) -> None:
        extra = self.model_extra or {}
        for name, neutral in _UNHONOURED_NEUTRAL.items():
            if extra.get(name) not in (None, neutral):
                raise InvalidRequestError(
                    f"options.{name}: not implemented here; send {neutral:g} or leave it out",
                    f"options.{name}",
                )

    def sampling_params(
        self, defaults: SamplingDefaults, logprobs: int | None = None
    ) -> SamplingParams:
        """SamplingParams for these options: the request's, else the model's, else Ollama's."""
        self.check_supported()
        model = defaults.given()

        def pick(name: str, given: float | int | None) -> Any:
            return given if given is not None else model.get(name, _OLLAMA_DEFAULTS[name])

        last_n = _REPEAT_LAST_N if self.repeat_last_n is None else self.repeat_last_n
        limit = self.num_predict
        try:
            return SamplingParams(
                max_tokens=defaults.limit(ALL_THE_CONTEXT if limit is None or limit < 0 else limit),
                temperature=pick("temperature", self.temperature),
                top_k=max(0, pick("top_k", self.top_k)),
                top_p=pick("top_p", self.top_p),
                min_p=pick("min_p", self.min_p),
                seed=None if self.seed is None or self.seed < 0 else self.seed,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                # repeat_last_n 0: no penalties; -1: the whole context.
                repetition_penalty=pick("repetition_penalty", self.repeat_penalty)
                if last_n
                else 1.0,
                presence_penalty=(self.presence_penalty or 0.0) if last_n else 0.0,
                frequency_penalty=(self.frequency_penalty or 0.0) if last_n else 0.0,
                penalty_last_n=ALL_THE_CONTEXT if last_n < 0 else max(1, last_n),
                logprobs=logprobs,
            )
        except InvalidRequestError as error:  # said of the option as Ollama names it
            name = error.param or ""
            option = f"options.{_OPTION_NAMES.get(name, name)}"
            raise InvalidRequestError(f"{option}: {error}", option, error.code) from None


class OllamaToolCall(BaseModel):
    class Function(BaseModel):
        name: str
        arguments: dict[str, Any] = Field(default_factory=dict)
        index: int | None = None

    function: Function


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class _GenerationBase(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    format: Format | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: float | str | None = None
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def unloads(self) -> bool:
        """keep_alive 0: Ollama's request to unload the model (it stays loaded here)."""
        return self.keep_alive in (0, "0", "0s", "0m")

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, defaults: SamplingDefaults) -> SamplingParams:
        params = self.options.sampling_params(defaults, self.requested_logprobs())
        params.structured_output = self._constraint()
        return params

    def _constraint(self) -> StructuredOutput | None:
        if not self.format:
            return None
        if self.format == "json":
            return StructuredOutput(json_object=True, param="format")
        return StructuredOutput.from_json_schema(self.format, param="format")  # type: ignore[arg-type]

    def reasoning_effort(self) -> ReasoningEffort | None:
        if self.think is None or self.think is True:
            return None
        return "none" if self.think is False else self.think


class OllamaChatRequest(_GenerationBase):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[ToolDefinition] | None = None

    def to_chat_request(self) -> ChatCompletionRequest:
        return chat_request(self, chat_messages(self.messages))


class OllamaGenerateRequest(_GenerationBase):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None

    def check_supported(self) -> None:
        if self.images and (self.raw or self.context or self.suffix is not None):
            raise InvalidRequestError(
                "images: taken in a one-turn chat only, where the chat template places them "
                "(not with raw, context or suffix)",
                "images",
            )
        if self.template:
            raise InvalidRequestError(
                "template: Ollama's Go templates are not run here; the model's own chat "
                "template renders the prompt (or send raw: true with the prompt as it is)",
                "template",
            )

    @property
    def loads_only(self) -> bool:
        """An empty prompt: Ollama's request to load the model (or, keep_alive 0, unload it)."""
        return not self.prompt and not self.suffix

    def to_chat_request(self) -> ChatCompletionRequest:
        """The prompt as a one-turn chat (after `system`), as Ollama templates it."""
        messages = [ChatMessage(role="user", content=with_images(self.prompt, self.images))]
        if self.system:
            messages.insert(0, ChatMessage(role="system", content=self.system))
        return chat_request(self, messages)


class OllamaEmbedRequest(BaseModel):
    model: str
    input: str | list[str] = ""
    truncate: bool = True  # cut each input's end to the context; false: a 400 instead
    dimensions: int | None = None
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None


class OllamaEmbeddingsRequest(BaseModel):
    """/api/embeddings, Ollama's first embedding route: one prompt, one vector."""

    model: str
    prompt: str = ""
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None


class OllamaShowRequest(BaseModel):
    model: str | None = None
    name: str | None = None  # the field's older name
    verbose: bool = False


def chat_request(body: _GenerationBase, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request `body` amounts to (its sampling settings are the route's own)."""
    tools = body.tools if isinstance(body, OllamaChatRequest) else None
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        tools=tools or None,
        stream=body.stream,
        reasoning_effort=body.reasoning_effort(),
    )


def with_images(text: str, images: list[str] | None) -> str | list[ContentPart]:
    """A message's content with Ollama's `images` (each base64 of an image file) before its
    text, as OpenAI's image_url parts (chat/image_parts.py decodes them)."""
    if not images:
        return text
    parts = [
        ContentPart(type="image_url", image_url=ImageURL(url=f"data:image;base64,{image}"))
        for image in images
    ]
    return [*parts, ContentPart(type="text", text=text)]


def chat_messages(messages: list[OllamaMessage]) -> list[ChatMessage]:
    """Ollama's messages as chat messages: calls with ids and their arguments as JSON text,
    each tool message given the id of the call it answers (the unanswered call of the turn
    before it with its `tool_name`, else the first unanswered one)."""
    chat: list[ChatMessage] = []
    pending: list[ToolCall] = []  # the last assistant turn's calls not yet answered
    for i, message in enumerate(messages):
        calls = [
            ToolCall(
                id=f"call_{i}_{k}",
                function=FunctionCall(
                    name=call.function.name, arguments=json.dumps(call.function.arguments)
                ),
            )
            for k, call in enumerate(message.tool_calls or [])
        ]
        answered = None
        if message.role == "tool" and pending:
            named = [c for c in pending if c.function.name == message.tool_name]
            answered = (named or pending)[0]
            pending.remove(answered)
        elif message.role == "assistant":
            pending = list(calls)
        chat.append(
            ChatMessage(
                role=message.role,
                content=with_images(message.content or "", message.images),
                tool_calls=calls or None,
                tool_call_id=answered.id if answered else None,
                name=message.tool_name if message.role == "tool" else None,
                reasoning_content=message.thinking,
            )
        )
    return chat
