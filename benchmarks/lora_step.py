"""A decode step with LoRA adapters against the base model's, on the bundled model, one run.

Two engines on the bundled model (its defaults: the GGUF's own blocks on iterserve's tiled
kernels): the base, and one with --enable-lora --max-loras 8 --max-lora-rank 16, whose
fused C++ layers add the adapters' deltas (kernels/csrc/lora.cpp; the plan line says how each
engine's layers run). --rows sequences of --context tokens are prefilled in each, then one
decode step of all of them is timed, alternating between:

  base        the base engine's step (every row the base model)
  lora        the LoRA engine's step, the rows spread evenly over --adapters adapters (rank
              --rank, every linear layer: q, k, v, o, gate, up, down), slots all resident
  lora-base   the LoRA engine's step with every row on the base model (what serving
              adapters costs a step that uses none)

and prints each median, and lora / base as the ratio the issue's bar is on (a LoRA step at
least 0.7x the base's speed, i.e. base / lora >= 0.7). Times are the network's forward only
(PagedModel.forward), medians of interleaved repeats. The first line says the kernels' ISA
and the CPU's vector extensions; uptime's load goes beside the figures (a shared machine:
compare ratios, not times). Asserts nothing.

    .venv/bin/python benchmarks/lora_step.py [--rows 32 --adapters 8 --rank 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from _timing import interleaved, one_round  # type: ignore[import-not-found]
from iterserve import kernels
from iterserve.bench.machine import cpu_line
from iterserve.engine.llm import LLM
from iterserve.executor.paged_model import ForwardSeq, PagedModel
from iterserve.model.lora_weights import AdapterWeights, LoRAModule

BLOCK = 16


def random_adapter(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> AdapterWeights:
    generator = torch.Generator().manual_seed(seed)
    return AdapterWeights(
        {
            name: LoRAModule(
                torch.randn(rank, k, generator=generator) * 0.01,
                torch.randn(n, rank, generator=generator) * 0.01,
            )
            for name, (n, k) in shapes.items()
        }
    )


def decode_step(network: PagedModel, rows: int, context: int, slots: list[int]) -> list[ForwardSeq]:
    """Prefill `rows` sequences of `context` tokens; the decode step after them, by slot."""
    per_seq = context // BLOCK + 1
    seqs = []
    for i in range(rows):
        blocks = tuple(range(i * per_seq, (i + 1) * per_seq))
        prompt = [(17 * i + 3 * p) % 20000 + 100 for p in range(context)]
        network.forward([ForwardSeq(blocks, 0, prompt, 1, lora_slot=slots[i])])
        seqs.append(ForwardSeq(blocks, context, [42 + i], 1, lora_slot=slots[i]))
    return seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--json", default="benchmarks/results/lora_step.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line(), f"kernels: {kernels.isa()}")
    blocks = args.rows * (args.context // BLOCK + 1)
    common = {"num_kv_blocks": blocks, "max_num_seqs": args.rows, "block_size": BLOCK}
    base = LLM(**common).engine
    lora = LLM(**common, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank).engine
    print("base:", base.model_plan.step, base.model_plan.weights, "| lora:", lora.model_plan.step)
    base_net: PagedModel = base.executor.network
    lora_net: PagedModel = lora.executor.network
    assert lora_net.lora is not None
    for slot in range(args.adapters):
        lora_net.lora.load_slot(slot, random_adapter(lora_net.lora.shapes, args.rank, slot))
    spread = [i % args.adapters for i in range(args.rows)]
    steps = {
        "base": (base_net, decode_step(base_net, args.rows, args.context, [-1] * args.rows)),
        "lora": (lora_net, decode_step(lora_net, args.rows, args.context, spread)),
    }
    on_base = [ForwardSeq(s.block_ids, s.start, s.token_ids, 1) for s in steps["lora"][1]]
    steps["lora-base"] = (lora_net, on_base)
    fns = {
        name: (lambda net=net, seqs=seqs: net.forward(seqs)) for name, (net, seqs) in steps.items()
    }
    for _ in range(3):
        one_round(fns)
    start = time.perf_counter()
    medians = interleaved(fns, args.repeats)
    load = os.getloadavg()
    for name, seconds in medians.items():
        print(f"{name:10s} {seconds * 1e3:8.2f} ms")
    ratio = medians["base"] / medians["lora"]
    print(f"lora step speed / base step speed: {ratio:.2f}x (bar: 0.7x)")
    print(
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads"
    )
    write_results(
        args.json,
        {
            "cpu": cpu_line(),
            "isa": kernels.isa(),
            "rows": args.rows,
            "adapters": args.adapters,
            "rank": args.rank,
            "context": args.context,
            "median_ms": {k: v * 1e3 for k, v in medians.items()},
            "lora_speed_vs_base": ratio,
            "load_average": load,
            "threads": torch.get_num_threads(),
            "seconds": time.perf_counter() - start,
            "date": time.strftime("%Y-%m-%d"),
        },
    )


if __name__ == "__main__":
    main()
