"""What a KV pool costs in resident memory, and what `LLM()` on the bundled model costs at
start-up.

1. The pool: VmRSS just before and after `allocate_kv_caches` makes a pool of --gib GiB
   shaped as SmolLM2-135M's (30 layers, 3 KV heads of 64, bf16), then after K and V are
   written into its first --touch blocks in every layer, and a read of its last block (which
   must be zeros). With --zeros, the same for a pool made by torch.zeros, as before the pool
   was committed lazily. Each in a fresh process.
2. Start-up (--startup): `LLM()` on the bundled model with its defaults in a fresh process:
   wall time, VmRSS after, and the pool it took, for this tree and, with --baseline REV, that
   revision's sources (`git archive`d to a temporary directory).

Asserts nothing.

    .venv/bin/python benchmarks/kv_pool_memory.py [--gib 4] [--touch 256] [--zeros] \
        [--startup] [--baseline REV] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.machine import cpu_line

REPO = Path(__file__).resolve().parent.parent

_STATUS = r"""
import re
def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
"""

_POOL_CHILD = (
    _STATUS
    + r"""
import json, sys, torch
from iterserve.model import attention
from iterserve.model.config import ModelConfig
gib, touch, zeros = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "zeros"
layers, kv_heads, head_dim, block_size = 30, 3, 64, 16
block_bytes = 2 * layers * kv_heads * head_dim * 2 * block_size
num_blocks = int(gib * 2**30 // block_bytes)
config = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=kv_heads,
    head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192,
    tie_word_embeddings=True,
)
if zeros:
    attention._zeroed_pages = attention._zeroed_now  # every page written at start-up
before = rss()
pool = attention.allocate_kv_caches(config, num_blocks, block_size, torch.bfloat16, torch.device("cpu"))
allocated = rss()
for k, v in pool:
    k[:, :touch] = 1.0
    v[:, :touch] = 1.0
touched = rss()
last_is_zero = all(bool((k[:, -1] == 0).all() and (v[:, -1] == 0).all()) for k, v in pool)
print(json.dumps({
    "pool_bytes": num_blocks * block_bytes, "num_blocks": num_blocks, "touched_blocks": touch,
    "touched_bytes": touch * block_bytes, "rss_before": before, "rss_allocated": allocated,
    "rss_touched": touched, "rss_after_read": rss(), "last_block_zero": last_is_zero,
}))
"""
)

_STARTUP_CHILD = (
    _STATUS
    + r"""
import json, time
from iterserve.engine.llm import LLM
start = time.perf_counter()
engine = LLM().engine
seconds = time.perf_counter() - start
stats = engine.scheduler.kv_cache_stats()
print(json.dumps({
    "seconds": seconds, "rss": rss(), "num_blocks": stats.num_blocks,
    "max_model_len": engine.max_model_len,
}))
"""
)


def run_child(code: str, src: Path, *argv: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def baseline_src(rev: str, workdir: Path) -> Path:
    """REV's src/ in a directory of its own (an archive: no worktree is registered)."""
    target = workdir / f"baseline-{rev}"
    if not (target / "src").exists():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="the pool's size")
    parser.add_argument("--touch", type=int, default=256, help="blocks written in each layer")
    parser.add_argument("--zeros", action="store_true", help="also a torch.zeros pool")
    parser.add_argument("--startup", action="store_true", help="also time LLM() start-up")
    parser.add_argument("--baseline", help="a git revision whose LLM() start-up to time too")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "iterserve-kv"))
    parser.add_argument("--json", default="bench_results/kv_pool_memory.json")
    args = parser.parse_args()
    print(cpu_line(), flush=True)

    mib = 2**20
    src = REPO / "src"
    results: dict[str, object] = {}
    for kind in ("lazy", "zeros") if args.zeros else ("lazy",):
        pool = run_child(_POOL_CHILD, src, str(args.gib), str(args.touch), kind)
        results[f"pool_{kind}"] = pool
        print(
            f"pool ({kind}): {pool['pool_bytes'] / mib:,.0f} MiB, {pool['num_blocks']} blocks; "
            f"VmRSS before {pool['rss_before'] / mib:,.0f} MiB, allocated "
            f"{pool['rss_allocated'] / mib:,.0f}, {pool['touched_blocks']} blocks written "
            f"({pool['touched_bytes'] / mib:,.1f} MiB) {pool['rss_touched'] / mib:,.0f}, "
            f"last block read {pool['rss_after_read'] / mib:,.0f}; last block zeros: "
            f"{pool['last_block_zero']}",
            flush=True,
        )
    if args.startup or args.baseline:
        trees = {"this tree": src}
        if args.baseline:
            trees[args.baseline] = baseline_src(args.baseline, Path(args.workdir))
        for tree, tree_src in trees.items():
            run = run_child(_STARTUP_CHILD, tree_src)
            results[f"startup {tree}"] = run
            print(
                f"LLM() ({tree}): {run['seconds']:.1f} s, VmRSS {run['rss'] / mib:,.0f} MiB, "
                f"{run['num_blocks']} KV blocks, max model len {run['max_model_len']}",
                flush=True,
            )
    write_results(args.json, results)


if __name__ == "__main__":
    main()
