"""The step being composed by the scheduler: tokens per request and the budget left."""

from __future__ import annotations

from iterserve.core.kv_reuse import KVCopy
from iterserve.core.request import Request

# Prompt positions scored for prompt logprobs in one step, at most: each is a float32
# row of logits the size of the vocabulary (512 x 49152 is 100 MB, 512 x 128256 is
# 263 MB), so a long prompt asking for them is cut into chunks of this many tokens
# whatever the step's token budget (with chunked prefill on).
MAX_SCORED_PROMPT_ROWS = 512


class StepPlan:
    """The step being composed: tokens per request and the budget left."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.tokens: dict[Request, int] = {}
        self.drafts: dict[Request, list[int]] = {}  # speculating decodes' guesses
        self.preempted: list[Request] = []
        self.num_long_prefills = 0
        self.num_scored_prompt_rows = 0  # prefill tokens of requests asking prompt logprobs
        # Cached K/V copied into admitted requests before the step's forward (--cache-reuse),
        # and the source blocks held until the plan is done (core/kv_reuse.py).
        self.kv_copies: dict[Request, list[KVCopy]] = {}
        self.held_blocks: list[int] = []

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens.values())

    def scored_prompt_room(self, request: Request) -> int | None:
        """How many prefill tokens `request` may take for prompt logprobs this step
        (None: it asks for none)."""
        if request.sampling_params.prompt_logprobs is None:
            return None
        return MAX_SCORED_PROMPT_ROWS - self.num_scored_prompt_rows

    def add(self, request: Request, n: int) -> None:
        self.tokens[request] = n
        self.budget -= n

    def remove(self, request: Request) -> None:
        self.budget += self.tokens.pop(request, 0)
        self.drafts.pop(request, None)
        self.kv_copies.pop(request, None)

    def real(self, request: Request, n: int) -> int:
        """Of a request's n tokens in this step, those that are not drafts."""
        return n - len(self.drafts.get(request, ()))
