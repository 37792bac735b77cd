"""Decode speed of the bundled model, path by path, batch size by batch size, in one run.

Each batch of B requests (128-token prompts of ordinary tokens, 128 generated tokens with
ignore_eos) is submitted at once to an offline engine and run to completion. For every path
and batch size it prints:

  prefill tok/s   prompt tokens / wall time of the steps that computed prompt tokens
  decode tok/s    generated tokens of decode-only steps / their wall time
  output tok/s    all generated tokens / the batch's wall time (what a user waits for)
  step ms         median wall time of a decode-only step (the engine's whole step: schedule,
                  forward, sample, detokenize)
  outside fwd     share of the decode steps' time spent outside the network's forward
                  (scheduling, batch and metadata building, sampling, detokenizing)

plus each path's start-up time (load + kernel build + compile/warm-up). Paths (--paths):

  eager-bf16     --kernels torch --no-compile --dtype bfloat16: plain torch ops, the reference
  compiled-bf16  --kernels torch --dtype bfloat16: the same network through torch.compile
  compiled-fp32  --kernels torch --dtype float32: torch.compile in fp32, the best torch does
                 on a CPU without bf16 arithmetic (where it emulates bf16)
  bf16           --weights bf16: iterserve's kernels, one fused C++ op per layer
  int8           --weights int8: every projection as Q8_0 blocks, int8 activations
  default        the engine's defaults: for the bundled Q4_1 GGUF, its own Q4_1 layers and
                 Q8_0 head at every step size, on int8 activations
  default-kv8    the defaults with --kv-cache-dtype int8 (K/V in 8 bits, a scale per row)
  bf16-kv8       --weights bf16 --kv-cache-dtype int8

Batch sizes run in order, each through every path before the next, so a noisy spell on
this shared machine hits all paths alike; compare ratios within one run. The kernels run in
the ISA variant the CPU picks or ITERSERVE_ISA names; the first line says which, and the
CPU's vector extensions. Asserts nothing.

    .venv/bin/python benchmarks/decode_speed.py [--batch-sizes 1,4,16,32,64] [--json out.json]
    ITERSERVE_ISA=avx2 .venv/bin/python benchmarks/decode_speed.py   # the AVX2 path
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.machine import cpu_line
from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
from iterserve.engine.llm import LLM
from iterserve.sampling_params import SamplingParams

PATHS: dict[str, dict[str, object]] = {
    "eager-bf16": {"kernels": "torch", "compile": False, "weights": "bf16", "dtype": "bfloat16"},
    "compiled-bf16": {"kernels": "torch", "weights": "bf16", "dtype": "bfloat16"},
    "compiled-fp32": {"kernels": "torch", "weights": "bf16", "dtype": "float32"},
    "bf16": {"weights": "bf16"},
    "int8": {"weights": "int8"},
    "default": {},
    "default-kv8": {"kv_cache_dtype": "int8"},
    "bf16-kv8": {"weights": "bf16", "kv_cache_dtype": "int8"},
}


@dataclass
class Row:
    path: str
    batch: int
    prefill_tok_s: float
    decode_tok_s: float
    output_tok_s: float
    decode_step_ms: float
    outside_forward: float


def run_batch(
    llm: LLM, prompts: list[list[int]], output_len: int
) -> tuple[float, float, float, float]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    prefill_time = decode_time = decode_forward = 0.0
    decode_tokens = 0
    decode_steps: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished():
        before = engine.stats.prefill_tokens, engine.stats.generated_tokens
        forward_before = engine.stats.forward_time
        step_start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - step_start
        if engine.stats.prefill_tokens > before[0]:
            prefill_time += elapsed
        else:
            decode_time += elapsed
            decode_forward += engine.stats.forward_time - forward_before
            decode_tokens += engine.stats.generated_tokens - before[1]
            decode_steps.append(elapsed)
    total = time.perf_counter() - start
    num_prompt = sum(len(p) for p in prompts)
    return (
        num_prompt / prefill_time,
        decode_tokens / decode_time if decode_time else float("nan"),
        len(prompts) * output_len / total,
        statistics.median(decode_steps) * 1e3 if decode_steps else float("nan"),
        1 - decode_forward / decode_time if decode_time else float("nan"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,16,32,64")
    parser.add_argument("--paths", default="eager-bf16,compiled-bf16,bf16,default")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default="bench_results/decode_speed.json")
    args = parser.parse_args()

    print(cpu_line(), flush=True)
    vocab = np.asarray(ordinary_token_ids(load_tokenizer(None)))
    rng = np.random.default_rng(0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = [rng.choice(vocab, size=args.prompt_len).tolist() for _ in range(max(batch_sizes))]

    engines: dict[str, LLM] = {}
    startup: dict[str, dict[str, float | str]] = {}
    for name in args.paths.split(","):
        start = time.perf_counter()
        llm = LLM(
            max_num_seqs=max(batch_sizes),
            enable_prefix_caching=False,  # every batch reuses the same prompts
            num_threads=args.threads,
            **PATHS[name],  # type: ignore[arg-type]
        )
        plan = llm.engine.model_plan
        startup[name] = {
            "seconds": time.perf_counter() - start,
            "warm_up_seconds": llm.engine.warm_up_seconds,
            "kernels": plan.backend,
            "kernels_isa": plan.kernels_isa or "",
            "dtype": plan.dtype,
            "weights": plan.weights,
            "step": plan.step,
        }
        engines[name] = llm
        print(
            f"{name:14s} start-up {startup[name]['seconds']:6.1f} s "
            f"(warm-up/compile {llm.engine.warm_up_seconds:5.1f} s): {plan.backend} kernels"
            f"{f' ({plan.kernels_isa})' if plan.kernels_isa else ''}, {plan.dtype}, "
            f"weights {plan.weights}, step {plan.step}",
            flush=True,
        )
    for llm in engines.values():  # first-step effects (allocator, caches) out of the way
        run_batch(llm, prompts[:2], 4)

    rows: list[Row] = []
    header = f"{'path':14s} {'batch':>5s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'output tok/s':>13s} {'step ms':>8s} {'outside fwd':>12s}"
    print(header)
    for batch in batch_sizes:
        for name, llm in engines.items():
            prefill, decode, output, step_ms, outside = run_batch(
                llm, prompts[:batch], args.output_len
            )
            rows.append(Row(name, batch, prefill, decode, output, step_ms, outside))
            print(
                f"{name:14s} {batch:5d} {prefill:14.0f} {decode:13.1f} {output:13.1f} "
                f"{step_ms:8.2f} {100 * outside:11.1f}%",
                flush=True,
            )
    write_results(
        args.json, {"cpu": cpu_line(), "startup": startup, "rows": [asdict(r) for r in rows]}
    )


if __name__ == "__main__":
    main()
