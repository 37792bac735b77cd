"""What a request asks of the sampler and of the stopping rules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

# Defined apart so that structured_output.py, which SamplingParams carries, can raise it.
from iterserve.invalid_request import InvalidRequestError

if TYPE_CHECKING:
    from iterserve.structured_output import StructuredOutput


@dataclass
class SamplingParams:
    """Sampling and stopping settings for one request (vLLM/OpenAI semantics).

    `top_k <= 0` disables top-k, `top_p == 1` disables nucleus sampling,
    `min_p == 0` disables min-p, `temperature == 0` means greedy.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Opt out of speculative decoding when the engine runs it (the output is the same
    # either way; a request may prefer steady token timing to bursts of accepted drafts).
    speculative: bool = True
    # Output constrained to a JSON schema, regex, choice or grammar (structured_output.py).
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.structured_output is not None:
            # Constrained requests do not speculate: drafts would have to be checked
            # against the grammar (docs/structured_output.md).
            self.speculative = False
        self.validate()

    def per_choice(self) -> list[SamplingParams]:
        """The engine runs one sequence per request: n choices are n requests with
        n=1, seeded seed, seed+1, ... so each is reproducible and they differ."""
        return [
            replace(self, n=1, seed=None if self.seed is None else self.seed + index)
            for index in range(self.n)
        ]

    def validate(self) -> None:
        if self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}", "n")
        if self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens"
            )
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):  # NaN slips past every range test
                raise InvalidRequestError(f"{name} must be a finite number", name)
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}",
                "top_k",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be between 0 and 20, got {self.logprobs}", "logprobs"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        if self.structured_output is not None and self.ignore_eos:
            raise InvalidRequestError(
                "ignore_eos cannot be combined with structured output: a complete output "
                "ends with EOS",
                "ignore_eos",
            )
