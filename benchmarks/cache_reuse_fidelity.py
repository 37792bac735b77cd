"""How approximate `--cache-reuse` is on a trained model: greedy answers to an editor's
moved windows, copied K/V against computed.

A window of `--lines` lines of a source file (this repository's own Python, an editor's
kind of text) is asked first; then the window moved down by `shift` lines (the first lines
gone, as many new ones at the end) is asked of two engines: one that computes it (its
prefix cache finds nothing: the window's start moved) and one with `--cache-reuse N`,
which copies the lines both windows share at their new positions, the keys turned, and
computes the rest. Shift 0 is the control: the same window with lines added at the end,
which the prefix cache serves exactly, so what differs there is the steps' shapes alone
(a chunk of other rows; bf16 kernels round by shape, float32 hardly).

Printed per shift: the share of the prompt reused, how often the first answer token is the
same, the mean number of leading answer tokens that agree, how many whole answers agree, and
the gap between the engines' log-probabilities of the computed answer's first token. Both
engines run the same model at `--dtype`, one at a time; asserts nothing.

    cd benchmarks && ../.venv/bin/python cache_reuse_fidelity.py [--model PATH]
        [--cases 12] [--shifts 0,1,4,12] [--lines 48] [--tokens 32] [--cache-reuse 64]
        [--dtype auto]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from pathlib import Path
from typing import Any

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from greedy_agreement import first_difference  # type: ignore[import-not-found]
from iterserve.bench.machine import cpu_line
from iterserve.engine.llm import LLM
from iterserve.engine.outputs import RequestOutput
from iterserve.model.bundled import default_model_path
from iterserve.sampling_params import SamplingParams

SOURCES = Path(__file__).resolve().parent.parent / "src" / "iterserve"


def windows(cases: int, lines: int, shifts: list[int], seed: int) -> list[tuple[str, int, int]]:
    """(file, first line, shift) for each case and shift: windows of files long enough."""
    files = sorted(p for p in SOURCES.rglob("*.py") if len(p.read_text().splitlines()) > 3 * lines)
    rng = random.Random(seed)
    picked = []
    for _ in range(cases):
        path = rng.choice(files)
        first = rng.randrange(len(path.read_text().splitlines()) - lines - max(shifts))
        picked += [(str(path.relative_to(SOURCES)), first, shift) for shift in shifts]
    return picked


def text_of(name: str, first: int, lines: int) -> str:
    return "\n".join((SOURCES / name).read_text().splitlines()[first : first + lines]) + "\n"


def answers(
    model: str, dtype: str, reuse: int, cases: list[tuple[str, int, int]], args: argparse.Namespace
) -> tuple[list[RequestOutput], list[float]]:
    """Each case's moved window answered after its first window, and the seconds each moved
    window took; the engine is gone on return."""
    llm = LLM(model, dtype=dtype, cache_reuse=reuse, kv_cache_memory=1.0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=20)
    outputs, seconds = [], []
    for name, first, shift in cases:
        llm.engine.scheduler.reset_prefix_cache()
        start_lines = args.lines if shift else args.lines - 8  # the control grows by 8
        llm.generate([text_of(name, first, start_lines)], params, use_tqdm=False)
        began = time.perf_counter()
        moved = llm.generate([text_of(name, first + shift, args.lines)], params, use_tqdm=False)
        seconds.append(time.perf_counter() - began)
        outputs += moved
    del llm
    gc.collect()
    return outputs, seconds


def summary(
    cases: list[tuple[str, int, int]],
    exact: list[RequestOutput],
    reused: list[RequestOutput],
    times: tuple[list[float], list[float]],
    shift: int,
) -> dict[str, Any]:
    rows = [i for i, case in enumerate(cases) if case[2] == shift]
    agree, same_first, whole, gaps, shares = [], 0, 0, [], []
    for i in rows:
        ours, theirs = reused[i].outputs[0], exact[i].outputs[0]
        differs = first_difference(ours.token_ids, theirs.token_ids)
        agree.append(len(theirs.token_ids) if differs is None else differs)
        same_first += ours.token_ids[0] == theirs.token_ids[0]
        whole += differs is None
        top = theirs.token_ids[0]
        if ours.logprobs and theirs.logprobs and top in ours.logprobs[0]:
            gaps.append(abs(ours.logprobs[0][top].logprob - theirs.logprobs[0][top].logprob))
        shares.append(reused[i].num_cached_tokens / len(reused[i].prompt_token_ids))
    return {
        "shift": shift,
        "cases": len(rows),
        "reused_share": statistics.fmean(shares),
        "same_first_token": same_first / len(rows),
        "leading_agreement": statistics.fmean(agree),
        "whole_answers_same": whole / len(rows),
        "first_logprob_gap_median": statistics.median(gaps) if gaps else None,
        "first_logprob_gap_max": max(gaps) if gaps else None,
        "seconds_computed": statistics.fmean(times[0][i] for i in rows),
        "seconds_reused": statistics.fmean(times[1][i] for i in rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--shifts", default="0,1,4,12")
    parser.add_argument("--lines", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--cache-reuse", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench_results/cache_reuse_fidelity.json")
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    model = args.model or str(default_model_path())
    shifts = [int(s) for s in args.shifts.split(",")]
    cases = windows(args.cases, args.lines, shifts, args.seed)
    exact, exact_times = answers(model, args.dtype, 0, cases, args)
    reused, reused_times = answers(model, args.dtype, args.cache_reuse, cases, args)
    table = [summary(cases, exact, reused, (exact_times, reused_times), s) for s in shifts]
    print(f"{'shift':>5} {'reused':>7} {'same 1st':>9} {'agree (of ' + str(args.tokens) + ')':>14} "
          f"{'whole same':>11} {'1st logprob gap':>16} {'s computed':>11} {'s reused':>9}")  # fmt: skip
    for row in table:
        gap = row["first_logprob_gap_median"]
        print(f"{row['shift']:>5} {row['reused_share']:>7.0%} {row['same_first_token']:>9.0%} "
              f"{row['leading_agreement']:>14.1f} {row['whole_answers_same']:>11.0%} "
              f"{'-' if gap is None else f'{gap:.3f}':>16} {row['seconds_computed']:>11.3f} "
              f"{row['seconds_reused']:>9.3f}")  # fmt: skip
    write_results(args.json, {"cpu": cpu_line(), "args": vars(args), "model": model,
                              "cases": cases, "shifts": table})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
