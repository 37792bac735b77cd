"""How often the bundled model's 4-bit path picks another greedy token than its bf16 path.

Both paths read the same GGUF: `--weights bf16` dequantizes every projection to bf16, the
default keeps the 4-bit layers (and the 8-bit head) as they are for the few-row steps that
decoding is. For each prompt the bf16 path generates greedily; then both paths are
teacher-forced over exactly those tokens one decode step at a time (the 4-bit kernels only
run on few-row steps) and their argmax compared at every position. Free-running outputs are
compared too: how far they go before the first different token. Also prints both answers to
the Paris check. Asserts nothing.

    .venv/bin/python benchmarks/int4_agreement.py [--tokens 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from iterserve.core.outputs import ScheduledSeq, SchedulerOutput
from iterserve.engine.llm import LLM
from iterserve.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colours are",
    "In 1969, the first humans",
    "Photosynthesis is the process by which",
    "A good way to learn a new language is",
]
CHATS = [
    "Name three colours.",
    "Write a haiku about autumn.",
    "What is 17 times 3?",
    "Give me two tips for sleeping better.",
]


def teacher_forced_argmax(llm: LLM, prompt: list[int], continuation: list[int]) -> list[int]:
    """The path's greedy pick after the prompt and after each continuation token, feeding
    the given tokens one decode step at a time through the engine's executor."""
    engine = llm.engine
    runner = engine.executor
    block_size = engine.config.cache.block_size
    total = len(prompt) + len(continuation)
    blocks = list(range(-(-total // block_size)))  # a fresh engine: every block is free
    greedy = SamplingParams(temperature=0.0)

    def step(tokens: list[int], done: int) -> int:
        seq = ScheduledSeq("forced", tokens, done, blocks, True, greedy)
        return runner.execute(SchedulerOutput([seq])).sampled["forced"][0].token_id

    picks = [step(prompt, 0)]
    for i, token in enumerate(continuation[:-1]):
        picks.append(step([token], len(prompt) + i))
    return picks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", default="bench_results/int4_agreement.json")
    args = parser.parse_args()

    paths = {"bf16": LLM(weights="bf16"), "int4": LLM()}
    for name, llm in paths.items():
        plan = llm.engine.model_plan
        print(f"{name}: weights {plan.weights}, linears {plan.linears}")
    bf16, int4 = paths["bf16"], paths["int4"]
    prompts = [bf16.engine.tokenize(p) for p in PROMPTS]
    prompts += [bf16.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    rows = []
    same = compared = 0
    for prompt in prompts:
        reference = bf16.generate([prompt], params, use_tqdm=False)[0].token_ids
        free = int4.generate([prompt], params, use_tqdm=False)[0].token_ids
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(reference, free, strict=True)) if a != b), None
        )
        ref_picks = teacher_forced_argmax(bf16, prompt, reference)
        int4_picks = teacher_forced_argmax(int4, prompt, reference)
        agree = sum(a == b for a, b in zip(ref_picks, int4_picks, strict=True))
        same += agree
        compared += len(ref_picks)
        rows.append(
            {
                "prompt": bf16.tokenizer.decode(prompt)[-60:],
                "teacher_forced_agreement": agree / len(ref_picks),
                "free_running_first_difference": first_diff,
            }
        )
        where = "never" if first_diff is None else f"at token {first_diff}"
        print(
            f"{agree}/{len(ref_picks)} same picks; free-running outputs differ {where}: {rows[-1]['prompt']!r}"
        )
    print(
        f"teacher-forced: the 4-bit path picks another greedy token than bf16 at "
        f"{compared - same} of {compared} positions ({100 * (compared - same) / compared:.1f}%)"
    )
    paris = SamplingParams(temperature=0.0, max_tokens=8)
    for name, llm in paths.items():
        print(
            f"{name}: 'The capital of France is' ->",
            repr(llm.generate(["The capital of France is"], paris, use_tqdm=False)[0].text),
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"positions": compared, "different": compared - same, "prompts": rows}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
