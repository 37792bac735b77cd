"""Batching policies and lanes on the pure-Python scheduler (fake executor, no torch)."""

from __future__ import annotations

import random

import pytest

from fake_executor import FakeExecutor, expected_output, make_request, make_scheduler, run
from iterserve.config import ConfigError, EngineConfig, SchedulerConfig
from iterserve.core.outputs import SchedulerOutput
from iterserve.core.request import RequestStatus


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 60) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def step(scheduler, executor: FakeExecutor, no_more_arrivals: bool = False) -> SchedulerOutput:  # type: ignore[no-untyped-def]
    out = scheduler.schedule(no_more_arrivals)
    scheduler.update(out, executor.execute(out))
    return out


POLICIES = [
    {"batching": "continuous", "step_policy": "mixed"},
    {"batching": "continuous", "step_policy": "prefill-first"},
    {"batching": "static", "batch_size": 4},
    {"batching": "dynamic", "batch_size": 4, "max_wait_ms": 30},
    {"batching": "continuous", "long_prefill_token_threshold": 8, "max_long_partial_prefills": 1},
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_outputs_do_not_depend_on_the_policy(policy: dict) -> None:
    scheduler, clock = make_scheduler(num_blocks=40, max_num_batched_tokens=24, **policy)
    batch = prompts(10)
    for i, prompt in enumerate(batch):
        lane = "batch" if i % 3 == 0 else "interactive"
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=3 + i, lane=lane))
    outputs, plans = run(scheduler, clock, no_more_arrivals=True)
    for i, prompt in enumerate(batch):
        assert outputs[f"r{i}"] == expected_output(prompt, 3 + i)
    assert all(p.num_batched_tokens <= 24 for p in plans)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_static_never_admits_mid_batch_and_holds_finished_slots() -> None:
    scheduler, _ = make_scheduler(batching="static", batch_size=3)
    executor = FakeExecutor()
    for i, n in enumerate([2, 6, 9]):
        scheduler.add_request(make_request(f"a{i}", [1, 2, 3], max_tokens=n))
    step(scheduler, executor)
    scheduler.add_request(make_request("late", [4, 5, 6], max_tokens=2))
    seen_late_before_batch_done = False
    while scheduler.requests.keys() - {"late"}:
        out = step(scheduler, executor)
        running = {s.request_id for s in out.seqs}
        seen_late_before_batch_done |= "late" in running
    assert not seen_late_before_batch_done, "nothing joins a static batch mid-way"
    out = step(scheduler, executor)
    assert [s.request_id for s in out.seqs] == []  # a batch of 1 waits for more (or the end)
    out = step(scheduler, executor, no_more_arrivals=True)
    assert [s.request_id for s in out.seqs] == ["late"]


def test_static_waits_for_a_full_batch() -> None:
    scheduler, _ = make_scheduler(batching="static", batch_size=3)
    scheduler.add_request(make_request("a", [1, 2], max_tokens=2))
    scheduler.add_request(make_request("b", [1, 2], max_tokens=2))
    assert scheduler.schedule().is_empty
    scheduler.add_request(make_request("c", [1, 2], max_tokens=2))
    assert len(scheduler.schedule().seqs) == 3


def test_static_starts_a_partial_batch_after_its_max_wait() -> None:
    # A server never learns that no more requests will come: without a maximum wait,
    # a partial static batch would wait for ever.
    scheduler, clock = make_scheduler(batching="static", batch_size=3, static_max_wait_ms=2000)
    scheduler.add_request(make_request("a", [1, 2], max_tokens=2, arrival=0.0))
    clock.now = 1.9
    assert scheduler.schedule().is_empty, "static waits far longer than dynamic's default"
    clock.now = 2.0
    assert [s.request_id for s in scheduler.schedule().seqs] == ["a"]


def test_dynamic_starts_on_size_or_timeout_whichever_first() -> None:
    scheduler, clock = make_scheduler(batching="dynamic", batch_size=3, max_wait_ms=100)
    scheduler.add_request(make_request("a", [1, 2], max_tokens=2, arrival=0.0))
    clock.now = 0.05
    assert scheduler.schedule().is_empty
    clock.now = 0.1
    assert [s.request_id for s in scheduler.schedule().seqs] == ["a"]

    scheduler, clock = make_scheduler(batching="dynamic", batch_size=2, max_wait_ms=1000)
    scheduler.add_request(make_request("a", [1, 2], max_tokens=2))
    scheduler.add_request(make_request("b", [1, 2], max_tokens=2))
    assert len(scheduler.schedule().seqs) == 2  # full before the timeout


