"""A request as the scheduler sees it: tokens, progress, blocks, status, timings.

There are no prefill and decode phases here: a request simply has `num_tokens`
(prompt + generated so far) of which `num_computed_tokens` are in the KV cache.
Prefill is the catch-up of many tokens, decode the catch-up of one.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from iterserve.core.logprobs import TokenLogprobs
from iterserve.pooling_params import PoolingParams
from iterserve.sampling_params import SamplingParams

# The embed lane holds embedding requests, and only them (Scheduler.add_request); it comes
# last, so its requests give way first when memory is short (policies.victim_key).
LANES = ("interactive", "batch", "embed")
EMBED_LANE = "embed"
# Why a request ended, in the OpenAI API's words.
FinishReason = Literal["stop", "length", "abort"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """The reason a finished status reports; None while the request runs or waits."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestTimings:
    """Wall-clock (or virtual-clock) instants, in seconds, set by the scheduler."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    # A float array, not a list: 8 bytes a token rather than ~32, and numpy reads it
    # without a copy (a simulated million requests make ~2e8 of them).
    token_times: array[float] = field(default_factory=lambda: array("d"))
    finished: float | None = None


@dataclass(frozen=True, eq=False)
class PromptEmbeds:
    """Prompt positions given as the model's input rows rather than tokens: a whole prompt
    (vLLM's prompt_embeds) or an image's positions within one (engine/images.py). The
    executor writes `rows` (a [positions, hidden] tensor the engine made; opaque here) where
    the layers would read those positions' token embeddings; their token ids are
    placeholders. `spans` are the positions, as (first, count) runs in order, the rows
    concatenated in that order; none means the whole prompt. `key` names the rows' content:
    the prefix cache mixes it into the name of the block holding the first given position
    (core/kv_cache.py), so only the same rows can share that block and those after it."""

    rows: Any
    key: bytes
    spans: tuple[tuple[int, int], ...] = ()
    # Each span's positions attend to each other both ways (Gemma 3's images), not causally:
    # a prompt chunk never ends inside one (core/scheduler.py), and its rows' attention
    # sees the whole span (model/attention_metadata.py).
    bidirectional: bool = False
    # Each span's (rows, columns) where its positions turn as a grid (M-RoPE: Qwen-VL's
    # images): the token at row r, column c of a span whose first rotary position is p
    # turns by (p, p + r, p + c), one position a rotary component (time, height, width),
    # and the text after it goes on from p + max(rows, columns), not p + rows x columns.
    # Empty: every position turns by itself, as text does.
    grids: tuple[tuple[int, int], ...] = ()

    @property
    def first_position(self) -> int:
        return self.spans[0][0] if self.spans else 0

    @property
    def whole_prompt(self) -> bool:
        """The rows are the prompt: there are no tokens of its own (penalties, echo)."""
        return not self.spans

    def pieces(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """The given rows among positions start..start+count-1, as (offset from `start`,
        first row, rows) runs."""
        found: list[tuple[int, int, int]] = []
        row = 0
        for first, length in self.spans or ((0, len(self.rows)),):
            lo, hi = max(first, start), min(first + length, start + count)
            if lo < hi:
                found.append((lo - start, row + lo - first, hi - lo))
            row += length
        return found

    def rope_shift(self, position: int) -> int:
        """How far the rotary position of a text token at `position` is from it: what the
        grids before it saved (0 without grids)."""
        return sum(
            max(grid) - count
            for (first, count), grid in self._gridded()
            if first + count <= position
        )

    def grid_positions(self, start: int, count: int) -> list[tuple[int, int, int]] | None:
        """The rotary positions (time, height, width) of positions start..start+count-1
        where a grid's tokens are among them; None where none are (the text's positions
        are then each shifted by `rope_shift`)."""
        end = start + count
        if not any(first < end and first + n > start for (first, n), _ in self._gridded()):
            return None
        found: list[tuple[int, int, int]] = []
        for position in range(start, end):
            shift = self.rope_shift(position)
            for (first, n), (_, columns) in self._gridded():
                if first <= position < first + n:
                    at = first + shift  # the grid's first rotary position
                    row, column = divmod(position - first, columns)
                    found.append((at, at + row, at + column))
                    break
            else:
                found.append((position + shift,) * 3)
        return found

    def _gridded(self) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
        """Each span with its grid (none without grids)."""
        return zip(self.spans, self.grids, strict=True) if self.grids else iter(())


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    lane: str = "interactive"
    priority: int = 0
    # The LoRA adapter its rows run (core/lora.py): 0 and None for the base model.
    lora_id: int = 0
    lora_name: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens of the prompt found in the prefix cache when the request was first admitted.
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Hash chain of its full KV blocks (core/kv_cache.py), as far as the block pool has
    # needed it: the pool extends it. A caller that knows every token ahead (the
    # simulator: its executor samples one known token) may fill it in advance, with the
    # pool's own hash function; tokens dropped (a stop string) end the request, so its
    # chain never covers tokens it lost.
    block_hashes: list[bytes | int] = field(default_factory=list)
    # Cached K/V reused at shifted positions (core/kv_reuse.py): its K/V is no longer exact
    # from position `exact_upto` (so not what a prompt's name promises), and its chain
    # restarts from `chain_break` at the block holding that position.
    exact_upto: int = 2**62
    chain_break: bytes | int | None = None
    # Runs of its prompt (start, length) whose K/V was copied in and that its computing
    # has not reached yet: it passes over each when it gets there (Scheduler._pass_reused).
    reused_spans: list[tuple[int, int]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Output length when last preempted: a request is not preempted for another's
    # sake again until it has produced more, so two requests cannot thrash.
    outputs_at_preemption: int = -1
    # Order of the latest admission to the running set: the newest gives way first.
    admission_seq: int = -1
    # Tokens sampled by planned steps and not yet applied (update() fills them in): 1
    # between a step's schedule() and update(), 2 while asynchronous scheduling plans a
    # step on top of one in flight. num_computed_tokens already counts the planned steps.
    num_output_placeholders: int = 0
    # Speculative decoding: draft tokens proposed for this request, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # vLLM's bad_words as token sequences (the engine tokenizes them).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Logprobs of prompt tokens 1, 2, ... as far as they are scored
    # (SamplingParams.prompt_logprobs; the first token has none).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # An embedding request: prefill only, its prompt's states pooled into one vector.
    pooling_params: PoolingParams | None = None
    # A prompt given as input rows (its prompt_token_ids are then placeholders).
    prompt_embeds: PromptEmbeds | None = None
    timings: RequestTimings = field(init=False)

    def __post_init__(self) -> None:
        self.timings = RequestTimings(arrival=self.arrival_time)
        # One list for prompt + output so a step can slice it without concatenating.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def chain_key(self) -> tuple[int, bytes] | None:
        """What its blocks' names mix in besides their tokens and adapter: the content of
        the rows its prompt was given as, from the block holding the first of them on
        (core/kv_cache.py keyed_parent); None for a prompt of tokens."""
        embeds = self.prompt_embeds
        return None if embeds is None else (embeds.first_position, embeds.key)

    @property
    def is_embedding(self) -> bool:
        return self.pooling_params is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens, known or planned, not yet counted as computed: 1 for a decode."""
        return self.num_tokens + self.num_output_placeholders - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens the request may hold at most when it finishes by length."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def num_unscored_prompt_positions(self) -> int:
        """Positions before the first whose logits still owe a prompt logprob: the
        prefix cache may serve these, the rest must be computed (and scored)."""
        scored = len(self.prompt_logprobs)
        if self.sampling_params.prompt_logprobs is None or scored >= self.num_prompt_tokens - 1:
            return self.num_tokens  # none owed (any more: a preempted request's recompute)
        return scored

    def prompt_tokens_to_score(self, start: int, num_new: int) -> list[int]:
        """The prompt tokens whose logprobs a step computing positions start..start+num_new
        yields: the logits at position p score token p + 1."""
        if self.sampling_params.prompt_logprobs is None:
            return []
        first = max(start, len(self.prompt_logprobs))
        end = min(start + num_new, self.num_prompt_tokens - 1)
        return self.prompt_token_ids[first + 1 : end + 1]

    def append_output_tokens(self, token_ids: list[int], times: Sequence[float]) -> None:
        """Tokens made, and when each was: one a step (Scheduler.update) or several at once
        (a decode the simulator's cohort advanced in aggregate, catching up)."""
        self.output_token_ids += token_ids
        self.all_token_ids += token_ids
        self.timings.token_times.extend(times)

    def drop_output_tokens(self, n: int) -> None:
        """Forget the last n output tokens (and their timings)."""
        if n > 0:
            del self.output_token_ids[-n:]
            del self.all_token_ids[-n:]
            del self.timings.token_times[-n:]
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)
