"""The scheduler's core behaviour, with a fake executor (no torch)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from fake_executor import FakeExecutor, expected_output, make_request, make_scheduler, run
from iterserve.core.kv_cache import KVCacheInvariantError
from iterserve.core.outputs import ModelOutput, SchedulerOutput
from iterserve.core.request import RequestStatus
from iterserve.core.scheduler import Scheduler
from iterserve.sampling_params import InvalidRequestError


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 50) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_core_never_imports_torch() -> None:
    code = (
        "import sys, iterserve.core.scheduler, iterserve.core.kv_cache, iterserve.core.policies; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("budget", [5, 16, 512])
@pytest.mark.parametrize("chunked", [True, False])
def test_every_request_gets_its_exact_output(budget: int, chunked: bool) -> None:
    if not chunked:
        budget = max(budget, 80)  # unchunked: a whole request must fit one step
    scheduler, clock = make_scheduler(max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    prompts = random_prompts(12)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=5 + i))
    outputs, plans = run(scheduler, clock)
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == expected_output(prompt, 5 + i)
    assert all(p.num_batched_tokens <= budget for p in plans)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    scheduler, _ = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("short", [1, 2, 3], max_tokens=20))
    first = scheduler.schedule()
    assert [s.request_id for s in first.seqs] == ["short"]
    scheduler.update(first, _sample_all(first))
    scheduler.add_request(make_request("long", list(range(1, 41)), max_tokens=2))
    long_chunks = []
    for _ in range(6):
        out = scheduler.schedule()
        by_id = {s.request_id: s for s in out.seqs}
        assert by_id["short"].num_new_tokens == 1, "the decode runs every step"
        assert out.seqs[0].request_id == "short", "decodes come first in the flat batch"
        long_chunks.append(by_id["long"].num_new_tokens)
        scheduler.update(out, _sample_all(out))
    assert long_chunks[:5] == [7, 7, 7, 7, 7] and sum(long_chunks) >= 40


def test_preemption_under_a_tiny_pool_loses_nothing() -> None:
    scheduler, clock = make_scheduler(num_blocks=14, block_size=4, max_num_batched_tokens=32)
    prompts = random_prompts(8, seed=3, lo=10, hi=20)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=16))
    outputs, plans = run(scheduler, clock)
    assert scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == expected_output(prompt, 16)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_readmission_after_preemption_is_not_a_prefix_hit() -> None:
    # Distinct prompts share nothing; a preempted request finding its own freed blocks
    # again saves recompute, and must not show up as a prefix-cache hit.
    scheduler, clock = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32)
    prompts = [[100 + i] + p for i, p in enumerate(random_prompts(8, seed=3, lo=10, hi=20))]
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=16))
    cached_at_first_admission = {}

    def watch(out: SchedulerOutput) -> None:
        for seq in out.seqs:
            request = scheduler.requests[seq.request_id]
            cached_at_first_admission.setdefault(seq.request_id, request.num_cached_tokens)

    run(scheduler, clock, on_step=watch)
    stats = scheduler.kv.stats()
    assert scheduler.num_preemptions > 0 and stats.preempted_hits > 0
    assert stats.prefix_hits == 0 and stats.prefix_hit_rate == 0.0
    assert stats.prefix_queries == sum(len(p) for p in prompts)
    assert set(cached_at_first_admission.values()) == {0}


def test_victim_is_the_most_recently_admitted() -> None:
    scheduler, _ = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [1 + i] * 7, max_tokens=12))
    out = scheduler.schedule()
    assert len(out.seqs) == 3  # 2 blocks each
    preempted: list[str] = []
    for _ in range(5):
        scheduler.update(out, _sample_all(out))
        out = scheduler.schedule()
        preempted += [
            rid
            for rid, r in scheduler.requests.items()
            if r.num_preemptions and rid not in preempted
        ]
    assert preempted and preempted[0] == "r2"


def test_prefix_cache_hit_skips_shared_blocks() -> None:
    scheduler, clock = make_scheduler(block_size=4)
    system = list(range(1, 17))
    scheduler.add_request(make_request("a", system + [20, 21], max_tokens=2))
    run(scheduler, clock)
    scheduler.add_request(make_request("b", system + [30, 31, 32], max_tokens=2))
    out = scheduler.schedule()
    assert out.seqs[0].num_computed_tokens == 16 and out.seqs[0].num_new_tokens == 3
    stats = scheduler.kv.stats()
    assert stats.prefix_hits == 16 and stats.prefix_queries == 18 + 19


def test_abort_frees_blocks_at_once() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_request("a", list(range(1, 30)), max_tokens=50))
    scheduler.add_request(make_request("b", list(range(1, 30)), max_tokens=50))
    out = scheduler.schedule()
    scheduler.update(out, _sample_all(out))
    assert scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED) is not None
    assert scheduler.finish_request("missing", RequestStatus.FINISHED_ABORTED) is None
    assert scheduler.num_running() == 1
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert sorted(scheduler.schedule().finished_ids) == ["a", "b"]


def test_requests_that_can_never_fit_are_refused() -> None:
    scheduler, _ = make_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64 tokens"):
        scheduler.add_request(make_request("long", [1] * 60, max_tokens=10))
    with pytest.raises(InvalidRequestError, match="whole cache holds 8"):
        scheduler.add_request(make_request("big", [1] * 30, max_tokens=10))
    with pytest.raises(InvalidRequestError, match="empty"):
        scheduler.add_request(make_request("empty", [], max_tokens=10))
    with pytest.raises(InvalidRequestError, match="lane"):
        scheduler.add_request(make_request("lane", [1], lane="vip"))
    assert not scheduler.has_unfinished()


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler, clock = make_scheduler(max_num_seqs=3)
    for i, prompt in enumerate(random_prompts(7)):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=4))
    _, plans = run(scheduler, clock, on_step=lambda _: None)
    assert max(len(p.seqs) for p in plans) <= 3


def _sample_all(out: SchedulerOutput) -> ModelOutput:
    return FakeExecutor().execute(out)


def test_unchunked_request_over_the_step_budget_is_refused() -> None:
    scheduler, _ = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(InvalidRequestError, match="chunked prefill off"):
        scheduler.add_request(make_request("a", [1] * 30, max_tokens=8))


def _a_step_with_a_leaked_block() -> tuple[Scheduler, SchedulerOutput]:
    scheduler, _ = make_scheduler()
    scheduler.add_request(make_request("a", list(range(1, 10)), max_tokens=4))
    out = scheduler.schedule()
    scheduler.kv._refs[out.seqs[0].block_ids[0]] += 1  # unseen by the pool itself
    return scheduler, out


def test_debug_invariants_check_the_pool_after_every_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ITERSERVE_DEBUG_INVARIANTS", "1")
    scheduler, out = _a_step_with_a_leaked_block()
    with pytest.raises(KVCacheInvariantError, match="has ref_count 2 but 1 block tables hold it"):
        scheduler.update(out, _sample_all(out))


def test_without_the_debug_switch_update_does_not_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ITERSERVE_DEBUG_INVARIANTS", raising=False)
    scheduler, out = _a_step_with_a_leaked_block()
    scheduler.update(out, _sample_all(out))
    with pytest.raises(KVCacheInvariantError):
        scheduler.check_invariants()
