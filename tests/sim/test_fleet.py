"""The fleet simulator's shortcuts change nothing: steady decodes advanced together
(sim/decode_cohort.py) and replicas gliding over steps only they run (sim/fleet.py)
give exactly the records, steps, preemptions and clocks of stepping every request."""

from __future__ import annotations

import os
import random
import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.tokenizer import load_tokenizer
from iterserve.bench.workloads import WorkloadRequest, WorkloadSpec, build_workload
from iterserve.config import CacheConfig, EngineConfig, SchedulerConfig
from iterserve.core.kv_cache import KVCacheManager
from iterserve.core.request import Request, RequestStatus
from iterserve.core.scheduler import Scheduler
from iterserve.sampling_params import SamplingParams
from iterserve.sim import block_hash_feed
from iterserve.sim.engine import SteadyEngineCore
from iterserve.sim.executor import (
    HARDWARE,
    MODELS,
    RooflineCostModel,
    SimulatedExecutor,
    VirtualClock,
)
from iterserve.sim.fleet import simulate_fleet
from iterserve.sim.outages import ReplicaOutage
from iterserve.sim.replay_pool import ReplayBlockPool


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


def _trace(tmp_path: Path) -> str:
    path = tmp_path / "trace.csv"
    rows = [(0, 900, 180), (1, 120, 40), (2, 2000, 300), (3, 600, 90), (4, 300, 500)]
    path.write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n"
        + "".join(f"{t},{p},{o}\n" for t, p, o in rows)
    )
    return str(path)


CASES = {
    # name: (workload spec, req/s, replicas, router, KV blocks, scheduler settings)
    "one replica": (WorkloadSpec(num_requests=200, input_len=400, output_len=150,
                                 length_dist="lognormal"), 25.0, 1, "round-robin", None, {}),
    "preemptions": (WorkloadSpec(num_requests=200, input_len=400, output_len=150,
                                 length_dist="lognormal"), 25.0, 1, "round-robin", 300, {}),
    "prefix hits": (WorkloadSpec("shared-prefix", 200, input_len=100, output_len=80,
                                 length_dist="uniform", num_prefixes=3, prefix_len=300),
                    40.0, 3, "prefix-affinity", 600, {}),
    "lanes": (WorkloadSpec("mixed-chat-docs", 200, input_len=100, output_len=80,
                           length_dist="uniform"), 30.0, 2, "least-tokens", 500,
              {"enable_lanes": True}),
    "seats full": (WorkloadSpec(num_requests=200, input_len=200, output_len=200,
                                length_dist="uniform"), 60.0, 2, "power-of-two", None,
                   {"max_num_seqs": 8}),
    "azure lengths": (WorkloadSpec("azure-lengths", 400), 60.0, 8, "prefix-affinity", None,
                      {"max_num_seqs": 128, "max_num_batched_tokens": 2048}),
    # 20 prefixes of 3 blocks, each back every 0.5 s: a request of a group finds the one
    # before it still running, or its blocks still cached, or evicted.
    "twins": (WorkloadSpec("shared-prefix", 300, input_len=20, output_len=60,
                           length_dist="uniform", num_prefixes=20, prefix_len=48),
              40.0, 2, "prefix-affinity", 80, {}),
}  # fmt: skip


