"""Routing policies (replicas/router.py) and the simulator's fleet behind them."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.metrics import compute_metrics
from iterserve.bench.workloads import WorkloadSpec, build_workload
from iterserve.config import CacheConfig, EngineConfig
from iterserve.replicas.router import (
    LeastOutstandingTokens,
    NoReplicaError,
    PowerOfTwoChoices,
    PrefixAffinity,
    ReplicaLoad,
    RoundRobin,
    make_router,
)
from iterserve.sim.fleet import FleetLoadTracker, simulate_fleet


def loads(*tokens: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(t, 1 if t else 0) for t in tokens]


def test_round_robin_takes_turns_blind_to_load() -> None:
    router = RoundRobin()
    assert [router.route([1], loads(0, 900, 0)) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_tokens_picks_the_lightest_and_breaks_ties_low() -> None:
    router = LeastOutstandingTokens()
    assert router.route([1], loads(50, 20, 20)) == 1
    assert router.route([1], loads(0, 0)) == 0


def test_power_of_two_takes_the_lighter_of_two_and_is_seeded() -> None:
    picks = [PowerOfTwoChoices(seed=5).route([1], loads(9, 1, 5, 7)) for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same draw
    router = PowerOfTwoChoices(seed=1)
    counts = [0, 0, 0, 0]
    for _ in range(400):
        counts[router.route([1], loads(9, 1, 5, 7))] += 1
    assert counts[0] == 0  # the heaviest loses every pair it is drawn in
    assert counts[1] > counts[2] > counts[3] > 0
    assert PowerOfTwoChoices().route([1], loads(3)) == 0


def test_prefix_affinity_keeps_a_prefix_home_and_spreads_prefixes() -> None:
    router = PrefixAffinity(block_size=4, affinity_blocks=2)
    rng = random.Random(0)
    homes = []
    for _ in range(60):
        prefix = [rng.randrange(1000) for _ in range(8)]
        picks = {router.route(prefix + [rng.randrange(1000)], loads(0, 0, 0, 0)) for _ in range(3)}
        assert len(picks) == 1  # the suffix past the affinity blocks does not matter
        homes.append(picks.pop())
    assert set(homes) == {0, 1, 2, 3}


def test_prefix_affinity_leaves_an_overloaded_home_and_routes_short_prompts_by_load() -> None:
    router = PrefixAffinity(block_size=4, affinity_blocks=2, balance_factor=2.0)
    prompt = list(range(12))
    home = router.route(prompt, loads(0, 0, 0))
    busy = [ReplicaLoad(100, 1)] * 3
    assert router.route(prompt, busy) == home  # all equally busy: stay
    busy[home] = ReplicaLoad(212, 2)  # 2 x 100 + 12 tokens of prompt: still allowed
    assert router.route(prompt, busy) == home
    busy[home] = ReplicaLoad(213, 2)
    assert router.route(prompt, busy) != home
    assert router.route([1, 2, 3], loads(5, 0, 9)) == 1  # no full block: least loaded


def test_a_replica_out_of_routing_is_skipped_by_every_policy_until_it_is_back() -> None:
    for name in ("round-robin", "least-tokens", "power-of-two", "prefix-affinity"):
        router = make_router(name, block_size=4)
        router.set_available(1, False)
        picks = {router.route(list(range(i, i + 20)), loads(0, 0, 5)) for i in range(40)}
        assert picks <= {0, 2} and picks, name
        router.set_available(0, False)
        router.set_available(2, False)
        with pytest.raises(NoReplicaError):
            router.route([1] * 20, loads(0, 0, 0))
        for index in range(3):
            router.set_available(index, True)
        back = {router.route(list(range(i, i + 20)), loads(9, 0, 9)) for i in range(40)}
        assert 1 in back, name


def test_prefix_affinity_moves_only_an_absent_replicas_prefixes_and_back() -> None:
    router = PrefixAffinity(block_size=4, affinity_blocks=2)
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(8)] for _ in range(200)]
    homes = [router.route(p, loads(0, 0, 0, 0)) for p in prompts]
    router.set_available(2, False)
    away = [router.route(p, loads(0, 0, 0, 0)) for p in prompts]
    assert all(a == h for a, h in zip(away, homes, strict=True) if h != 2)  # others stay
    moved = [a for a, h in zip(away, homes, strict=True) if h == 2]
    assert moved and 2 not in moved and len(set(moved)) > 1  # spread, by each one's ranking
    router.set_available(2, True)
    assert [router.route(p, loads(0, 0, 0, 0)) for p in prompts] == homes


def test_make_router_names_every_policy_and_refuses_others() -> None:
    for name in ("round-robin", "least-tokens", "power-of-two", "prefix-affinity"):
        assert make_router(name, block_size=16).route([1] * 40, loads(0, 0)) in (0, 1)
    with pytest.raises(ValueError, match="unknown router 'random'"):
        make_router("random", block_size=16)
    with pytest.raises(ValueError, match="balance_factor"):
        PrefixAffinity(block_size=16, balance_factor=0.5)


# ---- the simulated fleet ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_with_one_replica_every_router_gives_the_same_run(tokenizer) -> None:  # type: ignore[no-untyped-def]
    workload = build_workload(
        WorkloadSpec(num_requests=40, input_len=300, output_len=60), tokenizer
    )
    offsets = arrival_offsets(ArrivalSpec(request_rate=30.0), 40, seed=2)
    runs = []
    for router in ("round-robin", "least-tokens", "power-of-two", "prefix-affinity"):
        records, fleet = simulate_fleet(
            EngineConfig(), workload, offsets, "a100-80g", "llama3-8b", router=router
        )
        assert len(fleet) == 1 and fleet[0].tracker.num_routed == 40
        runs.append([(r.first_token_time, r.token_times) for r in records])
    assert all(run == runs[0] for run in runs)


def test_a_fleet_serves_everyone_and_prefix_affinity_finds_more_cached_prefixes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Four replicas with small KV caches, 31 prompt prefixes of 512 tokens: spread by
    round-robin every replica cycles through all prefixes and evicts them before reuse;
    kept home by prefix-affinity each replica holds its own quarter. (The workload takes
    prefixes in turn, request i the (i mod 31)-th: with a count divisible by the replicas,
    round-robin would partition them by accident.)"""
    spec = WorkloadSpec(
        name="shared-prefix", num_requests=400, input_len=64, output_len=32,
        prefix_len=512, num_prefixes=31,
    )  # fmt: skip
    workload = build_workload(spec, tokenizer)
    offsets = arrival_offsets(ArrivalSpec(request_rate=40.0), 400, seed=3)
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=400))  # ~12 prefixes a replica
    results = {}
    for router in ("round-robin", "prefix-affinity"):
        records, fleet = simulate_fleet(
            config, workload, offsets, "a100-80g", "llama3-8b", replicas=4, router=router
        )
        metrics = compute_metrics(records)
        assert metrics.throughput.completed == 400
        assert all(replica.tracker.num_routed > 40 for replica in fleet)  # every replica works
        assert all(not replica.tracker.work for replica in fleet)  # loads drain to zero
        results[router] = metrics
    rr, affinity = results["round-robin"], results["prefix-affinity"]
    assert affinity.prefix_cache_hit_rate > rr.prefix_cache_hit_rate + 0.3
    assert affinity.latency.ttft.median < rr.latency.ttft.median


def test_the_load_tracker_counts_what_was_sent_less_what_came_back() -> None:
    tracker = FleetLoadTracker()  # the front end's tracker, with the fleet's made()
    tracker.take("a", prompt_tokens=100, max_tokens=10)
    tracker.take("b", prompt_tokens=20, max_tokens=5)
    assert tracker.load() == ReplicaLoad(135, 2)
    tracker.progress("a", new_tokens=1)  # its prompt is computed now
    assert tracker.load() == ReplicaLoad(34, 2)
    tracker.made(3)  # three more of a's, counted in aggregate
    assert tracker.load() == ReplicaLoad(31, 2)
    tracker.finish("b", unmade=5)  # aborted before its first token
    assert tracker.load() == ReplicaLoad(6, 1)
    tracker.finish("a", unmade=6)  # stopped after 4 of its 10
    assert tracker.load() == ReplicaLoad(0, 0) and tracker.num_routed == 2


def test_the_router_loads_neither_torch_nor_ray() -> None:
    """The simulator's fleet routes with it too, on a machine that may have neither."""
    code = (
        "import sys, iterserve.replicas.router; "
        "sys.exit('torch' in sys.modules or 'ray' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
