"""This tree's engine against another revision's on one model, processes in turns: prompt and
decode tok/s at each batch size, the ratio of each round, and their median.

A kernel or scheduler change is judged by what the engine does with it, and on a shared
machine whose memory and cores drift between minutes only a comparison made in turns says
anything. Each round runs one child process per tree (the order alternating round by
round); a child loads the model, warms it up, and times `decode_speed.run_batch` (the loop
`big_models.py` times) at each batch size, best of `--repeats`. The other revision is
checked out as a `git worktree` in a temporary folder and imported ahead of this one
(PYTHONPATH); its kernels build at their first use, cached by their sources' hash. The
harness is this tree's for both. Asserts nothing.

    .venv/bin/python benchmarks/trees_ab.py MODEL.gguf --base HEAD~1 [--rounds 3]
        [--batches 1,16] [--prompt-len 128] [--output-len 32] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def child(args: argparse.Namespace) -> None:
    """One tree's figures, as one JSON line on stdout."""
    import iterserve
    from decode_speed import run_batch  # type: ignore[import-not-found]
    from iterserve.bench.machine import cpu_line
    from iterserve.bench.tokenizer import ordinary_token_ids
    from iterserve.engine.llm import LLM

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        args.model,
        max_num_seqs=max(batches),
        enable_prefix_caching=False,  # every repeat reuses the same prompts
        num_threads=args.threads,
    )
    rng = random.Random(0)
    vocab = ordinary_token_ids(llm.tokenizer)
    prompts = [rng.choices(vocab, k=args.prompt_len) for _ in range(max(batches))]
    run_batch(llm, prompts[:2], 4)  # first-step effects (allocator, caches) out of the way
    figures = {}
    for batch in batches:
        runs = [run_batch(llm, prompts[:batch], args.output_len) for _ in range(args.repeats)]
        figures[str(batch)] = {
            "prompt": max(run[0] for run in runs),
            "decode": max(run[1] for run in runs),
        }
    tree = str(Path(iterserve.__file__).resolve().parents[2])
    print(json.dumps({"tree": tree, "cpu": cpu_line(), "figures": figures}))


def run_child(tree: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", args.model]
    for flag in ("batches", "prompt_len", "output_len", "repeats", "threads"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    out = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.exit(f"the child on {tree} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    result = json.loads(lines[-1])
    if Path(result["tree"]) != tree.resolve():
        sys.exit(f"the child on {tree} imported iterserve from {result['tree']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file (or a checkpoint directory)")
    parser.add_argument("--base", default="HEAD", help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs a child, its best kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="iterserve-base-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(base), base_rev],
            cwd=ROOT,
            check=True,
        )
        try:
            base_key = f"base {base_rev}"
            trees = {"this": ROOT, base_key: base}
            rounds = []
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                got = {name: run_child(trees[name], args) for name in order}
                rounds.append({name: got[name]["figures"] for name in trees})
                if r == 0:
                    print(got["this"]["cpu"])
                print(f"round {r + 1}: " + _ratios_line(rounds[-1]["this"], rounds[-1][base_key]))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    medians = _median_ratios([(round_["this"], round_[base_key]) for round_ in rounds])
    print("median this / base: " + ", ".join(f"{k} {v:.3f}x" for k, v in medians.items()))
    if args.json:
        write_results(
            args.json,
            {"args": vars(args), "base": base_rev, "rounds": rounds, "median_ratios": medians},
        )


def _ratios(this: dict, base: dict) -> dict[str, tuple[float, float]]:
    """'prompt B1': (this tree's tok/s / the base's, this tree's tok/s), and so on."""
    return {
        f"{kind} B{batch}": (this[batch][kind] / base[batch][kind], this[batch][kind])
        for batch in this
        for kind in ("prompt", "decode")
    }


def _ratios_line(this: dict, base: dict) -> str:
    return ", ".join(
        f"{key} {ratio:.3f}x ({tok_s:.1f} tok/s)"
        for key, (ratio, tok_s) in _ratios(this, base).items()
    )


def _median_ratios(pairs: list[tuple[dict, dict]]) -> dict[str, float]:
    """Each ratio's median over the rounds' (this, base) figures."""
    per_round = [_ratios(this, base) for this, base in pairs]
    return {key: statistics.median(r[key][0] for r in per_round) for key in per_round[0]}


if __name__ == "__main__":
    main()
