"""Request and response bodies of the OpenAI API, as pydantic models.

Unknown request fields are ignored (as vLLM does), so clients that send
OpenAI options we do not model keep working; options that would change the
output and that the engine cannot honour are refused in `to_sampling_params`
instead of being silently dropped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer

from iterserve.chat.messages import ChatMessage
from iterserve.chat.tool_protocol import DeltaToolCall, ToolCall, ToolChoice, ToolDefinition
from iterserve.engine.request_stream import ALL_THE_CONTEXT
from iterserve.prompt_truncation import PromptTruncation, TruncationSide
from iterserve.sampling_defaults import SamplingDefaults
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.server.structured_output import GuidedDecodingFields
from iterserve.server.unhonoured import refuse_unhonoured

# ---- requests -------------------------------------------------------------------------

# OpenAI's reasoning efforts (chat's `reasoning_effort`, Responses' `reasoning.effort`).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(GuidedDecodingFields):
    """Fields shared by /v1/completions and /v1/chat/completions (and the output
    constraints: server/structured_output.py)."""

    # Kept, not dropped, so the ones that would change the output can be refused.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM spellings) and the scheduler's own.
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    priority: int = 0
    lane: str = "interactive"
    speculative: bool = True  # False: this request never speculates
    # vLLM's token-level fields (docs/serving.md): the prompt cut to its last (or, with
    # truncation_side "right", first) tokens; the prompt's tokens' logprobs; the prompt's and
    # the answer's token ids beside the text (what RL rollouts train on); logprobs' tokens
    # as "token_id:N" (a token that is part of a UTF-8 character has no text of its own).
    truncate_prompt_tokens: int | None = None
    truncation_side: TruncationSide | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None

    def to_sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: SamplingDefaults,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """`defaults`: the model's, for the sampling fields the request leaves unset (else
        OpenAI's). `prompt_logprobs`: what the route scores the prompt for beyond the
        request's own `prompt_logprobs` (completions' echo); the engine computes the larger."""
        refuse_unhonoured(self.model_extra)
        if self.stream and self.prompt_logprobs:
            # As vLLM: a stream has no place for them.
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
        # SamplingParams validates every range and names the offending field.
        unset = SamplingParams(**defaults.given())
        return SamplingParams(
            n=self.n,
            max_tokens=defaults.limit(max_tokens),
            temperature=unset.temperature if self.temperature is None else self.temperature,
            top_p=unset.top_p if self.top_p is None else self.top_p,
            top_k=unset.top_k if self.top_k is None else self.top_k,
            min_p=unset.min_p if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(prompt_logprobs),
            truncation=PromptTruncation.of(self.truncate_prompt_tokens, self.truncation_side),
            skip_special_tokens=self.skip_special_tokens,
            speculative=self.speculative,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=(
                unset.repetition_penalty
                if self.repetition_penalty is None
                else self.repetition_penalty
            ),
            logit_bias=_token_id_keys(self.logit_bias),
            min_tokens=self.min_tokens,
            bad_words=list(self.bad_words or []),
            allowed_token_ids=self.allowed_token_ids,
            structured_output=self.output_constraint(),
        )

    def _prompt_logprobs(self, route: int | None) -> int | None:
        """The larger of the request's and the route's; a negative one stays, for
        SamplingParams to refuse, and a stream's 0 (allowed, as in vLLM) asks for nothing."""
        own = None if self.stream else self.prompt_logprobs
        if own is None or route is None or own < 0:
            return route if own is None else own
        return max(own, route)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _token_id_keys(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias has token ids as JSON object keys, hence strings."""
    if not logit_bias:
        return None
    try:
        return {int(key): value for key, value in logit_bias.items()}
    except ValueError:
        raise InvalidRequestError(
            "logit_bias keys must be token ids (integers as strings)", "logit_bias"
        ) from None


def _minus_one_is_none(value: object) -> object:
    return None if value == -1 and not isinstance(value, bool) else value


# A token limit: None (or -1, as llama-server reads it: llama.vscode's chat edits send it)
# is as many as the context allows.
TokenLimit = Annotated[int | None, BeforeValidator(_minus_one_is_none)]


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    # vLLM's: prompts given as input rows, each base64 of a torch.save'd [tokens, hidden]
    # tensor (--enable-prompt-embeds; engine/prompt_embeds.py). They run before `prompt`'s.
    prompt_embeds: str | list[str] | None = None
    max_tokens: TokenLimit = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch of them; token ids are accepted in place of text. None
        where the request gives prompt_embeds and no prompt, or an empty one (as vLLM's
        example sends it: the OpenAI client insists on a prompt)."""
        prompt = self.prompt
        if not prompt and self.prompt_embeds:
            return []
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        return list(prompt)  # type: ignore[arg-type]

    def embedded_prompts(self) -> list[str]:
        """prompt_embeds as a list (each base64 of one tensor)."""
        given = self.prompt_embeds
        return [given] if isinstance(given, str) else list(given or [])

    @property
    def echo_only(self) -> bool:
        """vLLM: echo with max_tokens 0 scores the prompt and generates nothing."""
        return self.echo and self.max_tokens == 0

    def check_supported(self) -> None:
        if self.prompt_embeds is not None:
            # Rows have no text to fill around or print, and no tokens to score.
            for name in ("suffix", "echo"):
                if getattr(self, name):
                    raise InvalidRequestError(f"{name} cannot be combined with prompt_embeds", name)
        if self.suffix and self.echo:
            # The prompt that ran is the model's fill-in-the-middle form, not the one sent.
            raise InvalidRequestError("suffix cannot be combined with echo", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported by this server", "best_of")


class PredictionText(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a file being
    edited); speculative drafts come from it (core/predicted_output.py)."""

    type: Literal["content"]
    content: str | list[PredictionText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: TokenLimit = None
    max_completion_tokens: TokenLimit = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: the answer continues the last (assistant) message; add_generation_prompt off.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: this request's own template (its text), behind --trust-request-chat-template.
    chat_template: str | None = None
    # vLLM's: retrieved texts for a RAG template (Command-R's, Granite's) to write in.
    documents: list[dict[str, str]] | None = None
    prediction: Prediction | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # Turns the chat template's thinking switch (chat/reasoning.py, docs/reasoning.md).
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: at most this many tokens of thinking, then the thinking is closed for it.
    thinking_token_budget: int | None = None

    @property
    def token_limit(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) or max_tokens; None: no limit."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, defaults: SamplingDefaults) -> SamplingParams:
        """`defaults`: the model's, for the sampling fields the request leaves unset."""
        limit = self.token_limit
        try:
            return self.to_sampling_params(
                ALL_THE_CONTEXT if limit is None else limit, self.requested_logprobs(), defaults
            )
        except InvalidRequestError as error:
            # Name the field as this request spelled it, not as SamplingParams does.
            spelled = {
                "max_tokens": "max_completion_tokens"
                if self.max_completion_tokens is not None
                else "max_tokens",
                "logprobs": "top_logprobs",
            }
            error.param = spelled.get(error.param or "", error.param)
            raise


# ---- responses ------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    # OpenAI's names for guessed tokens (its Predicted Outputs); here, speculative drafts
    # the model confirmed and drafts it turned down.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0  # a thinking model's tokens up to the end of its thinking


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(
        default_factory=CompletionTokensDetails
    )

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        draft_tokens: int = 0,
        accepted_tokens: int = 0,
    ) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=CompletionTokensDetails(
                accepted_prediction_tokens=accepted_tokens,
                rejected_prediction_tokens=draft_tokens - accepted_tokens,
            ),
        )