def test_static_batches_group_prompts_by_length() -> None:
    scheduler, _ = make_scheduler(batching="static", batch_size=2)
    for rid, length in [("a", 10), ("b", 40), ("c", 11), ("d", 39)]:
        scheduler.add_request(make_request(rid, [1] * length, max_tokens=1))
    assert {s.request_id for s in scheduler.schedule().seqs} == {"a", "c"}


def test_continuous_admits_at_the_next_step() -> None:
    scheduler, _ = make_scheduler()
    executor = FakeExecutor()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    step(scheduler, executor)
    scheduler.add_request(make_request("b", [4, 5, 6], max_tokens=2))
    assert {s.request_id for s in step(scheduler, executor).seqs} == {"a", "b"}


def test_prefill_first_never_mixes_and_mixed_does() -> None:
    for policy, expect_mixed in [("prefill-first", False), ("mixed", True)]:
        scheduler, clock = make_scheduler(step_policy=policy, max_num_batched_tokens=16)
        for i, prompt in enumerate(prompts(8, seed=5)):
            scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=6, arrival=i * 0.02))
        mixed_steps = 0

        def check(out: SchedulerOutput) -> None:
            nonlocal mixed_steps
            kinds = {s.num_new_tokens == 1 and s.num_computed_tokens > 0 for s in out.seqs}
            mixed_steps += len(kinds) > 1

        run(scheduler, clock, on_step=check)
        assert (mixed_steps > 0) == expect_mixed, policy


def test_long_prefill_threshold_lets_a_short_request_through() -> None:
    scheduler, _ = make_scheduler(
        max_num_batched_tokens=64, long_prefill_token_threshold=16, max_long_partial_prefills=1
    )
    executor = FakeExecutor()
    scheduler.add_request(make_request("doc1", [1] * 200, max_tokens=1, arrival=0))
    scheduler.add_request(make_request("doc2", [2] * 200, max_tokens=1, arrival=0.1))
    scheduler.add_request(make_request("chat", [3] * 5, max_tokens=1, arrival=0.2))
    out = step(scheduler, executor)
    chunks = {s.request_id: s.num_new_tokens for s in out.seqs}
    assert chunks == {"doc1": 16, "chat": 5}, (
        "one long prompt at a time, capped; the short one runs"
    )


def test_interactive_first_but_batch_lane_gets_its_share() -> None:
    scheduler, clock = make_scheduler(max_num_batched_tokens=40, batch_lane_min_share=0.25)
    executor = FakeExecutor()
    batch_tokens = 0
    for t in range(60):
        clock.now = t * 0.01
        scheduler.add_request(make_request(f"i{t}", [5] * 30, max_tokens=1, arrival=clock.now))
        if t == 0:
            scheduler.add_request(make_request("b0", [7] * 300, max_tokens=1, lane="batch"))
        out = step(scheduler, executor)
        batch_tokens += sum(s.num_new_tokens for s in out.seqs if s.request_id == "b0")
        if t == 0:
            assert out.seqs[0].request_id == "i0", "interactive admitted first"
    assert batch_tokens >= 300 * 0.8, "the batch lane is not starved by a flood of chats"


