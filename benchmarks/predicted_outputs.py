"""What a chat's `prediction` (OpenAI's Predicted Outputs) buys at batch 1, on the bundled model.

One engine with `--speculative-method ngram`; each chat prompt is answered greedily once to
make its prediction, then, round after round in turn, answered again four ways:

  plain       `speculative: false` (no drafts: the baseline)
  lookup      prompt lookup alone (drafts from repeats in the context)
  predicted   the same prompt, its earlier answer as the prediction (a regenerated answer)
  tweaked     a prompt with one more sentence, the first prompt's answer as the prediction
              (an answer that follows its prediction in parts)

Printed per way: decode tok/s (generated tokens / wall time, batch 1, prefill included),
its ratio to plain, tokens drafted and accepted, and whether the text is plain's (it must
be for plain's own prompt: a draft never changes the text). Asserts nothing about time.

    .venv/bin/python benchmarks/predicted_outputs.py [--rounds 3] [--k 8] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.machine import cpu_line
from iterserve.engine.llm import LLM
from iterserve.sampling_params import SamplingParams

PROMPTS = [
    "Write a paragraph about the history of Paris.",
    "Explain how a bicycle works, step by step.",
    "Write a short story about a lighthouse keeper.",
    "Describe the water cycle for a ten-year-old.",
]
TWEAK = " Keep it friendly."


@dataclass
class Way:
    name: str
    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    same_as_plain: bool = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=8, help="--num-speculative-tokens")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", default="bench_results/predicted_outputs.json")
    args = parser.parse_args()
    print(cpu_line())
    llm = LLM(speculative_method="ngram", num_speculative_tokens=args.k, max_num_seqs=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def chat(text: str) -> list[int]:
        return llm.apply_chat_template([{"role": "user", "content": text}])

    cases = []
    for text in PROMPTS:
        answer = llm.generate([chat(text)], greedy, use_tqdm=False)[0].token_ids
        cases.append((text, tuple(answer)))
    ways = {name: Way(name) for name in ("plain", "lookup", "predicted", "tweaked")}
    plain_text: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for text, answer in cases:
            settings = {
                "plain": (chat(text), replace(greedy, speculative=False)),
                "lookup": (chat(text), greedy),
                "predicted": (chat(text), replace(greedy, prediction=answer)),
                "tweaked": (chat(text + TWEAK), replace(greedy, prediction=answer)),
            }
            for name, (prompt, params) in settings.items():
                stats = llm.engine.scheduler.spec_stats
                drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                way = ways[name]
                way.seconds.append(time.perf_counter() - start)
                way.tokens += len(out.token_ids)
                way.drafted += stats.num_draft_tokens - drafted
                way.accepted += stats.num_accepted_tokens - accepted
                if name == "plain":
                    plain_text[text] = out.token_ids
                elif name != "tweaked":
                    way.same_as_plain &= out.token_ids == plain_text[text]
    base = ways["plain"].tokens / sum(ways["plain"].seconds)
    print(f"{'way':<10} {'tok/s':>8} {'x plain':>8} {'drafted':>8} {'accepted':>9} same text")
    rows = []
    for way in ways.values():
        rate = way.tokens / sum(way.seconds)
        same = "-" if way.name == "tweaked" else str(way.same_as_plain)
        print(
            f"{way.name:<10} {rate:8.1f} {rate / base:8.2f} {way.drafted:8d} {way.accepted:9d} "
            f"{same}"
        )
        rows.append({**asdict(way), "tok_s": rate, "ratio": rate / base,
                     "median_s": statistics.median(way.seconds)})  # fmt: skip
    write_results(args.json, {"cpu": cpu_line(), "args": vars(args), "ways": rows})


if __name__ == "__main__":
    main()