def _only_when_asked() -> Any:
    """A vLLM field that a request asks for (prompt_logprobs, return_token_ids): left out
    of other answers, rather than a null in every one."""
    return Field(default=None, exclude_if=lambda value: value is None)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's logprob at a prompt position, its rank in the model's
    distribution there (1: the most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One per prompt token, the first None (nothing comes before it): the token itself and the
# top-n at that position, keyed by token id (JSON object keys, hence strings).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string, or the `stop_token_ids` token, that ended the choice.
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = _only_when_asked()
    prompt_token_ids: list[int] | None = _only_when_asked()  # a stream's first chunk only
    token_ids: list[int] | None = _only_when_asked()  # the answer's (a stream: the chunk's)


ChoiceT = TypeVar("ChoiceT")


class _ChoicesResponse(BaseModel, Generic[ChoiceT]):
    """The envelope every generation answer shares (a whole response or a stream chunk);
    subclasses fix `object` to their own literal."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChoiceT]
    usage: UsageInfo | None = None


class CompletionResponse(_ChoicesResponse[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # A thinking model's thinking (vLLM's field); left out where there is none.
    reasoning_content: str | None = None
    # Left out of an answer without calls, as OpenAI does: the SDK then reads None, and
    # `[]` (vLLM's) breaks clients that loop `while message.tool_calls is not None` and
    # templates that assert on the calls of a replayed message (vLLM #44104, #13978).
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: Any) -> dict[str, Any]:
        message: dict[str, Any] = handler(self)
        if not message.get("tool_calls"):
            message.pop("tool_calls", None)
        if message.get("reasoning_content") is None:
            message.pop("reasoning_content", None)
        return message


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # as CompletionChoice's
    token_ids: list[int] | None = _only_when_asked()  # as CompletionChoice's


class ChatCompletionResponse(_ChoicesResponse[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    # vLLM's, once for the choices' one prompt (completions has them per choice).
    prompt_logprobs: PromptLogprobs | None = _only_when_asked()
    prompt_token_ids: list[int] | None = _only_when_asked()


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # A delta carries only what changed: {"content": "x"}, not {"role": null, ...}.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # as CompletionChoice's
    token_ids: list[int] | None = _only_when_asked()  # the chunk's


class ChatCompletionChunk(_ChoicesResponse[ChatStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    prompt_token_ids: list[int] | None = _only_when_asked()  # the first chunk's


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "iterserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ResetPrefixCacheResponse(BaseModel):
    status: Literal["ok"] = "ok"
    num_blocks_dropped: int  # cached blocks forgotten; blocks in use keep their names
