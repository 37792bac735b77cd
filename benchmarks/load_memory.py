"""Peak memory of loading a model: how much a process's resident set grows from just
before `LLM(...)` to its highest point while the checkpoint is read and the network built,
against the checkpoint's size in bf16, optionally beside a baseline revision's sources.

Checkpoints: a random Llama made here as safetensors (`--params`, default ~0.4B, written
once under --workdir), and the bundled Q4_1 GGUF (or `--gguf PATH`). Each load runs in a
fresh process (Linux: the peak is /proc's VmHWM, reset after the imports through
/proc/self/clear_refs). Asserts nothing.

    .venv/bin/python benchmarks/load_memory.py [--baseline REV] [--json out.json]
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

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, re, sys
def status(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
from iterserve.engine.llm import LLM
open("/proc/self/clear_refs", "w").write("5")  # the peak so far is the imports': forget it
before = status("VmRSS")
llm = LLM(sys.argv[1] or None, kv_cache_memory=1 / 64, compile=False)
print(json.dumps({"peak": status("VmHWM") - before, "after": status("VmRSS") - before}))
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


def load_peak(src: Path, model: str) -> dict[str, int]:
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
    checkpoints = {
        "random Llama, safetensors": str(random_llama(work / "random-llama", args.params)),
        "GGUF": args.gguf,
    }
    mb = 2**20
    rows = []
    print(
        f"{'checkpoint':28s} {'tree':12s} {'bf16 MB':>8s} {'peak MB':>8s} {'kept MB':>8s} {'peak/bf16':>9s}"
    )
    for label, model in checkpoints.items():
        size = bf16_bytes(model)
        for tree, src in trees.items():
            peak = load_peak(src, model)
            rows.append({"checkpoint": label, "tree": tree, "bf16_bytes": size, **peak})
            print(f"{label:28s} {tree:12s} {size / mb:8.0f} {peak['peak'] / mb:8.0f} "
                  f"{peak['after'] / mb:8.0f} {peak['peak'] / size:9.2f}", flush=True)  # fmt: skip
    write_results(args.json, rows)


if __name__ == "__main__":
    main()
