"""Prompt processing under several step budgets (`--max-num-batched-tokens`): tok/s and memory.

Each budget's run is a fresh process (`LLM(model, max_num_batched_tokens=B)`, prefix caching
off, so every round computes its prompts): --prompts prompts of --prompt-len tokens, each
generating one token, once to warm up, then --rounds times, timed. The budgets run in turns,
round after round of processes (--repeats), so that each meets the machine's spells alike.
With --base REV, that revision's sources (`git archive`d to a temporary directory) run the
same budgets in turns with this tree's. Beside tok/s: VmRSS after the load, after the timed
rounds, and the peak (VmHWM).

Asserts nothing.

    .venv/bin/python benchmarks/prompt_budget.py MODEL [--budgets 512,2048] [--prompts 16] \
        [--prompt-len 128] [--rounds 3] [--repeats 2] [--base REV] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.machine import cpu_line
from kv_pool_memory import REPO, baseline_src, run_child  # type: ignore[import-not-found]

_CHILD = r"""
import json, re, resource, sys, time
from iterserve.engine.llm import LLM
from iterserve.sampling_params import SamplingParams
model, budget, prompts, length, rounds = sys.argv[1], *map(int, sys.argv[2:6])
def status(field):
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
def batch(r):  # other tokens each round: nothing to find in any cache
    return [[100 + (i * 7 + j + 31 * r) % 40000 for j in range(length)] for i in range(prompts)]
llm = LLM(model, max_num_batched_tokens=budget, enable_prefix_caching=False)
loaded = status("VmRSS")
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
llm.generate(batch(0), params, use_tqdm=False)
speeds, before = [], resource.getrusage(resource.RUSAGE_SELF)
for r in range(rounds):
    start = time.perf_counter()
    llm.generate(batch(r + 1), params, use_tqdm=False)
    speeds.append(prompts * length / (time.perf_counter() - start))
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"tok_s": speeds, "rss_loaded": loaded, "rss_after": status("VmRSS"),
                  "rss_peak": status("VmHWM"), "minor_faults": after.ru_minflt - before.ru_minflt,
                  "sys_s": after.ru_stime - before.ru_stime, "user_s": after.ru_utime - before.ru_utime}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="GGUF file or HF directory")
    parser.add_argument("--budgets", default="512,2048", help="step budgets, comma-separated")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds in each process")
    parser.add_argument("--repeats", type=int, default=2, help="processes of each, in turns")
    parser.add_argument("--base", help="a git revision to run the same budgets, in turns")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "iterserve-kv"))
    parser.add_argument("--json", default="bench_results/prompt_budget.json")
    args = parser.parse_args()
    print(cpu_line(), flush=True)

    trees = {"this tree": REPO / "src"}
    if args.base:
        trees[args.base] = baseline_src(args.base, Path(args.workdir))
    budgets = [int(b) for b in args.budgets.split(",")]
    model = os.path.abspath(args.model)
    runs: dict[str, list[dict[str, Any]]] = {}
    mib = 2**20
    for repeat in range(args.repeats):
        for budget in budgets:
            for tree, src in trees.items():
                argv = (model, budget, args.prompts, args.prompt_len, args.rounds)
                run = run_child(_CHILD, src, *map(str, argv))
                runs.setdefault(f"{tree}, budget {budget}", []).append(run)
                print(
                    f"[{repeat + 1}] {tree}, budget {budget}: "
                    f"{' '.join(f'{s:.1f}' for s in run['tok_s'])} tok/s; VmRSS loaded "
                    f"{run['rss_loaded'] / mib:,.0f} MiB, after {run['rss_after'] / mib:,.0f}, "
                    f"peak {run['rss_peak'] / mib:,.0f}; {run['minor_faults']:,} page faults, "
                    f"system CPU {run['sys_s']:.2f} s of {run['sys_s'] + run['user_s']:.1f}",
                    flush=True,
                )
    for name, repeats in runs.items():
        speeds = [s for run in repeats for s in run["tok_s"]]
        peaks = [run["rss_peak"] / mib for run in repeats]
        print(
            f"{name}: median {statistics.median(speeds):.1f} tok/s "
            f"({min(speeds):.1f}-{max(speeds):.1f}), peak {min(peaks):,.0f}-{max(peaks):,.0f} MiB"
        )
    write_results(args.json, {"cpu": cpu_line(), "args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
