"""`iterserve bench profile`: time the real engine's steps over a grid of shapes and write a
cost profile (sim/cost_profile.py) for the simulator.

Whole `LLMEngine.step()` calls are timed on the wall clock, so a profiled step costs what
the engine loop pays for it: scheduling, the forward, sampling and detokenizing.

  decode   for each context C and batch size B: B requests with C-token prompts are
           prefilled (untimed), then `--repeats` of their decode steps are timed (median)
  prefill  for each prefix P: one request with a P-token prompt is run to put P in the
           prefix cache (P a multiple of the block size; 0 needs none), then requests of
           P + n tokens, whose first P come from the cache, are timed on the one step that
           computes their n new tokens (median of `--repeats`)

Prompts are ordinary tokens drawn at random, so no two requests share a block by chance.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any

import numpy as np

from iterserve.config import EngineConfig
from iterserve.sampling_params import SamplingParams
from iterserve.sim.cost_profile import CostProfile, Grid, per_kv_token


@dataclass(frozen=True)
class ProfileGrid:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    contexts: tuple[int, ...] = (128, 512)
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024)
    prefixes: tuple[int, ...] = (0, 1024, 4096)
    repeats: int = 5

    def fitting(self, config: EngineConfig, max_request_tokens: int) -> ProfileGrid:
        """This grid cut to what one engine with `config` runs as asked: prefill chunks up
        to one step's token budget (which then is the largest), batches up to its
        --max-num-seqs (likewise), contexts and prefix + chunk within one request's
        room (`max_request_tokens`), keeping at least the smallest of each."""
        budget = config.scheduler.max_num_batched_tokens
        seqs = config.scheduler.max_num_seqs
        tokens = sorted({n for n in self.prefill_tokens if n < budget} | {budget})
        room = max_request_tokens // 2  # decodes go on growing while the batch fills
        return replace(
            self,
            batch_sizes=tuple(sorted({b for b in self.batch_sizes if b < seqs} | {seqs})),
            prefill_tokens=tuple(tokens),
            contexts=_within(self.contexts, room),
            prefixes=_within(self.prefixes, max_request_tokens - tokens[-1]),
        )


def _within(values: tuple[int, ...], limit: int) -> tuple[int, ...]:
    return tuple(v for v in values if v <= limit) or values[:1]


def profile_engine(
    engine: Any,
    grid: ProfileGrid,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> CostProfile:
    """Time `engine` (an LLMEngine, idle, nothing queued) over `grid`. It must run its steps
    in order: with asynchronous scheduling a step() call takes the results of the step
    before the one it plans, so a timed call would price another step than its own."""
    from iterserve.bench.tokenizer import ordinary_token_ids

    if engine.core.async_scheduling:
        raise ValueError(
            "a cost profile times steps one by one: profile an engine with "
            "--no-async-scheduling (or give --cost-profile)"
        )

    vocab = np.asarray(ordinary_token_ids(engine.tokenizer))
    rng = np.random.default_rng(seed)

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.choice(vocab, size=n)]

    say = progress or (lambda _: None)
    decode = []
    for context in grid.contexts:
        column = _decode_column(engine, grid, context, prompt)
        say(f"decode, context {context}: " + _ms(column))
        decode.append(column)
    prefill = []
    for tokens in grid.prefill_tokens:
        row = [_prefill_point(engine, grid, tokens, prefix, prompt) for prefix in grid.prefixes]
        say(f"prefill of {tokens} tokens, prefixes {list(grid.prefixes)}: " + _ms(row))
        prefill.append(row)
    measured = Grid(
        [float(b) for b in grid.batch_sizes],
        [float(c) for c in grid.contexts],
        [list(r) for r in zip(*decode, strict=True)],  # [batch][context]
    )
    about = _about(engine, grid) | {"decode_measured_seconds": measured.seconds}
    return CostProfile(
        decode=per_kv_token(measured),
        prefill=Grid(
            [float(n) for n in grid.prefill_tokens], [float(p) for p in grid.prefixes], prefill
        ),
        about=about,
    )


def _ms(seconds: Sequence[float]) -> str:
    return ", ".join(f"{1e3 * s:.1f}" for s in seconds) + " ms"


def _step_seconds(engine: Any) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _decode_column(
    engine: Any, grid: ProfileGrid, context: int, prompt: Callable[[int], list[int]]
) -> list[float]:
    """Median decode step seconds at each batch size (ascending), at `context` tokens.

    Each batch size gets requests of its own, prefilled afresh, rather than the survivors
    of a bigger batch cut down (whose blocks were handed out among many others'). That
    alone did not make the few-request rows' context slopes agree with real runs; the
    profile prices context by `per_kv_token` instead (cost_profile.py)."""
    room = engine.max_request_tokens() - context
    params = SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True)
    _check_fits(engine, grid, context)
    seconds = []
    for size in sorted(grid.batch_sizes):
        live = [engine.add_request(prompt(context), params) for _ in range(size)]
        started: set[str] = set()
        while len(started) < size:  # prefill everyone (untimed)
            started.update(o.request_id for o in engine.step().outputs if o.token_ids)
        _step_seconds(engine)  # the first all-decode step: not counted
        seconds.append(statistics.median(_step_seconds(engine) for _ in range(grid.repeats)))
        for request_id in live:
            engine.abort_request(request_id)
    return seconds


def _check_fits(engine: Any, grid: ProfileGrid, context: int) -> None:
    """Refuse a batch that would preempt itself (then it is not a decode step any more)."""
    size = max(grid.batch_sizes)
    budget = engine.config.scheduler.max_num_batched_tokens
    # Early requests decode while later ones still prefill.
    growth = -(-size * context // max(1, budget - size)) + grid.repeats + 2
    needed = size * -(-(context + growth) // engine.config.cache.block_size)
    available = engine.scheduler.kv_cache_stats().num_blocks
    if needed > available:
        raise ValueError(
            f"{size} requests of {context} tokens need ~{needed} KV blocks, the pool has "
            f"{available}: lower --batch-sizes or --contexts, or raise the KV cache"
        )


def _prefill_point(
    engine: Any, grid: ProfileGrid, tokens: int, prefix: int, prompt: Callable[[int], list[int]]
) -> float:
    """Median seconds of the step that computes `tokens` new prompt tokens after `prefix`
    cached ones."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    shared = prompt(prefix)
    if prefix:
        engine.add_request(shared + prompt(1), one)  # caches the prefix's blocks
        while engine.has_unfinished():
            engine.step()
    samples = []
    for _ in range(grid.repeats):
        engine.add_request(shared + prompt(tokens), one)
        samples.append(_step_seconds(engine))
        while engine.has_unfinished():
            engine.step()
    engine.reset_prefix_cache()
    return statistics.median(samples)


def _about(engine: Any, grid: ProfileGrid) -> dict[str, Any]:
    import torch

    from iterserve.bench.machine import cpu_line

    config: EngineConfig = engine.config
    plan = engine.model_plan
    return {
        "measured": True,
        "model": engine.model_name,
        "weights": plan.weights,
        "kernels": plan.backend,
        "step": plan.step,
        "device": config.device,
        "cpu": platform.processor() or platform.machine(),
        "isa": plan.kernels_isa or "none",  # the kernels' variant (ITERSERVE_ISA), if any
        "cpu_line": cpu_line(),
        "threads": torch.get_num_threads(),
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "block_size": config.cache.block_size,
        "engine_version": metadata.version("iterserve"),
        "torch_version": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "repeats": grid.repeats,
    }


def check_grid(grid: ProfileGrid, config: EngineConfig) -> None:
    """Refuse a grid no engine settings can run as asked (a step's token budget and the
    number of sequences are raised to the grid's, by `_run_profile`)."""
    block = config.cache.block_size
    if any(p % block for p in grid.prefixes):
        raise ValueError(f"--prefixes must be multiples of the block size ({block})")
    if grid.repeats < 1:
        raise ValueError("--repeats must be at least 1")
