"""How fast the fleet simulator replays a large trace, against a baseline revision run at
the same time.

This machine's speed drifts by 10-20% from one minute to the next, more than most changes
to the simulator are worth, so the two runs go side by side, one on each core, and are
compared by their ratio. Each simulates 64 A100s behind the prefix-affinity router on
azure-lengths requests at 380 req/s (the README's million-request command, shorter) and
reports its wall time per `--every` arrivals: the first block is the fleet filling up, the
later ones its steady state, which is what a million requests cost.

A change that puts work on the second core (sim/block_hash_feed.py does) cannot be
timed beside another run: `--alternate ROUNDS` runs the two one after the other instead,
each alone, ROUNDS times, and compares their summed wall times.

    .venv/bin/python benchmarks/fleet_replay.py --baseline main~3 --num-requests 200000
    .venv/bin/python benchmarks/fleet_replay.py --baseline main~1 --alternate 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def replay(num_requests: int, every: int) -> dict[str, object]:
    """Simulate in this process; the wall time of each block of `every` arrivals."""
    try:
        from iterserve.sim import fleet
    except ImportError:  # a baseline revision from before the simulator had its package
        from iterserve.bench import fleet  # type: ignore[no-redef]
    from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
    from iterserve.bench.tokenizer import load_tokenizer
    from iterserve.bench.workloads import WorkloadSpec, build_workload
    from iterserve.config import CacheConfig, EngineConfig, SchedulerConfig

    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
        cache=CacheConfig(prefix_caching_hash_algo="builtin"),
    )
    spec = WorkloadSpec(name="azure-lengths", num_requests=num_requests)
    workload = build_workload(spec, load_tokenizer(config.model))
    offsets = arrival_offsets(ArrivalSpec("poisson", 380.0), num_requests, config.seed)
    blocks: list[float] = []
    # The arrival hook: FleetReplay's method, or the module's function in older revisions.
    owner = getattr(fleet, "FleetReplay", fleet)
    arrive, arrived, mark = owner._arrive, [0], [time.perf_counter()]

    def timed_arrive(*args):  # type: ignore[no-untyped-def]
        arrived[0] += 1
        if arrived[0] % every == 0:
            now = time.perf_counter()
            blocks.append(now - mark[0])
            mark[0] = now
        return arrive(*args)

    owner._arrive = timed_arrive
    started, started_cpu = time.perf_counter(), time.process_time()
    _, replicas = fleet.simulate_fleet(
        config, workload, offsets, "a100-80g", "llama3-8b", replicas=64, router="prefix-affinity"
    )
    wall = time.perf_counter() - started
    # This process's CPU time, the block hash feed's (another process) left out: less
    # swayed than wall time by other jobs sharing the cores, though their use of the
    # caches still shows in it.
    cpu = time.process_time() - started_cpu
    steps = sum(r.engine.stats.num_steps for r in replicas)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "steps": steps,
        "block_s": blocks,
        "source": fleet.__file__,
    }


def against(
    baseline: str, num_requests: int, every: int, rounds: int
) -> dict[str, list[dict[str, object]]]:
    """This tree and `baseline` (a git revision, checked out in a temporary worktree),
    each in its own process: at the same time (`rounds` 0), or one after the other,
    `rounds` times."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "baseline"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), baseline],
            check=True,
        )
        try:
            command = [sys.executable, __file__, "--child", f"--num-requests={num_requests}"]
            command.append(f"--every={every}")
            sources = {"this tree": REPO / "src", baseline: tree / "src"}
            results: dict[str, list[dict[str, object]]] = {name: [] for name in sources}
            for _ in range(max(1, rounds)):
                runs = {}
                for name, src in sources.items():
                    runs[name] = subprocess.Popen(
                        command, stdout=subprocess.PIPE, env=_with_source(src)
                    )
                    if rounds:  # alone: wait for it before the next starts
                        runs[name].wait()
                for name, run in runs.items():
                    results[name].append(json.loads(run.communicate()[0]))
            return results
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True
            )


def _with_source(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision to run beside this tree")
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="with --baseline: run the two one after the other, ROUNDS times, not side by side",
    )
    parser.add_argument("--num-requests", type=int, default=200_000)
    parser.add_argument("--every", type=int, default=50_000, help="arrivals a timed block")
    parser.add_argument("--result-json", default="bench_results/fleet_replay.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(replay(args.num_requests, args.every)))
        return
    if args.baseline:
        results = against(args.baseline, args.num_requests, args.every, args.alternate)
    else:
        results = {"this tree": [replay(args.num_requests, args.every)]}
    for name, runs in results.items():
        for result in runs:
            blocks = " ".join(f"{s:5.1f}" for s in result["block_s"])  # type: ignore[attr-defined]
            print(
                f"{name:>12}: {result['wall_s']:6.1f} s ({result['cpu_s']:.1f} s CPU), "
                f"{result['steps']} steps; per block: {blocks}"
            )
    if args.baseline:
        wall = {name: sum(r["wall_s"] for r in runs) for name, runs in results.items()}  # type: ignore[misc]
        cpu = {name: sum(r["cpu_s"] for r in runs) for name, runs in results.items()}  # type: ignore[misc]
        print(
            f"this tree / {args.baseline}: x{wall['this tree'] / wall[args.baseline]:.3f} wall "
            f"time, x{cpu['this tree'] / cpu[args.baseline]:.3f} CPU time"
        )
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
