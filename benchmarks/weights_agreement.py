"""How often the bundled model's quantized paths pick another greedy token than its bf16 path.

Every path reads the same GGUF: `--weights bf16` dequantizes every projection to bf16; the
default (`auto`) runs the file's own blocks (Q4_1, Q8_0 head) on int8 activations at every
step size; `--weights int8` runs every projection as Q8_0 blocks; the `-kv8` paths are those
with `--kv-cache-dtype int8` (K/V stored in 8 bits). For each prompt the bf16 path
generates greedily; then each path is teacher-forced over exactly those tokens twice, and
its argmax compared with the bf16 path's at every position:

  decode   one token a step, as decoding runs (one row a step)
  prefill  the whole prompt and answer in one step, logits at every position (many rows:
           for the block formats the same arithmetic as one row, so decode and prefill
           of one path agree exactly; bf16's many-row kernels differ in summation order)

Free-running outputs are compared too (how far they go before the first different token),
and every path answers the Paris check. Asserts nothing.

    .venv/bin/python benchmarks/weights_agreement.py [--tokens 128] [--paths auto,bf16-kv8]
"""

from __future__ import annotations

import argparse

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.core.outputs import ScheduledSeq, SchedulerOutput
from iterserve.engine.llm import LLM
from iterserve.executor.paged_model import ForwardSeq
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
PATHS: dict[str, dict[str, str]] = {
    "bf16": {"weights": "bf16"},
    "auto": {"weights": "auto"},
    "int8": {"weights": "int8"},
    "bf16-kv8": {"weights": "bf16", "kv_cache_dtype": "int8"},
    "auto-kv8": {"weights": "auto", "kv_cache_dtype": "int8"},
}
CHATS = [
    "Name three colours.",
    "Write a haiku about autumn.",
    "What is 17 times 3?",
    "Give me two tips for sleeping better.",
]


def _blocks(llm: LLM, tokens: int) -> list[int]:
    block_size = llm.engine.config.cache.block_size
    return list(range(-(-tokens // block_size)))  # a fresh engine: every block is free


def decode_argmax(llm: LLM, prompt: list[int], continuation: list[int]) -> list[int]:
    """The path's greedy pick after the prompt and after each continuation token, feeding
    the given tokens one decode step at a time through the engine's executor."""
    runner = llm.engine.executor
    blocks = _blocks(llm, len(prompt) + len(continuation))
    greedy = SamplingParams(temperature=0.0)

    def step(tokens: list[int], done: int) -> int:
        seq = ScheduledSeq("forced", tokens, done, blocks, True, greedy)
        return runner.execute(SchedulerOutput([seq])).sampled["forced"][0].token_id

    picks = [step(prompt, 0)]
    for i, token in enumerate(continuation[:-1]):
        picks.append(step([token], len(prompt) + i))
    return picks


def prefill_argmax(llm: LLM, prompt: list[int], continuation: list[int]) -> list[int]:
    """The same picks from one forward over prompt and continuation, logits everywhere."""
    tokens = prompt + continuation[:-1]
    network = llm.engine.executor.network
    logits = network.forward([ForwardSeq(_blocks(llm, len(tokens)), 0, tokens, len(continuation))])
    return logits.argmax(dim=-1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--paths", default="auto,int8", help="compared with bf16: " + ",".join(PATHS)
    )
    parser.add_argument("--json", default="bench_results/weights_agreement.json")
    args = parser.parse_args()

    names = ["bf16", *(n for n in args.paths.split(",") if n != "bf16")]
    paths = {name: LLM(**PATHS[name]) for name in names}
    for name, llm in paths.items():
        plan = llm.engine.model_plan
        print(
            f"{name}: weights {plan.weights}, kv cache {plan.kv_cache_dtype}, linears {plan.linears}"
        )
    bf16 = paths["bf16"]
    prompts = [bf16.engine.tokenize(p) for p in PROMPTS]
    prompts += [bf16.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    modes = {"decode": decode_argmax, "prefill": prefill_argmax}

    rows = []
    # bf16 prefill against bf16 decoding: the floor (same weights, other kernels and sums).
    different = {(name, mode): 0 for name in paths for mode in modes}
    del different[("bf16", "decode")]
    compared = 0
    for prompt in prompts:
        reference = bf16.generate([prompt], params, use_tqdm=False)[0].token_ids
        expected = decode_argmax(bf16, prompt, reference)
        compared += len(expected)
        row: dict[str, object] = {"prompt": bf16.tokenizer.decode(prompt)[-60:]}
        for name, llm in paths.items():
            if name != "bf16":
                free = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
                row[f"{name}_first_difference"] = next(
                    (i for i, (a, b) in enumerate(zip(reference, free, strict=True)) if a != b),
                    None,
                )
            for mode, argmax in modes.items():
                if (name, mode) not in different:
                    continue
                picks = argmax(llm, prompt, reference)
                miss = sum(a != b for a, b in zip(expected, picks, strict=True))
                different[(name, mode)] += miss
                row[f"{name}_{mode}_different"] = miss
        rows.append(row)
        print({k: v for k, v in row.items()})
    print(f"teacher-forced over {compared} positions, picks that differ from bf16 decoding:")
    for (name, mode), miss in different.items():
        print(f"  {name:8s} {mode:8s} {miss:4d} ({100 * miss / compared:.1f}%)")
    paris = SamplingParams(temperature=0.0, max_tokens=8)
    for name, llm in paths.items():
        print(
            f"{name}: 'The capital of France is' ->",
            repr(llm.generate(["The capital of France is"], paris, use_tqdm=False)[0].text),
        )
    summary = {f"{name}_{mode}": miss for (name, mode), miss in different.items()}
    write_results(args.json, {"positions": compared, "different": summary, "prompts": rows})


if __name__ == "__main__":
    main()
