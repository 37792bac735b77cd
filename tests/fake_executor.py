"""A stand-in for the model, for scheduler tests that must run without torch.

It keeps each request's computed tokens the way a KV cache would, checks the
scheduler feeds every position exactly once and in order, and "samples" a
token that is a pure function of the sequence so far: so outputs depend only
on the tokens, never on how a policy batched them.
"""

from __future__ import annotations

from collections.abc import Callable

from iterserve.config import SchedulerConfig, SpeculativeConfig
from iterserve.core.kv_cache import KVCacheManager
from iterserve.core.outputs import ModelOutput, SampledToken, SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.scheduler import Scheduler
from iterserve.sampling_params import SamplingParams


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97 + 3


class FakeExecutor:
    def __init__(self, model: Callable[[list[int]], int] = next_token) -> None:
        self.cache: dict[str, list[int]] = {}
        self.model = model

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        for rid in out.finished_ids:
            self.cache.pop(rid, None)
        sampled = {}
        pooled: dict[str, list[float]] = {}
        for seq in out.seqs:
            history = self.cache.setdefault(seq.request_id, [])
            if seq.num_computed_tokens < len(history):  # recompute after preemption / prefix hit
                del history[seq.num_computed_tokens :]
            if seq.num_computed_tokens > len(history):  # the rest came from the prefix cache
                assert seq.num_computed_tokens % 4 == 0 or not history
                history.extend([-1] * (seq.num_computed_tokens - len(history)))
            history.extend(seq.token_ids)
            if seq.sample:
                # Like the real executor: the model's token after the last real token and
                # after each draft, kept up to the first draft that differs from it.
                real = len(history) - len(seq.draft_token_ids)
                tokens = [SampledToken(self.model(history[:real]))]
                for i, draft in enumerate(seq.draft_token_ids):
                    if draft != tokens[-1].token_id:
                        break
                    tokens.append(SampledToken(self.model(history[: real + i + 1])))
                sampled[seq.request_id] = tokens
            if seq.pool_now:  # an embedding: a pure function of every token it computed
                pooled[seq.request_id] = [float(sum(history)), float(len(history))]
        return ModelOutput(sampled, pooled=pooled)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    num_blocks: int = 256,
    block_size: int = 4,
    max_model_len: int = 4096,
    prefix_caching: bool = True,
    speculative: SpeculativeConfig | None = None,
    **config: object,
) -> tuple[Scheduler, Clock]:
    clock = Clock()
    # The config refuses more seats than a step has tokens; small budgets get fewer seats.
    config.setdefault("max_num_seqs", min(64, config.get("max_num_batched_tokens", 512)))  # type: ignore[call-overload]
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    scheduler = Scheduler(SchedulerConfig(**config), kv, max_model_len, clock, speculative)  # type: ignore[arg-type]
    return scheduler, clock


def make_request(
    rid: str, prompt: list[int], max_tokens: int = 8, arrival: float = 0.0, **kwargs: object
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, arrival_time=arrival, **kwargs)  # type: ignore[arg-type]


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        out.append(next_token(tokens))
        tokens.append(out[-1])
    return out


def run(
    scheduler: Scheduler,
    clock: Clock | None = None,
    max_steps: int = 10_000,
    on_step: object = None,
    executor: FakeExecutor | None = None,
    no_more_arrivals: bool = False,
) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    """Step until every request ends, checking the block pool after each step; returns
    outputs by id and the step plans."""
    executor = executor or FakeExecutor()
    outputs: dict[str, list[int]] = {}
    plans: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs, plans
        out = scheduler.schedule(no_more_arrivals)
        plans.append(out)
        if callable(on_step):
            on_step(out)
        for update in scheduler.update(out, executor.execute(out)):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        scheduler.check_invariants()
        if clock is not None:
            clock.now += 0.01
    raise AssertionError("the scheduler did not finish: a request is stuck")
