"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.core.outputs import SchedulerOutput, TokenLogprobs
from iterserve.core.request import FinishReason, RequestTimings


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStep:
    """What one `LLMEngine.step` did."""

    outputs: list[RequestOutput]
    did_work: bool  # whether any token was computed (False: nothing was runnable yet)
    # What the step ran, for tools that price or log steps (bench fidelity).
    scheduled: SchedulerOutput | None = None
