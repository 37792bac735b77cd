"""The step plan: which requests compute how many tokens this iteration.

Every request has `num_tokens` (prompt + generated) and `num_computed_tokens`
(in the KV cache); a step lets some of them catch up, within a token budget.
A request one token behind is a decode; more than one behind, a prefill
(a prompt, the rest of a chunked prompt, or a preempted request recomputing).

A step is composed in two phases:
  decodes   every running request one token behind, in admission order;
  prefills  running partial prefills, then (continuous batching) waiting
            requests, interactive lane before batch lane, under the budget
            left, with a share of it (and of the seats) reserved for the
            batch lane while it waits.
`mixed` runs both phases in one step (decodes first, Sarathi-Serve / vLLM V1);
`prefill-first` runs prefills alone whenever there are any (ORCA / vLLM V0).

When the KV pool runs dry, a running request is preempted by recompute: its
blocks are freed, its tokens kept, and it waits to be prefilled again.

schedule() counts a planned step's tokens as computed at once, and each token it will
sample as a placeholder (Request.num_output_placeholders) that update() fills in. So
the next step can be planned before this one's samples are known (asynchronous
scheduling, engine/engine_core.py): a decode whose last token is still being sampled
takes it as ScheduledSeq.last_token_in_flight, and the executor writes it in.

A subclass may hold some running requests aside, outside `running`, and advance them
itself (the simulator's decode cohort, sim/cohort_scheduler.py); the `_held` methods are
where it hooks in, and do nothing here.
"""

from __future__ import annotations

import enum
import math
import os
import time
from collections.abc import Callable

