"""When speculative decoding pays, on the bundled model, in one run.

Two workloads, greedy, ignore_eos, `--output-len` tokens each:

  copy   chat requests to edit a block of code: the answer repeats most of the context,
         which is what prompt lookup guesses (editing, refactoring, quoting)
  free   open-ended story and question prompts (completions): less repeats

For each workload and batch size, the same requests run on an engine without speculation
and on one with `--speculative-method METHOD --num-speculative-tokens K` (ngram, or draft
with `--draft-model`, e.g. self-int4: the bundled GGUF's own 4-bit weights guessing for
its bf16 weights, run with `--weights bf16`), alternately,
and the script prints output tok/s (generated tokens / wall time of the batch), the ratio,
the acceptance rate (accepted / proposed draft tokens) and the mean accepted length
(tokens a speculating request gains per step), and whether the two engines produced the
same tokens. With --batch-invariant they must (speculation never changes the text); without
it, bf16 logits depend on a step's shape (a verify step has 1 + k rows a request), so a
near-tie can flip and the texts part there, as they would for any other change of batch.
Asserts nothing about time: the machine is shared; compare within one run.

    .venv/bin/python benchmarks/spec_decode.py [--batch-sizes 1,4,16,64] [--k 4]
        [--method ngram | --method draft --draft-model self-int4 --weights bf16]
        [--batch-invariant] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from iterserve.engine.llm import LLM
from iterserve.sampling_params import SamplingParams

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
'''

# Chat requests to edit code: the answer repeats most of the prompt.
COPY_MESSAGES = [
    "Add a docstring line to this function and return the whole function:",
    "Rename the variable `merged` to `result` in this code:",
    "Add type hints to this function and show all of it:",
]
FREE_PROMPTS = [
    "Once upon a time, in a village by the sea, there lived",
    "The three most important things to know about the French Revolution are",
    "Write a short poem about the autumn rain:\n",
    "Question: Why is the sky blue?\nAnswer:",
]


@dataclass
class Row:
    workload: str
    batch: int
    plain_tok_s: float
    spec_tok_s: float
    acceptance_rate: float
    mean_accepted_length: float
    same_tokens: bool


def timed_generate(
    llm: LLM, prompts: list[str] | list[list[int]], params: SamplingParams
) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--method", default="ngram", choices=("ngram", "draft"))
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--weights", default="auto", help="both engines' --weights")
    parser.add_argument("--json", default="bench_results/spec_decode.json")
    args = parser.parse_args()

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    settings = {
        "max_num_seqs": max(batch_sizes),
        "enable_prefix_caching": False,
        "batch_invariant": args.batch_invariant,
        "weights": args.weights,
    }
    plain = LLM(**settings)
    spec = LLM(
        speculative_method=args.method,
        draft_model=args.draft_model,
        num_speculative_tokens=args.k,
        **settings,
    )
    copy_prompts = [
        plain.apply_chat_template([{"role": "user", "content": f"{ask}\n```python\n{CODE}```"}])
        for ask in COPY_MESSAGES
    ]
    workloads: dict[str, list[str] | list[list[int]]] = {
        "copy": copy_prompts,
        "free": FREE_PROMPTS,
    }
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for llm in (plain, spec):  # first-call effects out of the way
        llm.generate(FREE_PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)

    print(
        f"{'workload':8s} {'batch':>5s} {'plain tok/s':>12s} {args.method + ' tok/s':>12s} "
        f"{'ratio':>6s} {'accept':>7s} {'mean len':>9s} {'same':>5s}"
    )
    rows: list[Row] = []
    for name, pool in workloads.items():
        for batch in batch_sizes:
            prompts = [pool[i % len(pool)] for i in range(batch)]
            stats = spec.engine.scheduler.spec_stats
            drafted, accepted, drafts = (
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
                stats.num_drafts,
            )
            plain_s, plain_tokens = timed_generate(plain, prompts, params)
            spec_s, spec_tokens = timed_generate(spec, prompts, params)
            proposed = stats.num_draft_tokens - drafted
            kept = stats.num_accepted_tokens - accepted
            steps = stats.num_drafts - drafts
            generated = batch * args.output_len
            row = Row(
                name,
                batch,
                generated / plain_s,
                generated / spec_s,
                kept / proposed if proposed else 0.0,
                1 + kept / steps if steps else 1.0,
                plain_tokens == spec_tokens,
            )
            rows.append(row)
            print(
                f"{name:8s} {batch:5d} {row.plain_tok_s:12.1f} {row.spec_tok_s:12.1f} "
                f"{row.spec_tok_s / row.plain_tok_s:6.2f} {row.acceptance_rate:7.2f} "
                f"{row.mean_accepted_length:9.2f} {str(row.same_tokens):>5s}",
                flush=True,
            )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    setup = {"k": args.k, "method": args.method, "draft_model": args.draft_model}
    setup |= {"weights": args.weights, "batch_invariant": args.batch_invariant}
    out.write_text(json.dumps(setup | {"rows": [asdict(r) for r in rows]}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
