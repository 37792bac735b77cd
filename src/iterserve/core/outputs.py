"""The dataclasses that cross the boundaries of one engine step:

Scheduler.schedule() -> SchedulerOutput -> Executor.execute() -> ModelOutput
-> Scheduler.update() -> list[RequestUpdate]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from iterserve.core.kv_reuse import KVCopy
from iterserve.core.logprobs import TokenLogprobs
from iterserve.core.request import FinishReason, PromptEmbeds
from iterserve.pooling_params import PoolingType
from iterserve.sampling_params import SamplingParams

# A token id the scheduler does not know yet: the sample of the step in flight, written in
# by the executor's pipeline (ScheduledSeq.last_token_in_flight) before the step runs.
IN_FLIGHT_TOKEN = -1


@dataclass
class TokenContext:
    """What sampling controls that look back read (penalties, min_tokens, bad_words):
    the request's tokens before this step's samples, from the scheduler's own record,
    so a preemption's recompute or rejected drafts can never leave it out of date."""

    prompt_token_ids: Sequence[int]  # the whole prompt, prefix-cached blocks' tokens too
    output_token_ids: list[int]
    stop_token_ids: tuple[int, ...]  # what min_tokens holds back: EOS and stop_token_ids
    bad_words_token_ids: list[list[int]]


@dataclass
class ScheduledSeq:
    """One request's share of a step: compute `token_ids` at positions
    `num_computed_tokens`..., and sample the next token if `sample`.

    A speculating request's `token_ids` end with its `draft_token_ids`, guesses of the
    tokens after its last one: the executor samples at the last token and at every
    draft, and returns the drafts up to the first its own sample disagrees with, plus
    that sample (so 1 to 1 + len(draft_token_ids) tokens)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: tuple[int, ...]  # the request's block table as it stands for this step
    sample: bool
    sampling_params: SamplingParams
    draft_token_ids: list[int] = field(default_factory=list)
    # Set when the sampling params look back at the tokens so far (else None: free).
    context: TokenContext | None = None
    # Prompt logprobs: the prompt tokens this step scores, in order. The logits at position
    # p give token p + 1's logprob, so these are scored by the rows of the positions just
    # before them, which end the step's new tokens (or precede its sample when it has one).
    scored_prompt_token_ids: list[int] = field(default_factory=list)
    # Asynchronous scheduling: the last of `token_ids` (before any drafts) is IN_FLIGHT_TOKEN,
    # the token the step still running samples for this request; it, and `context`, get
    # it written in before this step runs (engine/step_pipeline.py).
    last_token_in_flight: bool = False
    # An embedding request's chunk (it never samples): how its states are pooled, and
    # whether this chunk ends its prompt, so the step hands back its vector.
    pooling: PoolingType | None = None
    pool_now: bool = False
    score: bool = False  # the pool goes through the model's score head (reranker, classifier)
    # Its LoRA adapter (0: the base model) and the model's slot holding it (-1: none).
    lora_id: int = 0
    lora_slot: int = -1
    # Cached K/V the executor copies into the request's blocks before the step's forward
    # (--cache-reuse: core/kv_reuse.py); positions its computing will pass over.
    kv_copies: tuple[KVCopy, ...] = ()
    # Prompt positions given as input rows (Request.prompt_embeds): the executor writes
    # the rows of this step's positions in place of their tokens' embeddings.
    prompt_embeds: PromptEmbeds | None = None
    # How far the rotary positions of its text tokens are from their positions
    # (PromptEmbeds.rope_shift: after Qwen-VL's images); the same for each of them, unless
    # `prompt_embeds` places grid tokens in this step (PromptEmbeds.grid_positions).
    rope_shift: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_samples(self) -> int:
        """Positions the executor samples at: the last token's and every draft's."""
        return 1 + len(self.draft_token_ids) if self.sample else 0

    @property
    def num_logits(self) -> int:
        """Logit rows the step needs: the prompt-scoring ones, then the samples'."""
        return len(self.scored_prompt_token_ids) + self.num_samples


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_draft_tokens: int = 0  # speculative tokens (counted in neither of the above)
    # Requests gone since the last step, so executors can drop per-request state.
    finished_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_draft_tokens

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None  # when the request asked for logprobs


@dataclass
class ModelOutput:
    # Per request that sampled: the tokens the step produced, in order (one, or with
    # speculation the accepted drafts and then the target's own next token).
    sampled: dict[str, list[SampledToken]]
    # Seconds the network's forward took (the rest of a step is scheduling, batch and
    # metadata building, sampling, detokenizing): what engine stats report it against.
    forward_time: float = 0.0
    # Per request that scored prompt tokens: their logprobs, in order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per embedding request whose prompt this step finished: its pooled vector (raw: the
    # engine normalizes and truncates, engine/pooling.py); a scoring or classifying request's:
    # the head's logits.
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """What one step did for one request, for the engine to detokenize and emit."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None = None  # set when this step ended the request
    embedding: list[float] | None = None  # an embedding request's pooled vector, at its end

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
