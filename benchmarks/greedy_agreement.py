"""Whether a greedy answer depends on what shares its steps: the bundled model's answers to
held-out chat prompts (bench/copy_texts.py: edit instructions over passages) generated

  alone     one request at a time
  cached    the same again, its prompt now in the prefix cache (only the last block's
            rows are computed, in a chunk of another size)
  batched   all prompts submitted together (every step shares its rows)
  ngram     one at a time with n-gram speculation (--num-speculative-tokens K): a verify
            step runs 1 + K rows of the request

and, for cached, batched and ngram, how many answers differ from alone's and where each first differs.
With `--batch-invariant` every path must agree (tests/model/test_bundled_model.py holds it);
without it, only what the kernels leave to the step's shape can move a near-tie. Asserts
nothing.

    .venv/bin/python benchmarks/greedy_agreement.py [--prompts 8] [--tokens 96] [--k 4]
        [--batch-invariant] [--dtype float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve import kernels
from iterserve.bench.copy_texts import INSTRUCTIONS, PASSAGES
from iterserve.bench.machine import cpu_line
from iterserve.engine.llm import LLM
from iterserve.sampling_params import SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where the two answers differ (None: the same tokens)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default="bench_results/greedy_agreement.json")
    args = parser.parse_args()
    print(cpu_line())
    settings: dict[str, Any] = {"batch_invariant": args.batch_invariant, "dtype": args.dtype}
    plain = LLM(**settings)
    pairs = list(itertools.product(INSTRUCTIONS, PASSAGES))[: args.prompts]
    prompts = [
        plain.apply_chat_template([{"role": "user", "content": f"{ask}\n\n{text}"}])
        for ask, text in pairs
    ]
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    answers: dict[str, list[list[int]]] = {"alone": [], "cached": []}
    for p in prompts:
        for path in ("alone", "cached"):
            answers[path].append(plain.generate([p], params, use_tqdm=False)[0].token_ids)
    answers["batched"] = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    spec = LLM(speculative_method="ngram", num_speculative_tokens=args.k, **settings)
    answers["ngram"] = [spec.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    print(f"kernels {kernels.isa()}, {len(prompts)} prompts, {args.tokens} tokens, {settings}")
    rows = []
    for path in ("cached", "batched", "ngram"):
        firsts = [
            first_difference(a, b) for a, b in zip(answers[path], answers["alone"], strict=True)
        ]
        differ = sum(f is not None for f in firsts)
        print(
            f"{path:8s} differs from alone in {differ} of {len(prompts)} answers, first at {firsts}"
        )
        rows.append({"path": path, "differ": differ, "first_difference": firsts})
    write_results(
        args.json,
        {
            "isa": kernels.isa(),
            "settings": settings,
            "k": args.k,
            "tokens": args.tokens,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
