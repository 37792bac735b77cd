"""A model's projections at one row, in a decode step's order, by kind: what share of the
memory's speed they read at inside a step, and back to back.

A batch-1 decode step reads every weight once, so its time answers to the machine's read
bandwidth. `kquant_decode.py` and `big_models.py` time whole steps; `linear_kernels.py` and
`stream_timing.cpp` time the loops on random weights of a body's shapes. This one loads a
model (a GGUF, as the engine builds it) and calls its own projections, one row each:

  in step   every projection once a pass, layer by layer as a step calls them, each call
            timed alone: a small projection pays its call and finds the caches full of the
            previous one's weights, as in a step
  together  each kind's projections back to back over the layers (every layer's gate_up,
            then every layer's down...): the same bytes streamed with nothing between them

Between them: what a step's structure costs its projections (a call's fixed cost, the gaps),
apart from the loops' own speed. Figures against the read probe of iterserve.bench.bandwidth,
measured before and after (printed both); medians of --passes. Asserts nothing.

    .venv/bin/python benchmarks/step_linears.py MODEL.gguf [--passes 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.bandwidth import read_bandwidth
from iterserve.bench.machine import cpu_line
from iterserve.config import EngineConfig
from iterserve.model.builder import build_model, choose_dtype
from iterserve.model.linear import Linear
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import load_model


def step_order(model: LlamaForCausalLM) -> list[tuple[str, Linear]]:
    """(kind, projection) as a decode step calls them: the per-layer inputs' projection
    (Gemma 4), each layer's projections, the head."""
    calls: list[tuple[str, Linear]] = []
    if model.per_layer_inputs is not None and model.per_layer_inputs.projection is not None:
        calls.append(("per_layer_model_proj", model.per_layer_inputs.projection))
    for layer in model.layers:
        calls.extend(layer.linears.items())
    if model.head is not None:
        calls.append(("head", model.head))
    return calls


def kind_of(name: str, linear: Linear) -> str:
    return f"{name} {linear.out_features}x{linear.in_features} {linear.describe()}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="bench_results/step_linears.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    config = EngineConfig(model=str(args.model))
    device = torch.device("cpu")
    dtype, _ = choose_dtype(config, device)
    model, _ = build_model(config, load_model(str(args.model), dtype), dtype, device)
    calls = step_order(model)
    rows = {id(lin): torch.randn(1, lin.in_features).to(dtype) for _, lin in calls}
    print(cpu_line())
    probe_before = read_bandwidth(args.threads)

    in_step: dict[str, list[float]] = defaultdict(list)
    together: dict[str, list[float]] = defaultdict(list)
    by_kind: dict[str, list[Linear]] = defaultdict(list)
    for name, lin in calls:
        by_kind[kind_of(name, lin)].append(lin)
    for _, lin in calls:  # once, untimed: first touches
        lin(rows[id(lin)])
    for _ in range(args.passes):
        spent: dict[str, float] = defaultdict(float)
        for name, lin in calls:
            start = time.perf_counter()
            lin(rows[id(lin)])
            spent[kind_of(name, lin)] += time.perf_counter() - start
        for kind, seconds in spent.items():
            in_step[kind].append(seconds)
        for kind, linears in by_kind.items():
            start = time.perf_counter()
            for lin in linears:
                lin(rows[id(lin)])
            together[kind].append(time.perf_counter() - start)
    probe_after = read_bandwidth(args.threads)
    probe = (probe_before + probe_after) / 2

    results = []
    print(f"read probe {probe_before / 1e9:.1f} GB/s before, {probe_after / 1e9:.1f} after")
    print(
        f"{'ms in step':>10} {'ms together':>11} {'calls':>5} {'MB':>8} {'share in step':>13} "
        f"{'together':>8}  kind"
    )
    for kind, linears in sorted(by_kind.items(), key=lambda kv: -statistics.median(in_step[kv[0]])):
        nbytes = sum(lin.nbytes for lin in linears)
        step_s, alone_s = statistics.median(in_step[kind]), statistics.median(together[kind])
        row = {
            "kind": kind,
            "calls": len(linears),
            "bytes": nbytes,
            "ms_in_step": step_s * 1e3,
            "ms_together": alone_s * 1e3,
            "share_in_step": nbytes / step_s / probe,
            "share_together": nbytes / alone_s / probe,
        }
        results.append(row)
        print(
            f"{row['ms_in_step']:10.2f} {row['ms_together']:11.2f} {len(linears):5d} "
            f"{nbytes / 1e6:8.1f} {row['share_in_step']:13.0%} {row['share_together']:8.0%}  "
            f"{kind}"
        )
    total_bytes = sum(r["bytes"] for r in results)
    total_step = sum(r["ms_in_step"] for r in results) / 1e3
    total_together = sum(r["ms_together"] for r in results) / 1e3
    print(
        f"all {len(calls)} projections, {total_bytes / 1e9:.3f} GB: in step {total_step * 1e3:.1f}"
        f" ms ({total_bytes / total_step / probe:.0%} of the probe), together "
        f"{total_together * 1e3:.1f} ms ({total_bytes / total_together / probe:.0%})"
    )
    write_results(
        args.json,
        {
            "model": str(args.model),
            "machine": cpu_line(),
            "threads": args.threads,
            "probe_bytes_per_s": [probe_before, probe_after],
            "kinds": results,
        },
    )


if __name__ == "__main__":
    main()
