"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.core.request import RequestTimings


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
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    logprobs: list[Any] | None = None  # the sampler's TokenLogprobs, when asked for
    delta_logprobs: list[Any] = field(default_factory=list)
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStep:
    """What one `LLMEngine.step` did."""

    outputs: list[RequestOutput]
    did_work: bool  # whether any token was computed (False: nothing was runnable yet)