def test_priority_preempts_a_lower_priority_request() -> None:
    scheduler, clock = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    executor = FakeExecutor()
    scheduler.add_request(make_request("low", [1] * 20, max_tokens=8, priority=5))
    step(scheduler, executor)
    scheduler.add_request(make_request("high", [2] * 20, max_tokens=4, priority=0))
    out = step(scheduler, executor)
    assert scheduler.requests["low"].status is RequestStatus.PREEMPTED
    assert [s.request_id for s in out.seqs] == ["high"]
    outputs, _ = run(scheduler, clock, executor=executor)
    assert outputs["high"] == expected_output([2] * 20, 4)[1:]
    assert outputs["low"] == expected_output([1] * 20, 8)[1:]
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_a_request_is_not_preempted_again_before_it_progresses() -> None:
    scheduler, _ = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    executor = FakeExecutor()
    scheduler.add_request(make_request("low", [1] * 16, max_tokens=8, priority=5))
    step(scheduler, executor)
    low = scheduler.requests["low"]
    low.outputs_at_preemption = low.num_output_tokens  # as if just resumed after a preemption
    scheduler.add_request(make_request("high", [2] * 16, max_tokens=4, priority=0))
    step(scheduler, executor)
    assert low.status is RequestStatus.RUNNING and scheduler.num_waiting() == 1, "protected"
    step(scheduler, executor)  # low has produced a token since: now it may give way
    assert low.status is RequestStatus.PREEMPTED


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batching": "static", "batch_size": 0}, "batch-size"),
        ({"batching": "sideways"}, "batching"),
        ({"step_policy": "random"}, "step-policy"),
        ({"max_num_seqs": 0}, "max-num-seqs"),
        ({"batching": "static", "static_max_wait_ms": float("inf")}, "static-max-wait-ms"),
        ({"batch_lane_min_share": 1.5}, "min-share"),
        # Settings that used to be accepted and then starved or hung requests:
        ({"batch_lane_min_share": 1.0}, "batch-lane-min-share"),
        ({"max_running_batch_lane": 0}, "max-running-batch-lane"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max-num-seqs.*max-num-batched"),
        ({"batching": "static", "batch_size": 16, "max_num_seqs": 8}, "batch-size.*max-num-seqs"),
        ({"batching": "dynamic", "batch_size": 16, "max_num_seqs": 8}, "batch-size.*max-num-seqs"),
    ],
)
def test_invalid_configurations_are_refused(overrides: dict, message: str) -> None:
    # Building the dataclass is enough: not only the CLI validates.
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**overrides)
    config = EngineConfig()
    for key, value in overrides.items():
        setattr(config.scheduler, key, value)  # changed after building: caught on use
    with pytest.raises(ConfigError, match=message):
        config.validate()


def test_batch_lane_gets_a_seat_when_chats_hold_every_seat() -> None:
    # Two seats, a chat arriving every step: before seats were part of the batch lane's
    # share, each freed seat went to the next chat and the document never started.
    scheduler, clock = make_scheduler(
        max_num_seqs=2, max_num_batched_tokens=64, batch_lane_min_share=0.1
    )
    executor = FakeExecutor()
    for name in ("first", "second"):
        scheduler.add_request(make_request(name, [5] * 4, max_tokens=3))
    step(scheduler, executor)
    scheduler.add_request(make_request("doc", [7] * 20, max_tokens=2, lane="batch"))
    for t in range(80):
        clock.now = t * 0.01
        scheduler.add_request(make_request(f"c{t}", [5] * 4, max_tokens=3, arrival=clock.now))
        step(scheduler, executor)
        if "doc" not in scheduler.requests:
            break
    assert "doc" not in scheduler.requests, "the batch lane was starved of seats"


def test_lanes_off_puts_everyone_in_one_queue() -> None:
    scheduler, _ = make_scheduler(enable_lanes=False, max_num_batched_tokens=8)
    scheduler.add_request(make_request("doc", [1] * 30, max_tokens=1, lane="batch", arrival=0))
    scheduler.add_request(make_request("chat", [2] * 4, max_tokens=1, arrival=1))
    out = scheduler.schedule()
    assert [s.request_id for s in out.seqs] == ["doc"], "FCFS across what were lanes"


def test_choice_settings_take_their_cli_choices_from_their_types() -> None:
    import argparse
    import typing

    from iterserve.config import Batching, StepPolicy, add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    choices = {a.dest: a.choices for a in parser._actions if a.choices}
    assert tuple(choices["batching"]) == typing.get_args(Batching)
    assert tuple(choices["step_policy"]) == typing.get_args(StepPolicy)
    assert {"dtype", "weights", "kernels", "prefix_caching_hash_algo"} <= choices.keys()
    with pytest.raises(ConfigError, match="--dtype"):
        EngineConfig(dtype="float16")  # type: ignore[arg-type]
