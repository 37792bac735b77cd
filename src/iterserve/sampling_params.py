"""What a request asks of the sampler and of the stopping rules."""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field, replace
from typing import TYPE_CHECKING

# Defined apart so that structured_output.py, which SamplingParams carries, can raise it.
from iterserve.invalid_request import InvalidRequestError
from iterserve.prompt_truncation import PromptTruncation
from iterserve.thinking_budget import ThinkingBudget

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
    # llama.cpp's sampler order (its default `samplers`, temperature last): top-k, top-p
    # and min-p judge the untempered distribution, and the temperature shapes only what
    # they keep. False: vLLM's, where they judge the tempered one.
    temperature_last: bool = False
    # llama.cpp's infill sampler after top-k, top-p and min-p (sample/infill_filter.py; an
    # editor's /infill naming `infill` in its `samplers`): on when these, its
    # end-of-generation tokens, are given, the first the answer when nothing else is left.
    infill_eog: tuple[int, ...] = ()
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # vLLM's: the stop string that matched, or the stop token's text (EOS's, shown only
    # where special tokens are), ends the output instead of being cut from it.
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Logprobs of the prompt's tokens (the first has none), top-n as for `logprobs`.
    prompt_logprobs: int | None = None
    # vLLM's truncate_prompt_tokens: the prompt cut to its last (or first) tokens.
    truncation: PromptTruncation | None = None
    # vLLM's: False leaves the answer's text empty (its token ids only; no stop strings).
    detokenize: bool = True
    # Controls that reshape the logits before sampling (sample/logits_controls.py): the
    # penalties with vLLM's semantics (presence/frequency over the output so far,
    # repetition over prompt + output), OpenAI's logit_bias (token id -> bias), a minimum
    # output length (EOS and stop_token_ids masked until then), and vLLM's bad_words.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # llama.cpp's penalty window (repeat_last_n): all three penalties count the last N
    # tokens of the prompt and output together. None: vLLM's rule above.
    penalty_last_n: int | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    # vLLM's: the only tokens that may be drawn (None: any).
    allowed_token_ids: list[int] | None = None
    # Derived by validate(), read every step for every row (plain attributes: a property
    # testing six fields costs ~1 us a row, 0.25 ms a step at batch 256). Whether sampling
    # reads the request's tokens so far (penalties, min_tokens, bad_words; the scheduler
    # sends them with such requests only), and whether any control reshapes the logits.
    uses_token_history: bool = field(default=False, init=False, repr=False, compare=False)
    adjusts_logits: bool = field(default=False, init=False, repr=False, compare=False)
    # Opt out of speculative decoding when the engine runs it (the output is the same
    # either way; a request may prefer steady token timing to bursts of accepted drafts).
    speculative: bool = True
    # OpenAI's Predicted Outputs: tokens the answer is expected to repeat (a file being
    # edited), where speculative drafts come from first when the engine speculates with
    # n-grams (core/predicted_output.py). Like every draft, it never changes the output.
    prediction: tuple[int, ...] | None = None
    # Output constrained to a JSON schema, regex, choice or grammar (structured_output.py).
    structured_output: StructuredOutput | None = None
    # A thinking model's thinking capped in tokens (thinking_budget.py); set by the server
    # from its markers (chat/reasoning.py), as the request's `thinking_token_budget` asks.
    thinking_budget: ThinkingBudget | None = None
    # vLLM's keyword for `truncation`: keep the prompt's last N tokens (-1: as many as the
    # model's context holds).
    truncate_prompt_tokens: InitVar[int | None] = None

    def __post_init__(self, truncate_prompt_tokens: int | None) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if truncate_prompt_tokens is not None:
            if self.truncation is not None:
                raise InvalidRequestError(
                    "give truncate_prompt_tokens or truncation, not both", "truncate_prompt_tokens"
                )
            self.truncation = PromptTruncation(truncate_prompt_tokens)
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
        names = ("temperature", "top_p", "min_p", *_PENALTY_RANGES)
        for name in names:
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
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings need detokenize=True", "detokenize")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError(
                f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}",
                "prompt_logprobs",
            )
        if self.structured_output is not None and self.ignore_eos:
            raise InvalidRequestError(
                "ignore_eos cannot be combined with structured output: a complete output "
                "ends with EOS",
                "ignore_eos",
            )
        if self.structured_output is not None and self.allowed_token_ids is not None:
            # The grammar's next token may be none of them: no token would be left.
            raise InvalidRequestError(
                "allowed_token_ids cannot be combined with structured output",
                "allowed_token_ids",
            )
        if self.structured_output is not None and self.min_tokens:
            # A grammar that completes before min_tokens would leave no token to sample.
            raise InvalidRequestError(
                "min_tokens cannot be combined with structured output: a complete output "
                "ends with EOS, which min_tokens holds back",
                "min_tokens",
            )
        if self.penalty_last_n is not None and self.penalty_last_n < 1:
            raise InvalidRequestError(
                f"penalty_last_n must be at least 1, got {self.penalty_last_n}",
                "penalty_last_n",
            )
        self._validate_logit_controls()
        self.uses_token_history = bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.bad_words
            or self.thinking_budget is not None
        )
        self.adjusts_logits = (
            self.uses_token_history or bool(self.logit_bias) or self.allowed_token_ids is not None
        )

    def _validate_logit_controls(self) -> None:
        for name, (low, high) in _PENALTY_RANGES.items():
            value = getattr(self, name)
            if not low <= value <= high or (name == "repetition_penalty" and value == 0):
                raise InvalidRequestError(
                    f"{name} must be in {_describe_range(name, low, high)}, got {value}", name
                )
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}",
                    "logit_bias",
                )
            if not -100.0 <= bias <= 100.0:  # also refuses NaN
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}",
                    "logit_bias",
                )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                "min_tokens",
            )
        if any(not word.strip() for word in self.bad_words):
            raise InvalidRequestError("bad_words must not hold empty words", "bad_words")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError(
                "allowed_token_ids must name at least one token", "allowed_token_ids"
            )


# vLLM's ranges; repetition_penalty excludes 0 as well (it divides by it).
_PENALTY_RANGES = {
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, math.inf),
}


def _describe_range(name: str, low: float, high: float) -> str:
    return "(0, inf)" if name == "repetition_penalty" else f"[{low}, {high}]"
