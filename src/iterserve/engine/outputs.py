"""What the engine hands back for a request after each step, and vLLM's view of it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from iterserve.core.logprobs import Logprob
from iterserve.core.outputs import SchedulerOutput, TokenLogprobs
from iterserve.core.request import FinishReason, RequestTimings


@dataclass(frozen=True)
class CompletionOutput:
    """One choice of a request as vLLM's `CompletionOutput` (`RequestOutput.outputs`)."""

    index: int
    text: str
    token_ids: list[int]
    # The sum of the sampled tokens' logprobs, where the request asked for logprobs (None
    # otherwise, as in vLLM).
    cumulative_logprob: float | None
    # Per sampled token: the token and its top-n candidates, token id -> Logprob.
    logprobs: list[Mapping[int, Logprob]] | None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EmbeddingOutput:
    """vLLM's `EmbeddingOutput` (`LLM.embed`'s `outputs`)."""

    embedding: list[float]


@dataclass(frozen=True)
class ScoringOutput:
    """vLLM's `ScoringOutput` (`LLM.score`'s `outputs`)."""

    score: float


@dataclass(frozen=True)
class ClassificationOutput:
    """vLLM's `ClassificationOutput` (`LLM.classify`'s `outputs`)."""

    probs: list[float]


PoolingOutput = EmbeddingOutput | ScoringOutput | ClassificationOutput


@dataclass
class RequestOutput:
    """The state of one request after a step: cumulative text and tokens, and
    what this step added (the deltas a streaming client sends on)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: FinishReason | None = None  # set once finished
    # What ended it, as vLLM's `stop_reason`: the stop string that matched, or the token of
    # `stop_token_ids` sampled; None for EOS, length, or an answer still going.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs | None] | None = None  # when the request asked for them
    delta_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one per prompt token (the first None), as far as the
    # prefill has come (complete once the first token is out).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    # Speculative decoding: draft tokens proposed for this request so far, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    timings: RequestTimings | None = None
    # LLM.chat with tools: the answer's calls in OpenAI's shape ([] for none) and its
    # content without them (None: all calls); both None when nothing was parsed.
    tool_calls: list[dict[str, Any]] | None = None
    content: str | None = None
    # LLM.chat with a thinking model: its thinking (None: none), and `content` is then
    # what follows it (chat/offline_chat.py).
    reasoning_content: str | None = None
    # An embedding request's vector, once finished (LLMEngine.add_request with pooling).
    embedding: list[float] | None = None
    # A scoring request's relevance in (0, 1), once finished (a reranker's score head).
    score: float | None = None
    # A classifying request's labels' probabilities (the engine's `pooling.labels` order).
    probs: list[float] | None = None
    # The LoRA adapter it ran (None: the base model), for per-adapter metrics.
    lora_name: str | None = None
    # vLLM's `prompt`: the prompt's text, where LLM.generate or LLM.chat was given text.
    prompt: str | None = None
    # The n choices of one prompt, LLM.generate's grouping as vLLM's (this output is the
    # first of them); None: this request alone.
    choices: list[RequestOutput] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput] | PoolingOutput:
        """vLLM's view: a generation's completions, one per choice (`outputs[0].text`); a
        pooling request's result as vLLM's embed, score and classify give it
        (`outputs.embedding`, `outputs.score`, `outputs.probs`)."""
        if self.embedding is not None:
            return EmbeddingOutput(self.embedding)
        if self.score is not None:
            return ScoringOutput(self.score)
        if self.probs is not None:
            return ClassificationOutput(self.probs)
        return [choice.completion(index) for index, choice in enumerate(self.choices or [self])]

    def completion(self, index: int = 0) -> CompletionOutput:
        """This request's answer as vLLM's `CompletionOutput`, choice `index`."""
        logprobs = None
        cumulative = None
        if self.logprobs is not None:
            logprobs = [entry if entry is not None else {} for entry in self.logprobs]
            cumulative = sum(entry.logprob for entry in self.logprobs if entry is not None)
        return CompletionOutput(
            index=index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class EngineStep:
    """What one `LLMEngine.step` did."""

    outputs: list[RequestOutput]
    did_work: bool  # whether any token was computed (False: nothing was runnable yet)
    # What the step ran, for tools that price or log steps (bench fidelity).
    scheduled: SchedulerOutput | None = None
