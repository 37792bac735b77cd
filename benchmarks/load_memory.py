"""Peak memory of loading a model: how much a process's resident set grows from just
before `LLM(...)` to its highest point while the checkpoint is read and the network built,
against the checkpoint's size in bf16, optionally beside a baseline revision's sources.

Checkpoints: a random Llama made here as safetensors (`--params`, default ~0.4B, written
once under --workdir; `--gguf-only` leaves it out), and the bundled Q4_1 GGUF (or `--gguf
PATH`). Each load runs in a fresh process (Linux: the peak is /proc's VmHWM, reset after the
imports through /proc/self/clear_refs) and is timed (`LLM(...)`, imports apart). `--cold`
first drops the checkpoint's files from the page cache (posix_fadvise DONTNEED), as after a
reboot or a download; else they are read into it first. With `--rounds N` the trees take
turns N times. Asserts nothing.

    .venv/bin/python benchmarks/load_memory.py [--baseline REV] [--json out.json]
    .venv/bin/python benchmarks/load_memory.py --gguf F.gguf --gguf-only --cold --baseline main --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.machine import cpu_line

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, re, sys
def status(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
import time
from iterserve.engine.llm import LLM
open("/proc/self/clear_refs", "w").write("5")  # the peak so far is the imports': forget it
before = status("VmRSS")
start = time.perf_counter()
llm = LLM(sys.argv[1] or None, kv_cache_memory=1 / 64, compile=False)
seconds = time.perf_counter() - start
print(json.dumps({"peak": status("VmHWM") - before, "after": status("VmRSS") - before,
                  "seconds": seconds}))
"""


def random_llama(directory: Path, params: float) -> Path:
    """A random Llama of about `params` parameters, saved once as safetensors (bf16)."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers = 1024, max(1, round(params / 12.6e6))  # ~12.6M parameters a layer
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=49152,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    from iterserve.model.loader import load_model

    load_model(None, torch.bfloat16).tokenizer.save_pretrained(directory)  # the bundled model's
    return directory


def bf16_bytes(model: str) -> int:
    """The checkpoint's tensors, all of them in bf16."""
    import torch

    from iterserve.model.lazy_weights import shape_of
    from iterserve.model.loader import load_model

    weights = load_model(model or None, torch.bfloat16).weights
    return 2 * sum(math.prod(shape_of(weights, name)) for name in weights)  # none is read


def checkpoint_files(model: str) -> list[Path]:
    """The files a load reads: a directory's, or a GGUF and its other parts."""
    from iterserve.model.bundled import default_model_path
    from iterserve.model.gguf_parts import part_number, part_paths

    path = Path(model) if model else default_model_path()
    if path.is_dir():
        return [p for p in path.iterdir() if p.is_file()]
    numbered = part_number(path)
    return part_paths(path, numbered[1]) if numbered else [path]


def set_page_cache(files: list[Path], cached: bool) -> None:
    """The files read into the page cache, or dropped from it."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            if cached:
                while os.read(fd, 64 << 20):
                    pass
            else:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_peak(src: Path, model: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, model], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.4e9)
    parser.add_argument("--gguf", default="", help="a GGUF file (default: the bundled one)")
    parser.add_argument("--baseline", help="a git revision to load with as well")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "iterserve-load"))
    parser.add_argument("--gguf-only", action="store_true", help="leave out the safetensors")
    parser.add_argument("--cold", action="store_true", help="drop the files from the page cache")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default="bench_results/load_memory.json")
    args = parser.parse_args()

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    trees = {"this tree": REPO / "src"}
    if args.baseline:
        base = work / f"baseline-{args.baseline}"
        if not base.exists():
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.baseline], check=True)  # fmt: skip
        trees[args.baseline] = base / "src"
    checkpoints = {"GGUF": args.gguf}
    if not args.gguf_only:
        safetensors = str(random_llama(work / "random-llama", args.params))
        checkpoints = {"random Llama, safetensors": safetensors, **checkpoints}
    mb = 2**20
    rows = []
    print(cpu_line())
    print(
        f"{'checkpoint':28s} {'tree':12s} {'bf16 MB':>8s} {'peak MB':>8s} {'kept MB':>8s} "
        f"{'peak/bf16':>9s} {'load s':>7s} ({'cold' if args.cold else 'cached'} files)"
    )
    for label, model in checkpoints.items():
        size = bf16_bytes(model)
        files = checkpoint_files(model)
        for _ in range(args.rounds):
            for tree, src in trees.items():
                set_page_cache(files, cached=not args.cold)
                peak = load_peak(src, model)
                rows.append({"checkpoint": label, "tree": tree, "bf16_bytes": size,
                             "cold": args.cold, **peak})  # fmt: skip
                print(f"{label:28s} {tree:12s} {size / mb:8.0f} {peak['peak'] / mb:8.0f} "
                      f"{peak['after'] / mb:8.0f} {peak['peak'] / size:9.2f} "
                      f"{peak['seconds']:7.1f}", flush=True)  # fmt: skip
    write_results(args.json, rows)


if __name__ == "__main__":
    main()
