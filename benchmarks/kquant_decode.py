"""A K-quant GGUF (e.g. Q4_K_M) kept quantized: resident memory and one sequence's decode
speed, against the same file expanded to bf16 and against llama.cpp on the same file.

Each weights mode (--weights: `int4` keeps only the checkpoint's blocks, `auto` adds a
wide int8 copy for many-row steps, `bf16` is the expansion) runs in its own process, so its
resident set (VmRSS once warm, and the peak, load included) is its own: one sequence of
--prompt-len ordinary tokens then --output-len greedy tokens (ignore_eos), decode tok/s over
the decode-only steps. With --llama-cpp BIN_DIR (`benchmarks/peers/llama_cpp.sh path`) the
same file runs through llama-batched-bench (same prompt and output lengths, 2 threads,
one sequence) in the same run, and the peak RSS of that process is read too. Prints the
CPU's vector extensions and the kernels' ISA variant first, and each mode's linear path.

Making a Q4_K_M of the bundled model (its 576-wide rows are not whole 256-input super-blocks,
so llama.cpp stores those as Q5_0/Q8_0 and only the 1536-wide down projections as Q4_K/Q6_K):

    BIN=$(benchmarks/peers/llama_cpp.sh path)
    $BIN/llama-quantize --allow-requantize BUNDLED.BF16.gguf out.Q4_K_M.gguf Q4_K_M
    .venv/bin/python benchmarks/kquant_decode.py out.Q4_K_M.gguf --llama-cpp $BIN
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_one(model: str, weights: str, prompt_len: int, output_len: int) -> dict[str, object]:
    """In this process: build the engine, decode one sequence, report speed and memory."""
    import numpy as np

    from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
    from iterserve.engine.llm import LLM
    from iterserve.sampling_params import SamplingParams

    # A small KV cache, so that the resident set is the weights' (the default reserves 1 GiB).
    llm = LLM(
        model, weights=weights, max_num_seqs=1, enable_prefix_caching=False, kv_cache_memory=0.03
    )
    vocab = np.asarray(ordinary_token_ids(load_tokenizer(model)))
    prompt = np.random.default_rng(0).choice(vocab, size=prompt_len).tolist()
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(prompt[:8], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompt, params)
    decode_time, decode_tokens = 0.0, 0
    while engine.has_unfinished():
        prefilled, generated = engine.stats.prefill_tokens, engine.stats.generated_tokens
        start = time.perf_counter()
        engine.step()
        if engine.stats.prefill_tokens == prefilled:
            decode_time += time.perf_counter() - start
            decode_tokens += engine.stats.generated_tokens - generated
    plan = engine.model_plan
    return {
        "weights_mode": weights,
        "weights": plan.weights,
        "kernels_isa": plan.kernels_isa or "",
        "linears": plan.linears,
        "decode_tok_s": decode_tokens / decode_time,
        "rss_mib": _rss_mib(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_llama_cpp(bin_dir: str, model: str, prompt_len: int, output_len: int) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    command = [f"{bin_dir}/llama-batched-bench", "-m", model, "-c", "2048", "-npp"]
    command += [str(prompt_len), "-ntg", str(output_len), "-npl", "1", "-t", "2"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rows = [line for line in result.stdout.splitlines() if re.match(r"^\|\s*\d", line)]
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    return {
        "decode_tok_s": float(cells[7]),
        # The largest child so far: valid as llama.cpp's when it is the largest child run.
        "peak_rss_mib": max(peak, before) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--weights", default="int4,auto,bf16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--llama-cpp", default=None, help="llama.cpp's bin directory")
    parser.add_argument("--json", default="bench_results/kquant_decode.json")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.model, args.one, args.prompt_len, args.output_len)))
        return

    from iterserve.bench.machine import cpu_line

    print(cpu_line(), flush=True)
    results: dict[str, object] = {"cpu": cpu_line(), "model": args.model}
    rows = []
    for weights in args.weights.split(","):
        child = [sys.executable, __file__, args.model, "--one", weights]
        child += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
        out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"iterserve --weights {weights:5s} ({row['weights']}, kernels {row['kernels_isa']}): "
            f"decode {row['decode_tok_s']:6.1f} tok/s, RSS {row['rss_mib']:6.0f} MiB "
            f"(peak {row['peak_rss_mib']:.0f})",
            flush=True,
        )
        print(f"    linears: {row['linears']}", flush=True)
    results["iterserve"] = rows
    if args.llama_cpp:
        peer = run_llama_cpp(args.llama_cpp, args.model, args.prompt_len, args.output_len)
        results["llama_cpp"] = peer
        print(
            f"llama.cpp batched-bench, 1 sequence: decode {peer['decode_tok_s']:6.1f} tok/s, "
            f"peak RSS {peer['peak_rss_mib']:.0f} MiB",
            flush=True,
        )
        for row in rows:
            ratio = row["decode_tok_s"] / peer["decode_tok_s"]  # type: ignore[operator]
            print(f"    iterserve --weights {row['weights_mode']} / llama.cpp: {ratio:.2f}x")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
