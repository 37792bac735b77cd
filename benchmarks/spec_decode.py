"""When speculative decoding pays, on the bundled model, in one run.

Two workloads, greedy, ignore_eos, `--output-len` tokens each:

  copy   `iterserve bench`'s copy-edit workload: chat requests to edit code or prose, whose
         answers repeat most of their prompts (what prompt lookup guesses)
  code   the same, code edits only (each code passage with each code instruction)
  free   open-ended story and question prompts (completions): less repeats

For each workload and batch size, the same requests run on an engine without speculation
and on one with `--speculative-method METHOD --num-speculative-tokens K` (ngram, or draft
with `--draft-model`, e.g. self-int4: the bundled GGUF's own 4-bit weights guessing for
its bf16 weights, run with `--weights bf16`) and `--speculative-disable-by-batch-size`,
round by round in turn; a row runs the workload's prompts in rounds of `batch` (all of
them, up to --max-rounds rounds), since one prompt's answer may copy much or little.
Printed per row: output tok/s (generated tokens / the batch's wall time, prefill included)
for both and their ratio, mean TPOT (ms per output token after the first) for both and
their ratio (`decode x`: the decode speed-up, prefill excluded), the acceptance rate
(accepted / proposed draft tokens), the mean accepted length (tokens a speculating
request gains per step), and whether the two produced the same tokens. With
--batch-invariant they must (speculation never changes the text); without it, bf16 logits
depend on a step's shape (a verify step has 1 + k rows a request), so a near-tie can flip
and the texts part there, as they would for any other change of batch.
Asserts nothing about time: the machine is shared; compare within one run.

    .venv/bin/python benchmarks/spec_decode.py [--batch-sizes 1,8,32] [--k 4]
        [--disable-by-batch-size 16] [--ngram-min 2 --ngram-max 4]
        [--method ngram | --method draft --draft-model self-int4 --weights bf16]
        [--batch-invariant] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.copy_texts import INSTRUCTIONS, PASSAGES
from iterserve.bench.tokenizer import load_tokenizer
from iterserve.bench.workloads import WorkloadSpec, build_workload
from iterserve.engine.llm import LLM
from iterserve.engine.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

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
    plain_tpot_ms: float
    spec_tpot_ms: float
    acceptance_rate: float
    mean_accepted_length: float
    same_tokens: bool


def run_alternating(
    engines: tuple[LLM, LLM],
    rounds: list[list[str]] | list[list[list[int]]],
    params: SamplingParams,
) -> list[tuple[float, float, list[list[int]]]]:
    """Each round's prompts as one batch on each engine in turn, round after round (so a
    noisy spell of the machine hits both alike). Per engine: output tok/s over all rounds,
    mean TPOT in ms, and the tokens."""
    elapsed = [0.0, 0.0]
    outputs: list[list[RequestOutput]] = [[], []]
    for prompts in rounds:
        for i, llm in enumerate(engines):
            start = time.perf_counter()
            outputs[i] += llm.generate(prompts, params, use_tqdm=False)
            elapsed[i] += time.perf_counter() - start
    return [
        (
            sum(len(o.token_ids) for o in outs) / seconds,
            1e3 * statistics.mean(map(tpot, outs)),
            [o.token_ids for o in outs],
        )
        for outs, seconds in zip(outputs, elapsed, strict=True)
    ]


def tpot(output: RequestOutput) -> float:
    assert output.timings is not None
    times = output.timings.token_times
    return (times[-1] - times[0]) / (len(times) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--disable-by-batch-size", type=int, default=16)
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-rounds", type=int, default=9, help="batches per row, at most")
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
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        speculative_disable_by_batch_size=args.disable_by_batch_size,
        **settings,
    )
    copy = build_workload(
        WorkloadSpec("copy-edit", num_requests=9, output_len=args.output_len),
        load_tokenizer(None),
    )
    code = [
        plain.apply_chat_template([{"role": "user", "content": f"{ask}\n\n```\n{passage}```"}])
        for passage in PASSAGES[:3]  # the code ones
        for ask in INSTRUCTIONS[:3]  # the code edits
    ]
    workloads: dict[str, list[str] | list[list[int]]] = {
        "copy": [r.prompt_token_ids for r in copy.requests],
        "code": code,
        "free": FREE_PROMPTS,
    }
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for llm in (plain, spec):  # first-call effects out of the way
        llm.generate(FREE_PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)

    print(
        f"{'workload':8s} {'batch':>5s} {'plain tok/s':>12s} {args.method + ' tok/s':>12s} "
        f"{'ratio':>6s} {'plain TPOT':>11s} {'spec TPOT':>10s} {'decode x':>9s} {'accept':>7s} "
        f"{'mean len':>9s} "
        f"{'same':>5s}"
    )
    rows: list[Row] = []
    for name, pool in workloads.items():
        for batch in batch_sizes:
            # Enough rounds that every prompt of the pool runs (at most --max-rounds): one
            # prompt's answer may copy much or little, so batch 1 needs several.
            count = min(max(batch, len(pool)), batch * args.max_rounds)
            count = -(-count // batch) * batch
            prompts = [pool[i % len(pool)] for i in range(count)]
            rounds = [prompts[i : i + batch] for i in range(0, count, batch)]
            stats = spec.engine.scheduler.spec_stats
            before = stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_drafts
            (plain_tok_s, plain_tpot, plain_tokens), (spec_tok_s, spec_tpot, spec_tokens) = (
                run_alternating((plain, spec), rounds, params)
            )
            proposed = stats.num_draft_tokens - before[0]
            kept = stats.num_accepted_tokens - before[1]
            steps = stats.num_drafts - before[2]
            row = Row(
                name,
                batch,
                plain_tok_s,
                spec_tok_s,
                plain_tpot,
                spec_tpot,
                kept / proposed if proposed else 0.0,
                1 + kept / steps if steps else 1.0,
                plain_tokens == spec_tokens,
            )
            rows.append(row)
            print(
                f"{name:8s} {batch:5d} {row.plain_tok_s:12.1f} {row.spec_tok_s:12.1f} "
                f"{row.spec_tok_s / row.plain_tok_s:6.2f} {plain_tpot:9.1f}ms {spec_tpot:8.1f}ms "
                f"{plain_tpot / spec_tpot:9.2f} {row.acceptance_rate:7.2f} {row.mean_accepted_length:9.2f} "
                f"{str(row.same_tokens):>5s}",
                flush=True,
            )
    setup = {"k": args.k, "method": args.method, "draft_model": args.draft_model}
    setup |= {"weights": args.weights, "batch_invariant": args.batch_invariant}
    setup |= {"disable_by_batch_size": args.disable_by_batch_size}
    write_results(args.json, setup | {"rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