from iterserve.config import SchedulerConfig, SpeculativeConfig
from iterserve.core.kv_cache import KVCacheManager, KVCacheStats
from iterserve.core.kv_reuse import CacheReuse, ReusePlan, past_copied
from iterserve.core.lora import LoRASlots
from iterserve.core.outputs import (
    IN_FLIGHT_TOKEN,
    ModelOutput,
    RequestUpdate,
    SampledToken,
    ScheduledSeq,
    SchedulerOutput,
    TokenContext,
)
from iterserve.core.policies import WaitingQueues, form_batch, outranks, victim_key
from iterserve.core.request import EMBED_LANE, LANES, PromptEmbeds, Request, RequestStatus
from iterserve.core.speculation import DraftQuery, NgramProposer, Proposer, SpecDecodeStats
from iterserve.core.step_plan import StepPlan
from iterserve.invalid_request import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        speculative: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,
        max_loras: int = 1,
        cache_reuse: int = 0,
    ) -> None:
        """`proposer`: where speculative drafts come from when `speculative` is on (default:
        n-gram prompt lookup; the engine passes a draft model's). `max_loras`: LoRA adapters
        resident at once (core/lora.py), so at most that many in a step. `cache_reuse`: the
        shortest run of a recent sequence's K/V a prompt copies at a shifted position (0:
        none; core/kv_reuse.py)."""
        self.config = config
        self.speculative = speculative or SpeculativeConfig()
        if self.speculative.enabled and proposer is None:
            proposer = NgramProposer(self.speculative.ngram_min, self.speculative.ngram_max)
        self.proposer = proposer if self.speculative.enabled else None
        self.spec_stats = SpecDecodeStats()
        self.kv = kv
        self.reuse = CacheReuse(kv, cache_reuse) if cache_reuse else None
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting = WaitingQueues()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.lora_slots = LoRASlots(max_loras)
        self._admissions = 0
        self.num_preemptions = 0
        # Tokens computed for requests that had ended by the time their step's results came
        # (asynchronous scheduling plans a step before the last one's stop is known).
        self.num_discarded_tokens = 0
        # Check the block pool after every update: slow, for debugging and tests.
        self._debug_invariants = os.environ.get("ITERSERVE_DEBUG_INVARIANTS", "0") not in ("", "0")

    # ---- requests in and out -------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse at once a request that could never finish."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            # OpenAI's and vLLM's wording, which clients recognise.
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({num_prompt_tokens} in the prompt + "
                f"{max_tokens} max_tokens); shorten the prompt or lower max_tokens",
                "max_tokens" if num_prompt_tokens < self.max_model_len else "prompt",
                CONTEXT_LENGTH_EXCEEDED,
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and total > budget:
            # Unchunked, a prompt (and, after a preemption, its output too) is computed
            # in one step; a request over the step budget would wait forever.
            raise InvalidRequestError(
                f"with chunked prefill off, a request must fit one step's budget of {budget} "
                f"tokens but needs {total}; enable chunked prefill or raise "
                "--max-num-batched-tokens",
                "prompt",
            )
        blocks = self.kv.blocks_needed(total)
        if blocks > self.kv.num_blocks:
            raise InvalidRequestError(
                f"the request needs {blocks} KV cache blocks ({total} tokens) but the whole "
                f"cache holds {self.kv.num_blocks}; raise --kv-cache-memory or shorten it",
                "max_tokens",
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if request.lane not in LANES:
            raise InvalidRequestError(f"lane must be one of {LANES}, got {request.lane!r}", "lane")
        if request.is_embedding != (request.lane == EMBED_LANE):
            raise InvalidRequestError(
                f"the {EMBED_LANE} lane holds embedding requests, and every embedding request "
                "runs in it",
                "lane",
            )
        # An embedding request samples nothing: its prompt alone must fit.
        max_tokens = 0 if request.is_embedding else request.sampling_params.max_tokens
        self.check_fits(request.num_prompt_tokens, max_tokens)
        if not self.config.enable_lanes and not request.is_embedding:
            request.lane = "interactive"
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_request(
        self, request_id: str, status: RequestStatus, num_dropped: int = 0
    ) -> Request | None:
        """End a request (abort, stop string): frees its blocks now. Unknown ids are ignored.
        `num_dropped`: output tokens past the end (a stop string met inside a step's run of
        accepted drafts) that the request does not keep."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._unlist(request)  # (a held request catches up first, then drops what is past)
        request.drop_output_tokens(num_dropped)
        self._finish(request, status, self.clock())
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_running(self, lane: str | None = None) -> int:
        held = self._num_held(lane)
        return held + sum(1 for r in self.running if lane is None or r.lane == lane)

    def num_waiting(self, lane: str | None = None) -> int:
        return self.waiting.count(lane)

    def lora_ids(self) -> set[int]:
        """The LoRA adapters of the unfinished requests, waiting or running."""
        return {r.lora_id for r in self.requests.values()}

    def request_ids(self) -> list[str]:
        """Every request not yet finished, waiting or running."""
        return list(self.requests)

    # ---- memory, for callers outside the step ------------------------------------

    def kv_cache_stats(self) -> KVCacheStats:
        return self.kv.stats()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds; returns how many."""
        return self.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise KVCacheInvariantError if the block pool disagrees with the requests'
        block tables (see KVCacheManager.check_invariants)."""
        self.kv.check_invariants(self._block_tables())

    def token_capacity(self) -> int:
        """Most tokens one request can ever hold: the context length or the whole KV
        pool, whichever is less."""
        return min(self.max_model_len, self.kv.num_blocks * self.kv.block_size)

    # ---- one step --------------------------------------------------------------

    def schedule(self, no_more_arrivals: bool = False) -> SchedulerOutput:
        """Plan one step. `no_more_arrivals`: the caller knows no further request will
        come (an offline run past its last arrival), so static and dynamic batching may
        start a short batch now instead of waiting for it to fill."""
        now = self.clock()
        step = StepPlan(self.config.max_num_batched_tokens)
        if self.config.batching != "continuous" and not self.running:
            self._admit_batch(now, no_more_arrivals)
        self._schedule_held(step)
        if self.config.step_policy == "prefill-first":
            self._schedule_prefills(step, now)
            if not step.tokens:
                self._schedule_decodes(step)
        else:
            self._schedule_decodes(step)
            self._schedule_prefills(step, now)
        return self._output(step, now)

    def update(self, scheduled: SchedulerOutput, model_output: ModelOutput) -> list[RequestUpdate]:
        now = self.clock()
        updates: list[RequestUpdate] = []
        held_done = self._end_held_step(scheduled, now)
        for seq in scheduled.seqs:
            request = self.requests.get(seq.request_id)
            if request is None:
                # It ended (stop string, abort) after this step was planned: only a step
                # planned ahead of the last one's results computes for nothing like this.
                self.num_discarded_tokens += seq.num_new_tokens
                continue
            if held_done and request.status == RequestStatus.RUNNING:
                # Held requests finish where their decodes would have stood had they been
                # listed: among the step's decodes (first), in admission order (see
                # _output); the order frees their blocks, which decides later evictions.
                decode = seq.num_new_tokens - len(seq.draft_token_ids) == 1
                place = request.admission_seq if decode else math.inf
                while held_done and held_done[0].admission_seq < place:
                    updates.append(self._finish_held(held_done.pop(0), now))
            if seq.scored_prompt_token_ids:
                request.prompt_logprobs += model_output.prompt_logprobs[seq.request_id]
            if seq.pool_now:
                updates.append(
                    self._finish_pooled(request, model_output.pooled[seq.request_id], now)
                )
                continue
            if not seq.sample:
                if request.status == RequestStatus.RUNNING:
                    self.kv.cache_full_blocks(request)
                continue
            updates.append(
                self._take_samples(request, seq, model_output.sampled[seq.request_id], now)
            )
        updates += [self._finish_held(request, now) for request in held_done]
        if self._debug_invariants:
            self.check_invariants()
        return updates

    def _finish_pooled(self, request: Request, vector: list[float], now: float) -> RequestUpdate:
        """End an embedding request whose last prompt chunk ran: its vector is its output,
        its blocks go back to the pool now. (Planned ahead, it may have been preempted since:
        its vector was computed all the same.)"""
        self._unlist(request)
        request.timings.first_token = now
        self._finish(request, RequestStatus.FINISHED_STOPPED, now)
        return RequestUpdate(request.request_id, [], [], "stop", embedding=vector)

    def _take_samples(
        self, request: Request, seq: ScheduledSeq, sampled: list[SampledToken], now: float
    ) -> RequestUpdate:
        """Fill in the request's placeholder with the step's samples (with speculation, the
        accepted drafts and the target's next token) up to the first that ends it."""
        request.num_output_placeholders -= 1
        # Preempted while the step ran (planned ahead of it): its tokens still count, its
        # recompute will take them in.
        running = request.status == RequestStatus.RUNNING
        num_drafts = len(seq.draft_token_ids)
        if num_drafts:
            request.num_draft_tokens += num_drafts
            request.num_accepted_tokens += len(sampled) - 1
            self.spec_stats.record(num_drafts, len(sampled) - 1)
            # The K/V of the accepted drafts is written and right; a rejected draft's slot
            # lies past num_computed_tokens and is overwritten by the token that lands there.
            if running:
                request.num_computed_tokens -= num_drafts - (len(sampled) - 1)
        timings = request.timings
        if timings.first_token is None:
            timings.first_token = now
        status = None
        taken = 0
        while status is None and taken < len(sampled):
            token_id = sampled[taken].token_id
            request.append_output_tokens([token_id], [now])
            taken += 1
            status = self._stop_status(request, token_id)
        if running:
            # A stop inside an accepted run leaves computed drafts past the end: drop them.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            if seq.num_new_tokens > 1:
                # Prompt blocks are named as they are computed, so a request arriving
                # meanwhile finds them; a decode's blocks are named when released (_finish,
                # _preempt), which only a request's own recompute could have used sooner.
                self.kv.cache_full_blocks(request)
        if status is not None:
            (self.running if running else self.waiting).remove(request)
            self._finish(request, status, now)
        return RequestUpdate(
            request.request_id,
            [s.token_id for s in sampled[:taken]],
            [s.logprobs for s in sampled[:taken]],
            None if status is None else status.finish_reason,
        )

    def unplan(self, scheduled: SchedulerOutput) -> None:
        """Undo schedule()'s bookkeeping for a step that will never run (running it failed,
        or the step before it did), so its requests end, or run again, from where they
        stood; nothing of it is named in the prefix cache."""
        for seq in scheduled.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = seq.num_computed_tokens
            if seq.kv_copies:  # never made: computed from the first copy's place instead
                request.num_computed_tokens = min(seq.num_computed_tokens, seq.kv_copies[0].target)
                request.reused_spans.clear()
            request.num_output_placeholders -= seq.sample

    # ---- phases ----------------------------------------------------------------

    def _schedule_decodes(self, step: StepPlan) -> None:
        decodes = [
            r
            for r in self.running
            if r not in step.tokens
            and r.num_uncomputed_tokens == 1
            and not self._ends_planned(r)
            and not r.is_embedding  # its prompt's last token is a prefill: the embed lane's
        ]
        drafts = self._propose(decodes, step.budget - len(decodes))
        for request in decodes:
            if step.budget < 1:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted for an earlier one's sake
            guesses = drafts.get(request, [])[: step.budget - 1]
            # Drafts take only free blocks: no one is preempted for a guess.
            if guesses and self.kv.allocate(request, 1 + len(guesses)):
                step.add(request, 1 + len(guesses))
                step.drafts[request] = guesses
            else:
                self._allocate_or_preempt(request, 1, step)

    def _propose(self, decodes: list[Request], room: int) -> dict[Request, list[int]]:
        """Drafts for this step's decodes, as many as fit the budget left once every decode
        has its token (`room`), each request's max_tokens and the context."""
        spec = self.speculative
        limit = spec.speculative_disable_by_batch_size
        if self.proposer is None or (limit is not None and len(self.running) >= limit):
            return {}
        queries: dict[Request, DraftQuery] = {}
        for request in decodes:
            # The step yields up to k + 1 tokens: all must fit max_tokens and the context.
            k = min(
                spec.num_speculative_tokens,
                room,
                request.sampling_params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if k >= 1 and request.sampling_params.speculative:
                queries[request] = DraftQuery(
                    request.request_id,
                    request.all_token_ids,
                    k,
                    request.sampling_params,
                    request.num_prompt_tokens,
                )
                room -= k
        if not queries:
            return {}
        proposals = self.proposer.propose(list(queries.values()))
        return dict(zip(queries, proposals, strict=True))

    def _schedule_prefills(self, step: StepPlan, now: float) -> None:
        # While the batch lane has work, interactive prefills leave it a share of the budget.
        reserve = 0
        if self._lane_has_prefill_work("batch") and self._lane_has_prefill_work("interactive"):
            reserve = math.ceil(
                self.config.batch_lane_min_share * self.config.max_num_batched_tokens
            )
        embed = self._embed_lane_budget()
        self._schedule_lane_prefills("interactive", reserve + embed, step, now)
        self._schedule_lane_prefills("batch", embed, step, now)
        self._schedule_lane_prefills(EMBED_LANE, max(0, step.budget - embed), step, now)

    def _embed_lane_budget(self) -> int:
        """Tokens the embed lane takes this step: beside generation a fixed share, both its
        floor (the generation lanes leave it that much) and its ceiling (a burst of
        embeddings never makes a step much longer than its decodes); alone, everything."""
        if not self._lane_has_prefill_work(EMBED_LANE):
            return 0
        generating = (
            self.waiting.count() > self.waiting.count(EMBED_LANE)
            or self._num_held() > 0
            or any(r.lane != EMBED_LANE for r in self.running)
        )
        budget = self.config.max_num_batched_tokens
        return math.ceil(self.config.embed_lane_share * budget) if generating else budget

    def _schedule_lane_prefills(self, lane: str, reserve: int, step: StepPlan, now: float) -> None:
        for request in [r for r in self.running if r.lane == lane]:
            budget = step.budget - reserve
            if budget < 1:
                return
            remaining = request.num_uncomputed_tokens
            if request in step.tokens or request.status != RequestStatus.RUNNING:
                continue
            if remaining < 2 and not (request.is_embedding and remaining):
                continue  # a decode (or nothing left): not a prefill
            n = self._chunk(request, remaining, budget, step)
            if request.reused_spans:  # computed up to the next copied run, which it passes
                n = min(n, request.reused_spans[0][0] - request.num_computed_tokens)
            if n:
                self._allocate_or_preempt(request, n, step)
        if self.config.batching != "continuous" or step.preempted:
            return  # a step that preempted admits nobody: memory is short
        for request in self.waiting.lane(lane):
            budget = step.budget - reserve
            if budget < 1 or not self._has_seat(lane):
                break
            if request.num_output_placeholders:
                continue  # preempted while its step runs: back once its last token is known
            admission = self._admit(request, budget, step, now)
            if admission is _Admission.BLOCKED:
                break  # the head of the line does not fit: later ones wait behind it (FCFS)

    # ---- admission -------------------------------------------------------------

    def _admit(self, request: Request, budget: int, step: StepPlan, now: float) -> _Admission:
        """Move a waiting request to running with its first chunk, if it fits."""
        if not self._has_lora_slot(request):
            # No slot for its adapter until a running adapter's requests end: those behind
            # wait too (FCFS), so a stream of resident adapters' requests cannot starve it.
            return _Admission.BLOCKED
        cached = self._cached_prefix(request)
        num_cached = len(cached) * self.kv.block_size
        reuse = self._plan_reuse(request, cached)
        start = num_cached if reuse is None else reuse.first_uncopied(num_cached)
        remaining = request.num_tokens - start
        if self._long_prefill_slots_taken(remaining, step):
            return _Admission.SKIPPED  # a short request behind it may still go
        n = self._chunk(request, remaining, budget, step)
        needed = n
        if reuse is not None:
            if (copied := reuse.next_copied(start)) is not None:
                n = min(n, copied - start)
            needed = max(start + n, reuse.end) - num_cached  # blocks for the copies too
            held = list(reuse.source_blocks.values())
            self.kv.hold(held)  # no allocation below may evict what the copies read
            step.held_blocks += held
        if not n:
            return _Admission.BLOCKED
        while not self.kv.allocate(request, needed, cached):
            self._return_held(step, outranking=request)  # one of them may have to give way
            victim = self._priority_victim(request)
            if victim is None:
                return _Admission.BLOCKED
            self._preempt(victim, step)
        self.kv.record_prefix_lookup(request.num_tokens, num_cached, request.num_preemptions > 0)
        self.waiting.remove(request)
        self._start_running(request, num_cached, now)
        if reuse is not None:
            self._start_reuse(request, reuse, step)
        step.add(request, n)
        return _Admission.ADMITTED

    def _plan_reuse(self, request: Request, cached: list[int]) -> ReusePlan | None:
        """What the request copies from a recent sequence (--cache-reuse), if it fits now:
        its copies need blocks up to the last run at once, beside the ones they read. When
        memory is that short the prompt is computed rather than waiting for it."""
        if self.reuse is None:
            return None
        reuse = self.reuse.plan(request, len(cached) * self.kv.block_size)
        if reuse is None:
            return None
        taken = set(cached) | set(reuse.source_blocks.values())
        needed = self.kv.blocks_needed(reuse.end) - len(cached)
        return reuse if needed <= self.kv.num_free_beside(taken) else None

    def _start_reuse(self, request: Request, reuse: ReusePlan, step: StepPlan) -> None:
        """Plan the copies of an admitted request's reused runs into its new blocks, and
        pass over the runs its computing starts at."""
        assert self.reuse is not None
        step.kv_copies[request] = reuse.copies(request.block_ids, self.kv.block_size)
        request.reused_spans = [(run.target, run.length) for run in reuse.runs]
        self.reuse.break_chain(request, reuse)
        self._pass_reused(request)
        self.reuse.num_reused_tokens += reuse.num_tokens
        if not request.num_preemptions:
            request.num_cached_tokens += reuse.num_tokens

    @staticmethod
    def _pass_reused(request: Request) -> None:
        """Count the copied runs its computing has reached as computed."""
        spans = request.reused_spans
        request.num_computed_tokens, passed = past_copied(spans, request.num_computed_tokens)
        del spans[:passed]

    def _admit_batch(self, now: float, no_more_arrivals: bool) -> None:
        """Static / dynamic batching: the next batch joins the running set together."""
        batch = form_batch(self.config, self.waiting, now, no_more_arrivals)
        for request in batch[: self.config.max_num_seqs]:
            if not self._has_lora_slot(request):
                break
            cached = self._cached_prefix(request)
            if not self.kv.allocate(request, 0, cached):
                cached = []
            num_cached = len(cached) * self.kv.block_size
            self.kv.record_prefix_lookup(
                request.num_tokens, num_cached, request.num_preemptions > 0
            )
            self.waiting.remove(request)
            self._start_running(request, num_cached, now)

    def _has_lora_slot(self, request: Request) -> bool:
        """The request's adapter holds a slot, or can now (its own, a free one, or one whose
        adapter no running request uses); always for the base model."""
        if not request.lora_id:
            return True
        busy = (r.lora_id for r in self.running)
        return self.lora_slots.acquire(request.lora_id, busy) is not None

    def _cached_prefix(self, request: Request) -> list[int]:
        """The prefix cache's blocks the request may use: a request still owed prompt
        logprobs recomputes the blocks whose positions score them (their logits were
        never kept), and only such a request pays for that."""
        pooling = request.pooling_params
        if pooling is not None and pooling.needs_every_token:
            return []  # a mean (or first-token) pool needs the states, not the cached K/V
        cached = self.kv.find_cached_prefix(request)
        return cached[: request.num_unscored_prompt_positions // self.kv.block_size]

    def _start_running(self, request: Request, num_cached: int, now: float) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        request.admission_seq = self._admissions
        self._admissions += 1
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = now
            # What the prompt found in the cache; a re-admission after a preemption
            # finding its own blocks again is not a prefix hit.
            request.num_cached_tokens = num_cached
        self.running.append(request)

    def _has_seat(self, lane: str) -> bool:
        free = self.config.max_num_seqs - len(self.running) - self._num_held()
        if lane == "batch":
            cap = self.config.max_running_batch_lane
            return free > 0 and (cap is None or self.num_running("batch") < cap)
        # The batch lane's share covers seats as well as tokens: a budget share is no use
        # to a waiting document if chats hold every seat.
        return free > self._batch_seats_owed()

    def _batch_seats_owed(self) -> int:
        """Seats interactive admissions leave free while batch-lane requests wait."""
        waiting = self.waiting.count("batch")
        if not waiting or not self.config.batch_lane_min_share:
            return 0
        guaranteed = math.ceil(self.config.batch_lane_min_share * self.config.max_num_seqs)
        cap = self.config.max_running_batch_lane
        if cap is not None:
            guaranteed = min(guaranteed, cap)
        return max(0, min(guaranteed, waiting) - self.num_running("batch"))

    def _long_prefill_slots_taken(self, remaining: int, step: StepPlan) -> bool:
        threshold = self.config.long_prefill_token_threshold
        cap = self.config.max_long_partial_prefills
        return bool(threshold and cap and remaining > threshold and step.num_long_prefills >= cap)

    def _chunk(self, request: Request, remaining: int, budget: int, step: StepPlan) -> int:
        """Tokens of this prefill to compute now (0: not this step)."""
        n = self._chunk_in_budget(request, remaining, budget, step)
        embeds = request.prompt_embeds
        if n and embeds is not None and embeds.bidirectional:
            return _whole_spans(embeds.spans, request.num_tokens - remaining, n)
        return n

    def _chunk_in_budget(
        self, request: Request, remaining: int, budget: int, step: StepPlan
    ) -> int:
        if self._long_prefill_slots_taken(remaining, step):
            return 0
        threshold = self.config.long_prefill_token_threshold
        if threshold and remaining > threshold:
            step.num_long_prefills += 1
            remaining = threshold
        if not self.config.enable_chunked_prefill and remaining > budget:
            return 0
        room = step.scored_prompt_room(request) if self.config.enable_chunked_prefill else None
        if room is not None:  # each scored position is a row of logits: capped (step_plan.py)
            n = min(remaining, budget, room)
            step.num_scored_prompt_rows += max(n, 0)
            return max(n, 0)
        return min(remaining, budget)

    def _lane_has_prefill_work(self, lane: str) -> bool:
        if self.config.batching == "continuous" and self.waiting.count(lane):
            return True
        return any(
            r.lane == lane
            and (r.num_uncomputed_tokens > 1 or r.is_embedding and r.num_uncomputed_tokens)
            for r in self.running
        )

    # ---- memory pressure -------------------------------------------------------

    def _allocate_or_preempt(self, request: Request, n: int, step: StepPlan) -> bool:
        """Allocate for a running request, preempting the lowest-ranked running
        request (possibly this one) until it fits."""
        while not self.kv.allocate(request, n):
            self._return_held(step)  # the victim may be one of them
            victim = max(self.running, key=victim_key)
            self._preempt(victim, step)
            if victim is request:
                return False
        step.add(request, n)
        return True

    def _priority_victim(self, candidate: Request) -> Request | None:
        """A running request a waiting one outranks, that has progressed since it
        was last preempted (so no two requests take turns preempting each other)."""
        eligible = [
            r
            for r in self.running
            if outranks(candidate, r) and r.num_output_tokens > r.outputs_at_preemption
        ]
        return max(eligible, key=victim_key) if eligible else None

    def _preempt(self, request: Request, step: StepPlan) -> None:
        copies = step.kv_copies.get(request)
        if copies:  # planned this step, never made: nothing from the first on is written
            request.num_computed_tokens = min(request.num_computed_tokens, copies[0].target)
        request.reused_spans.clear()
        step.remove(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED  # first: the pool may keep such blocks apart
        self.kv.cache_full_blocks(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.outputs_at_preemption = request.num_output_tokens
        self.num_preemptions += 1
        step.preempted.append(request)
        self.waiting.push(request)

    # ---- endings ---------------------------------------------------------------

    def _ends_planned(self, request: Request) -> bool:
        """Whether the tokens already planned for the request reach its max_tokens or the
        context (a step planned ahead of its last one's results must not go past them)."""
        planned = request.num_output_placeholders
        return bool(planned) and self._tokens_left(request) <= planned

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        """Whether the request ends with `token_id`, its newest output token, and how."""
        if self._stops_on(request, token_id):
            return RequestStatus.FINISHED_STOPPED
        if self._tokens_left(request) <= 0:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _stops_on(request: Request, token_id: int) -> bool:
        """Whether sampling `token_id` ends the request: a stop token, or EOS unless ignored."""
        params = request.sampling_params
        return token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in request.eos_token_ids
        )

    def _tokens_left(self, request: Request) -> int:
        """Output tokens the request may still make before it ends by length."""
        return min(
            request.sampling_params.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
        )

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        self.kv.cache_full_blocks(request)
        if self.reuse is not None:
            self.reuse.remember(request)
        self.kv.free(request)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        request.status = status
        request.timings.finished = now
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _output(self, step: StepPlan, now: float) -> SchedulerOutput:
        seqs: list[ScheduledSeq] = []
        num_decode = num_draft = 0

        # Decodes first, the executor batching the one-token queries together; each part in
        # the order its requests were planned (decodes: admission order).
        def decodes_first(item: tuple[Request, int]) -> tuple[bool, int]:
            decode = step.real(*item) == 1
            return not decode, item[0].admission_seq if decode else 0

        for request, n in sorted(step.tokens.items(), key=decodes_first):
            start = request.num_computed_tokens
            drafts = step.drafts.get(request, [])
            real = n - len(drafts)
            outputs = request.num_output_tokens + request.num_output_placeholders
            ends_prompt = start + real == request.num_prompt_tokens + outputs
            pooling = request.pooling_params
            sample = ends_prompt and pooling is None  # an embedding request pools instead
            token_ids = request.all_token_ids[start : start + real]
            in_flight = len(token_ids) < real  # its last token is the step in flight's sample
            if in_flight:
                token_ids.append(IN_FLIGHT_TOKEN)
            if drafts:  # not `+ drafts` always: a prompt chunk's copy would be copied again
                token_ids += drafts
            seqs.append(
                ScheduledSeq(
                    request_id=request.request_id,
                    token_ids=token_ids,
                    num_computed_tokens=start,
                    block_ids=tuple(request.block_ids),
                    sample=sample,
                    sampling_params=request.sampling_params,
                    draft_token_ids=drafts,
                    last_token_in_flight=in_flight,
                    pooling=None if pooling is None else pooling.pooling,
                    pool_now=ends_prompt and pooling is not None,
                    score=pooling is not None and pooling.task != "embed",
                    lora_id=request.lora_id,
                    lora_slot=self.lora_slots.slot_of(request.lora_id),
                    kv_copies=tuple(step.kv_copies.get(request, ())),
                    prompt_embeds=_prompt_rows(request, start),
                    rope_shift=_rope_shift(request, start),
                )
            )
            params = request.sampling_params
            if sample and params.uses_token_history:
                seqs[-1].context = _token_context(request)
            if params.prompt_logprobs is not None:
                seqs[-1].scored_prompt_token_ids = request.prompt_tokens_to_score(start, real)
            num_draft += len(drafts)
            if sample and real == 1 and outputs:
                num_decode += 1
            # Planned is as good as computed for the next plan; update() corrects for
            # rejected drafts, unplan() for a step that never ran.
            request.num_computed_tokens = start + n
            request.num_output_placeholders += sample
            if request.reused_spans:
                self._pass_reused(request)
        self.kv.release(step.held_blocks)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            seqs=seqs,
            num_prefill_tokens=step.num_tokens - num_decode - num_draft,
            num_decode_tokens=num_decode,
            num_draft_tokens=num_draft,
            finished_ids=finished,
        )

    # ---- requests held aside by a subclass (none here) ----------------------------

    def _num_held(self, lane: str | None = None) -> int:
        """Running requests held outside `running` (of `lane`): they take seats too."""
        return 0

    def _unlist(self, request: Request) -> None:
        """Take an unfinished request out of the list that holds it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def _block_tables(self) -> list[list[int]]:
        """Every block table, for check_invariants: all blocks requests hold."""
        return [r.block_ids for r in self.requests.values()]

    def _schedule_held(self, step: StepPlan) -> None:
        """The held requests' part of a step, planned before anyone else's."""

    def _return_held(self, step: StepPlan, outranking: Request | None = None) -> None:
        """Put held requests back into `running`, before a victim is chosen from it: all,
        or only if `outranking` might outrank one of them."""

    def _end_held_step(self, scheduled: SchedulerOutput, now: float) -> list[Request]:
        """After a step: the held requests it finished, in admission order, caught up
        (their tokens are counted where they were made); update() finishes them."""
        return []

    def _finish_held(self, request: Request, now: float) -> RequestUpdate:
        """Finish a held request whose last token is in: its update carries no tokens."""
        status = self._stop_status(request, request.output_token_ids[-1])
        assert status is not None, "a held request finished before its end"
        self._finish(request, status, now)
        return RequestUpdate(request.request_id, [], [], status.finish_reason)


def _whole_spans(spans: tuple[tuple[int, int], ...], start: int, n: int) -> int:
    """A chunk of `n` tokens from `start`, ended outside every span whose positions attend
    both ways (PromptEmbeds.bidirectional): before a span it would end inside, or, when it
    starts within one or at its first position, at the span's end (past the step's budget,
    which a span cannot be split to fit)."""
    end = start + n
    for first, count in spans:
        if first < end < first + count:
            end = first if first > start else first + count
            break
    return end - start


def _prompt_rows(request: Request, start: int) -> PromptEmbeds | None:
    """A prompt's input rows (Request.prompt_embeds), for a step that computes from `start`
    while the prompt is not all computed (None otherwise)."""
    embeds = request.prompt_embeds
    return None if embeds is None or start >= request.num_prompt_tokens else embeds


def _rope_shift(request: Request, start: int) -> int:
    """The rotary positions' shift of a step's text from `start` on (ScheduledSeq)."""
    embeds = request.prompt_embeds
    return 0 if embeds is None or not embeds.grids else embeds.rope_shift(start)


def _token_context(request: Request) -> TokenContext:
    """What the sampler's look-back controls read (for requests that use any): a prompt
    given as rows has no tokens for penalties to count."""
    params = request.sampling_params
    stops = tuple(params.stop_token_ids)
    if not params.ignore_eos:
        stops += request.eos_token_ids
    return TokenContext(
        ()
        if request.prompt_embeds and request.prompt_embeds.whole_prompt
        else request.prompt_token_ids,
        list(request.output_token_ids),
        stops,
        request.bad_words_token_ids,
    )


class _Admission(enum.Enum):
    ADMITTED = "admitted"
    SKIPPED = "skipped"  # held back by a policy limit; the next in line may go
    BLOCKED = "blocked"  # no memory or budget; everyone behind it waits too