def _simulate(  # type: ignore[no-untyped-def]
    case: str,
    tokenizer: Any,
    trace: str,
    step_by_step: bool,
    hash_algo: str = "sha256",
    outages: list[ReplicaOutage] | None = None,
):
    spec, rate, replicas, router, blocks, scheduler = CASES[case]
    spec.trace = trace
    workload = build_workload(spec, tokenizer)
    offsets = arrival_offsets(ArrivalSpec(request_rate=rate), len(workload.requests), seed=3)
    cache = CacheConfig(num_kv_blocks=blocks, prefix_caching_hash_algo=hash_algo)
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler), cache=cache)
    calls = 0
    schedule = Scheduler.schedule

    def counting(self: Scheduler, no_more_arrivals: bool = False):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return schedule(self, no_more_arrivals)

    Scheduler.schedule = counting  # type: ignore[method-assign]
    try:
        records, fleet = simulate_fleet(
            config, workload, offsets, "a100-80g", "llama3-8b",
            replicas=replicas, router=router, step_by_step=step_by_step, outages=outages,
        )  # fmt: skip
    finally:
        Scheduler.schedule = schedule  # type: ignore[method-assign]
    for replica in fleet:
        replica.scheduler.check_invariants()
    state = [
        (
            r.engine.stats.num_steps,
            r.engine.stats.generated_tokens,
            r.scheduler.num_preemptions,
            r.scheduler.kv_cache_stats(),
            r.clock.now,
            r.executor.busy_time,
            r.tracker.num_routed,
            [asdict(outage) for outage in r.outages],
        )
        for r in fleet
    ]
    return [asdict(record) for record in records], state, calls


@pytest.mark.parametrize("case", list(CASES))
def test_shortcuts_give_the_records_of_stepping_every_request(
    case: str, tokenizer: Any, tmp_path: Path
) -> None:
    trace = _trace(tmp_path)
    exact, exact_state, exact_calls = _simulate(case, tokenizer, trace, step_by_step=True)
    fast, fast_state, fast_calls = _simulate(case, tokenizer, trace, step_by_step=False)
    assert all(r["success"] for r in exact)
    assert fast == exact
    assert fast_state == exact_state
    steps = sum(state[0] for state in exact_state)
    assert exact_calls == steps  # one schedule() a step, stepping every request
    if case in ("preemptions", "seats full"):  # requests wait most of the time: few glides
        assert fast_calls < steps
        if case == "preemptions":
            assert sum(state[2] for state in exact_state) > 20
    else:
        assert fast_calls < 0.8 * steps  # replicas glided
    if case == "prefix hits":
        assert sum(state[3].prefix_hits for state in exact_state) > 0


