"""`iterserve bench profile`'s flags and run: the profiling itself is sim/profile.py."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import replace

from iterserve.sim import profile
from iterserve.sim.profile import ProfileGrid, check_grid, profile_engine


def add_profile_parser(runners: argparse._SubParsersAction) -> None:
    from iterserve.config import add_engine_args

    p = runners.add_parser(
        "profile",
        help="time the real engine's steps over a grid and write a cost profile for simulate",
        description=profile.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = ProfileGrid()
    p.add_argument("--output", "-o", required=True, help="the profile JSON to write")
    p.add_argument("--batch-sizes", default=_csv(defaults.batch_sizes))
    p.add_argument("--contexts", default=_csv(defaults.contexts))
    p.add_argument("--prefill-tokens", default=_csv(defaults.prefill_tokens))
    p.add_argument("--prefixes", default=_csv(defaults.prefixes))
    p.add_argument("--repeats", type=int, default=defaults.repeats)
    add_engine_args(p)
    p.set_defaults(func=_run_profile)


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in text.split(",") if v.strip()}))


def _run_profile(args: argparse.Namespace) -> int:
    from iterserve.config import engine_config_from_args
    from iterserve.engine.llm_engine import LLMEngine

    grid = ProfileGrid(
        _ints(args.batch_sizes),
        _ints(args.contexts),
        _ints(args.prefill_tokens),
        _ints(args.prefixes),
        args.repeats,
    )
    config = engine_config_from_args(args)
    # One prefill chunk per step, however large the grid's: the profile prices chunks by
    # size, and a run's own --max-num-batched-tokens decides which sizes it meets.
    scheduler = config.scheduler
    if max(grid.prefill_tokens) > scheduler.max_num_batched_tokens:
        scheduler = replace(scheduler, max_num_batched_tokens=max(grid.prefill_tokens))
    if max(grid.batch_sizes) > scheduler.max_num_seqs:
        scheduler = replace(scheduler, max_num_seqs=max(grid.batch_sizes))
    # Steps timed one by one (profile_engine): none planned ahead of the last one's results.
    scheduler = replace(scheduler, async_scheduling=False)
    config = replace(config, scheduler=scheduler)
    check_grid(grid, config)
    started = time.perf_counter()
    engine = LLMEngine(config)
    profile = profile_engine(engine, grid, config.seed, progress=print)
    profile.save(args.output)
    print(f"wrote {args.output} in {time.perf_counter() - started:.0f}s")
    return 0
