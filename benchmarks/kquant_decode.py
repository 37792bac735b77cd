"""A K-quant GGUF (e.g. Q4_K_M) kept quantized: resident memory and one sequence's decode
speed, against the same file expanded to bf16 and against llama.cpp on the same file.

Each weights mode (--weights: `auto` runs the checkpoint's own blocks, `int8` every
projection as Q8_0, `bf16` the expansion) runs in its own process, so its
resident set (VmRSS once warm, and the peak, load included) is its own: one sequence of
--prompt-len ordinary tokens then --output-len greedy tokens (ignore_eos), decode tok/s over
the decode-only steps. With --llama-cpp BIN_DIR (`benchmarks/peers/llama_cpp.sh path`) the
same file runs through llama-batched-bench (same prompt and output lengths and --threads,
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
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/


def _linear_weight_mib() -> float:
    """Bytes of every projection's and the head's weights as the kernels hold them (blocks,
    scales, wide copies), each storage once."""
    import gc

    from iterserve.model.linear import Linear

    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, Linear):
            held = (obj.tiles, obj.scales, obj.wide, obj.wide_scales, obj.weight, obj.packed)
            for t in held:
                if t is not None:
                    storage = t.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**20


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_one(
    model: str, weights: str, prompt_len: int, output_len: int, threads: int
) -> dict[str, object]:
    """In this process: build the engine, decode one sequence, report speed and memory."""
    import numpy as np

    from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
    from iterserve.engine.llm import LLM
    from iterserve.sampling_params import SamplingParams

    # A small KV cache, so that the resident set is the weights' (the default reserves 1 GiB).
    llm = LLM(
        model,
        weights=weights,
        max_num_seqs=1,
        enable_prefix_caching=False,
        kv_cache_memory=0.03,
        num_threads=threads,
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
        "linear_weights_mib": _linear_weight_mib(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_llama_cpp(
    bin_dir: str, model: str, prompt_len: int, output_len: int, threads: int
) -> dict[str, float]:
    command = [f"{bin_dir}/llama-batched-bench", "-m", model, "-c", "2048", "-npp"]
    command += [str(prompt_len), "-ntg", str(output_len), "-npl", "1", "-t", str(threads)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert process.stdout is not None
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)  # this child's own peak RSS
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{command[0]} exited with {process.returncode}")
    rows = [line for line in stdout.splitlines() if re.match(r"^\|\s*\d", line)]
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    return {
        "decode_tok_s": float(cells[7]),
        "peak_rss_mib": usage.ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--weights", default="auto,bf16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    # On a loaded machine a thread descheduled at a barrier stalls the step: 1 is steadier.
    parser.add_argument("--threads", type=int, default=2, help="for both engines")
    parser.add_argument("--llama-cpp", default=None, help="llama.cpp's bin directory")
    parser.add_argument("--repeats", type=int, default=1, help="rounds; medians reported")
    parser.add_argument("--json", default="bench_results/kquant_decode.json")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.one:
        print(
            json.dumps(
                run_one(args.model, args.one, args.prompt_len, args.output_len, args.threads)
            )
        )
        return

    from iterserve.bench.machine import cpu_line

    print(cpu_line(), flush=True)
    results: dict[str, object] = {"cpu": cpu_line(), "model": args.model, "threads": args.threads}
    runs: dict[str, list[dict[str, object]]] = {}
    for round_ in range(args.repeats):  # rounds of every contender: noise hits them alike
        for weights in args.weights.split(","):
            child = [sys.executable, __file__, args.model, "--one", weights]
            child += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
            child += ["--threads", str(args.threads)]
            out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            runs.setdefault(f"iterserve --weights {weights}", []).append(row)
            print(
                f"[{round_}] iterserve --weights {weights:5s} ({row['weights']}, kernels "
                f"{row['kernels_isa']}): decode {row['decode_tok_s']:6.1f} tok/s, RSS "
                f"{row['rss_mib']:5.0f} MiB (peak {row['peak_rss_mib']:.0f}), projection + head "
                f"weights {row['linear_weights_mib']:.0f} MiB",
                flush=True,
            )
            if round_ == 0:
                print(f"    linears: {row['linears']}", flush=True)
        if args.llama_cpp:
            peer = run_llama_cpp(
                args.llama_cpp, args.model, args.prompt_len, args.output_len, args.threads
            )
            runs.setdefault("llama.cpp", []).append(peer)
            print(
                f"[{round_}] llama.cpp batched-bench, 1 sequence: decode "
                f"{peer['decode_tok_s']:6.1f} tok/s, peak RSS {peer['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    median = {
        name: statistics.median(float(r["decode_tok_s"]) for r in rows)  # type: ignore[arg-type]
        for name, rows in runs.items()
    }
    print(f"median decode tok/s of {args.repeats} rounds:")
    for name, value in median.items():
        vs = f" ({value / median['llama.cpp']:.2f}x llama.cpp)" if "llama.cpp" in median else ""
        print(f"    {name:26s} {value:6.1f}{vs}")
    results["runs"] = runs
    results["median_decode_tok_s"] = median
    write_results(args.json, results)


if __name__ == "__main__":
    main()