@pytest.mark.parametrize("case", ["preemptions", "prefix hits", "azure lengths", "twins"])
def test_block_hashes_computed_ahead_change_nothing(
    case: str, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chains hashed ahead in another process (sim/block_hash_feed.py) are the ones the
    pool would hash itself, and keeping the names of requests that share no block out of
    the prefix cache's map (sim/replay_pool.py) changes no lookup: the same records,
    hits, evictions and re-admissions."""
    trace = _trace(tmp_path)
    made = []
    feed = block_hash_feed.BlockHashFeed.__init__

    def counting(self, *args):  # type: ignore[no-untyped-def]
        made.append(self)
        feed(self, *args)

    grouped: list[str] = []
    noted: list[tuple[bool, bool]] = []  # per member admitted: (names noted, any still on)
    admit, map_noted = ReplayBlockPool.admit_to_group, ReplayBlockPool._map_noted

    def mapping_noted(pool: ReplayBlockPool, group: int) -> bool:
        had_noted = group in pool._noted
        still_named = map_noted(pool, group)
        noted.append((had_noted, still_named))
        return still_named

    monkeypatch.setattr(block_hash_feed.BlockHashFeed, "__init__", counting)
    monkeypatch.setattr(
        ReplayBlockPool,
        "admit_to_group",
        lambda pool, r, later: (grouped.append(r.request_id), admit(pool, r, later)),
    )
    monkeypatch.setattr(ReplayBlockPool, "_map_noted", mapping_noted)
    monkeypatch.setattr(block_hash_feed, "MIN_REQUESTS", 1)
    ahead = _simulate(case, tokenizer, trace, step_by_step=False, hash_algo="builtin")
    assert len(made) == 1 and made[0]._turn > 0  # the fleet took its chains from the feed
    assert len(grouped) > 100  # the pools kept their names out of the map while alone
    if case == "twins":  # members came back to find their group's names mapped or gone
        assert sum(still for _, still in noted) > 3
        assert sum(had and not still for had, still in noted) > 10
    grouped.clear()
    monkeypatch.setattr(block_hash_feed, "MIN_REQUESTS", 10**9)
    inline = _simulate(case, tokenizer, trace, step_by_step=False, hash_algo="builtin")
    assert len(made) == 1 and not grouped
    assert ahead == inline


# Each replica of the case's fleet fails once; in "prefix hits" all three are down
# together for a while (2.2-2.5 s), so arrivals and re-routed requests wait for one.
OUTAGES = {
    "prefix hits": [ReplicaOutage(1.5, 1, 1.0), ReplicaOutage(2.0, 0, 1.0),
                    ReplicaOutage(2.2, 2, 0.3), ReplicaOutage(3.5, 1, 0.5)],
    "azure lengths": [ReplicaOutage(2.0, 3, 2.0), ReplicaOutage(2.5, 5, 1.0)],
}  # fmt: skip


@pytest.mark.parametrize("case", list(OUTAGES))
def test_replica_failures_lose_what_had_started_and_move_the_rest_whichever_way_replayed(
    case: str, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With replicas failing and coming back, stepping every request, gliding, and chains
    hashed ahead still give the same records; a failure loses exactly the requests that
    had made a token, and every other request ends, re-routed or waiting for a replica."""
    trace, outages = _trace(tmp_path), OUTAGES[case]
    monkeypatch.setattr(block_hash_feed, "MIN_REQUESTS", 10**9)
    exact = _simulate(case, tokenizer, trace, True, "builtin", outages)
    glided = _simulate(case, tokenizer, trace, False, "builtin", outages)
    monkeypatch.setattr(block_hash_feed, "MIN_REQUESTS", 1)
    fed = _simulate(case, tokenizer, trace, False, "builtin", outages)
    assert glided[:2] == exact[:2] and fed[:2] == exact[:2]
    records, state, _ = exact
    reports = [report for replica in state for report in replica[-1]]
    assert len(reports) == len(outages) and all(r["landed"] is not None for r in reports)
    failed = [r for r in records if not r["success"]]
    lost = [r for r in failed if "failed after the request's first token" in r["error"]]
    assert len(lost) == sum(r["lost"] for r in reports) > 0
    assert all(r["first_token_time"] is None for r in lost)  # their tokens went with it
    assert sum(r["rerouted"] for r in reports) > 0
    timed_out = sum(r["timed_out"] for r in reports)
    assert len(failed) == len(lost) + timed_out  # every other request finished
    if case == "prefix hits":
        assert sum(r["waited"] for r in reports) > 0 and timed_out == 0
    baseline, _, _ = _simulate(case, tokenizer, trace, False, "builtin")
    ttft = {r["request_id"]: r["first_token_time"] - r["arrival_time"] for r in baseline}
    moved = [
        r
        for r in records
        if r["success"]
        and r["first_token_time"] - r["arrival_time"] > 10 * ttft[r["request_id"]] + 0.1
    ]
    assert moved  # the ones that waited or moved kept their arrival: the detour shows


def test_a_fed_chain_is_the_one_the_pool_hashes_for_the_finished_request(
    tokenizer: Any, tmp_path: Path
) -> None:
    spec = WorkloadSpec("azure-lengths", 30, trace=_trace(tmp_path))
    workload = build_workload(spec, tokenizer)
    order = list(range(29, -1, -1))
    feed = block_hash_feed.BlockHashFeed(workload.requests, order, 16, 0)
    try:
        for i in order:
            wanted = workload.requests[i]
            request = Request(str(i), wanted.token_ids(), SamplingParams(), 0.0)
            placeholders = [SimulatedExecutor.PLACEHOLDER_TOKEN] * wanted.output_len
            request.append_output_tokens(placeholders, [0.0] * wanted.output_len)  # as sampled
            pool = KVCacheManager(1, 16, hash_algo="builtin")
            fed = feed.next()
            assert (fed.chain, fed.prepared) == (pool._hashes_for(request), None)
    finally:
        feed.close()


def _engine(steady: bool) -> SteadyEngineCore:
    clock = VirtualClock()
    executor = SimulatedExecutor(
        RooflineCostModel(HARDWARE["a100-80g"], MODELS["llama3-8b"]), clock
    )
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=200))
    engine = SteadyEngineCore.build(config, executor, 200, 4096, clock)
    if steady:
        engine.scheduler.advance_decodes_together(executor.PLACEHOLDER_TOKEN)
    return engine


