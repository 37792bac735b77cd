"""An editor's fill in the middle, llama-server against iterserve: how long each completion
takes as the cursor moves down a file, the way llama.vscode and llama.vim ask /infill.

The model: a real body with random weights (`--preset`, default llama-1b: a 1B, the size
of Qwen2.5-Coder-1.5B, the model those plugins suggest for a CPU), the bundled tokenizer
with Qwen2.5-Coder's five fill-in-the-middle tokens (llama_server_parity.py), F16 written
here and quantized by llama-quantize (`--type`, default Q8_0, what the plugins suggest).
Made once under ~/.cache/iterserve-bench/infill/.

The requests: a synthetic Python file; for each of `--requests` cursor places in turn (a
line further down each time, or `--cursor typing`: one more character typed on the same
line), the plugin's request: `input_extra` (other files' chunks, the same each time), the
`--prefix` lines above the cursor, the `--suffix` lines below, the cursor's line up to the
cursor as `prompt`, `n_predict` tokens (`ignore_eos`, so both engines write as many), top_k 40,
top_p 0.99, a fixed seed. The first request meets an empty cache; each next one shares
the other files and most of the lines above with the one before, as an editor's do.

llama-server runs as llama.vscode's README starts it (`-c 2048`... here `-c 8192 -np 1
--cache-reuse 256`: its KV shifting reuses chunks of the last prompt at new positions), then
`iterserve serve` with the same `--cache-reuse` (its prefix cache serves the shared start;
runs of the last prompt found again at shifted positions are copied, core/kv_reuse.py), one
after the other. Printed per engine: the first request's time, the median, mean and worst
of the rest, prompt tokens computed and found cached (each engine's own counts), peak RSS.

    .venv/bin/python benchmarks/infill_latency.py [--requests 12] [--cursor down|typing]
        [--cache-reuse 256] [--preset llama-1b] [--type Q8_0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from big_models import llama_cpp_bin  # type: ignore[import-not-found]
from iterserve.bench.machine import cpu_line
from iterserve.bench.server_process import free_port, launch_server
from iterserve.bench.shaped_gguf import write_shaped_gguf
from iterserve.config import engine_config
from llama_cpp_agreement import llama_server  # type: ignore[import-not-found]
from llama_server_parity import coder_tokenizer, post  # type: ignore[import-not-found]

CACHE = Path.home() / ".cache/iterserve-bench/infill"


def model_file(preset: str, qtype: str) -> Path:
    """The preset's coder-vocabulary GGUF in `qtype`, made if missing."""
    CACHE.mkdir(parents=True, exist_ok=True)
    final = CACHE / f"{preset}-coder.{qtype}.gguf"
    if final.exists():
        return final
    f16 = CACHE / f"{preset}-coder.F16.gguf"
    if not f16.exists():
        print(f"writing {f16}", flush=True)
        write_shaped_gguf(f16, preset, seed=11, tokenizer=coder_tokenizer())
    binaries = llama_cpp_bin(None)
    if binaries is None:
        raise SystemExit("llama.cpp is not built: benchmarks/peers/llama_cpp.sh path")
    partial = final.with_name(final.name + ".partial")
    subprocess.run([f"{binaries}/llama-quantize", str(f16), str(partial), qtype], check=True,
                   capture_output=True)  # fmt: skip
    os.replace(partial, final)
    f16.unlink()
    return final


def source_lines(count: int, salt: int) -> list[str]:
    """A synthetic Python file: small functions, each a few lines."""
    lines: list[str] = []
    i = 0
    while len(lines) < count:
        n = salt * 1000 + i
        lines += [f"def step_{n}(values, scale={i % 7 + 1}):",
                  f"    total = sum(v * scale for v in values if v % {i % 5 + 2})",
                  f"    return total // {i % 9 + 1} + len(values)", ""]  # fmt: skip
        i += 1
    return lines[:count]


def requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    lines = source_lines(args.prefix + args.requests + args.suffix + 1, 0)
    extra = [{"filename": f"helpers_{k}.py", "text": "\n".join(source_lines(32, k + 1)) + "\n"}
             for k in range(args.chunks)]  # fmt: skip
    bodies = []
    for r in range(args.requests):
        # Moving down, the cursor sits mid-way through the next line each time; typing, it
        # stays on one line and each request has one more character before it.
        cursor = args.prefix + (r if args.cursor == "down" else 0)
        line = lines[cursor]
        at = len(line) // 2 if args.cursor == "down" else 8 + r
        bodies.append({
            "input_extra": extra,
            "input_prefix": "\n".join(lines[cursor - args.prefix : cursor]) + "\n",
            "input_suffix": line[at:] + "\n" + "\n".join(lines[cursor + 1 : cursor + 1 + args.suffix]),
            "prompt": line[:at],
            "n_predict": args.n_predict, "ignore_eos": True, "top_k": 40, "top_p": 0.99,
            "seed": 1, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
        })  # fmt: skip
    return bodies


def peak_rss_gib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def run(base: str, bodies: list[dict[str, Any]], pid: int) -> dict[str, Any]:
    rows = []
    for body in bodies:
        started = time.perf_counter()
        status, answer = post(base, "/infill", body)
        seconds = time.perf_counter() - started
        if status != 200:
            raise SystemExit(f"/infill answered {status}: {answer}")
        timings = answer["timings"]
        rows.append({"seconds": seconds, "prompt_tokens": answer["tokens_evaluated"],
                     "computed": timings["prompt_n"], "cached": answer["tokens_cached"],
                     "predicted": answer["tokens_predicted"]})  # fmt: skip
    rest = rows[1:] or rows
    return {
        "first_s": rows[0]["seconds"],
        "rest_median_s": statistics.median(r["seconds"] for r in rest),
        "rest_mean_s": statistics.fmean(r["seconds"] for r in rest),
        "rest_max_s": max(r["seconds"] for r in rest),
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
        "computed_median": statistics.median(r["computed"] for r in rest),
        "cached_median": statistics.median(r["cached"] for r in rest),
        "peak_rss_gib": peak_rss_gib(pid),
        "requests": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--type", default="Q8_0")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prefix", type=int, default=64, help="lines above the cursor")
    parser.add_argument("--suffix", type=int, default=16, help="lines below the cursor")
    parser.add_argument("--chunks", type=int, default=4, help="other files' chunks, 32 lines")
    parser.add_argument("--n-predict", type=int, default=32)
    parser.add_argument("--cursor", choices=("down", "typing"), default="down",
                        help="the cursor moves a line down each request, or stays on its "
                        "line while one more character is typed")  # fmt: skip
    parser.add_argument("--cache-reuse", type=int, default=256,
                        help="both engines' --cache-reuse (llama.vscode's README: 256; 0: off)")  # fmt: skip
    parser.add_argument("--json", default="bench_results/infill_latency.json")
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    model = model_file(args.preset, args.type)
    bodies = requests(args)
    results: dict[str, Any] = {}
    port = free_port()
    with llama_server(model, port, "-c", "8192", "--cache-reuse", str(args.cache_reuse)) as url:
        pid = int(subprocess.run(["pgrep", "-f", "--", f"llama-server .*--port {port}"],
                                 capture_output=True,
                                 text=True).stdout.split()[0])  # fmt: skip
        results["llama.cpp"] = run(url, bodies, pid)
    config = engine_config({"model": str(model), "cache_reuse": args.cache_reuse})
    with launch_server(config) as server:
        results["iterserve"] = run(server.base_url, bodies, server.process.pid)
    print(f"{'engine':<10} {'first s':>8} {'next s: median':>15} {'mean':>6} {'worst':>6} "
          f"{'prompt':>7} {'computed':>9} {'cached':>7} {'peak RSS GiB':>13}")  # fmt: skip
    for engine, r in results.items():
        rss = f"{r['peak_rss_gib']:.2f}" if r["peak_rss_gib"] else "-"
        print(f"{engine:<10} {r['first_s']:>8.2f} {r['rest_median_s']:>15.2f} "
              f"{r['rest_mean_s']:>6.2f} {r['rest_max_s']:>6.2f} {r['prompt_tokens']:>7.0f} "
              f"{r['computed_median']:>9.0f} {r['cached_median']:>7.0f} {rss:>13}")  # fmt: skip
    for figure in ("median", "mean"):
        ratio = results["llama.cpp"][f"rest_{figure}_s"] / results["iterserve"][f"rest_{figure}_s"]
        print(f"next requests: iterserve {ratio:.2f}x llama.cpp's speed ({figure} time ratio)")
    write_results(args.json, {"cpu": cpu_line(), "args": vars(args), "model": str(model),
                              "results": results})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