def test_an_aborted_member_leaves_with_the_tokens_it_made() -> None:
    """Aborts and a stop token: members catch up before they go, as if never aside."""
    finished = {}
    for steady in (False, True):
        engine = _engine(steady)
        for i in range(6):
            params = SamplingParams(max_tokens=40 + 7 * i, ignore_eos=True)
            if i == 5:
                params = SamplingParams(max_tokens=50, stop_token_ids=[0])  # stops at once
            engine.scheduler.add_request(Request(str(i), list(range(1, 30 + 9 * i)), params, 0.0))
        ended: list[Request] = []
        step = 0
        while engine.has_unfinished():
            engine.step()
            step += 1
            if step in (9, 17):
                request = engine.scheduler.finish_request(
                    str(step % 5), RequestStatus.FINISHED_ABORTED
                )
                assert request is not None
                ended.append(request)
            engine.scheduler.check_invariants()
        assert engine.scheduler.kv_cache_stats().num_used_blocks == 0
        finished[steady] = [
            (r.request_id, r.output_token_ids, r.num_computed_tokens, r.timings) for r in ended
        ]
        finished[steady, "steps"] = engine.stats.num_steps
    assert finished[True] == finished[False]
    assert finished[True, "steps"] == finished[False, "steps"]
    assert len(finished[True][0][1]) == 9  # aborted mid-decode: a token a step, prefill's too


def test_requests_finish_in_the_order_and_steps_of_stepping_every_request() -> None:
    """Members finish among a step's own decodes in admission order, as by the book: the
    order frees their blocks, which decides what the pool evicts later."""
    rng = random.Random(5)
    plan = [(rng.randrange(12), rng.randrange(1, 14), rng.randrange(5, 60)) for _ in range(40)]
    seen = {}
    for steady in (False, True):
        engine = _engine(steady)
        finishes: list[list[str]] = []
        step = 0
        while step < 12 or engine.has_unfinished():
            for i, (arrival, max_tokens, prompt_len) in enumerate(plan):
                if arrival == step:
                    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                    prompt = [1 + (i + t) % 97 for t in range(prompt_len)]
                    engine.scheduler.add_request(Request(str(i), prompt, params, 0.0))
            updates = engine.step().updates
            finishes.append([u.request_id for u in updates if u.finished])
            step += 1
        kv = engine.scheduler.kv
        seen[steady] = finishes, [kv.block_name(b) for b in kv._free]
    assert seen[True] == seen[False]
    assert sum(len(ids) > 1 for ids in seen[True][0]) >= 5  # steps that finish several


def test_a_feed_whose_process_dies_says_so() -> None:
    # 8 MB of chains in all: more than a pipe holds, so most are never sent.
    requests = [WorkloadRequest(list(range(1590)), 10) for _ in range(10_000)]
    feed = block_hash_feed.BlockHashFeed(requests, list(range(10_000)), 16, 0)
    try:
        assert len(feed.next()[0]) == 100  # (1590 + 10) // 16 full blocks
        os.kill(feed._process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="block hash process ended early"):
            for _ in range(10_000):
                feed.next()
    finally:
        feed.close()
