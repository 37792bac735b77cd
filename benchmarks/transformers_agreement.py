"""Greedy tokens of iterserve and transformers on the same weights, compared token by token.

The file (default: the bundled SmolLM2-135M-Instruct Q4_1; any GGUF or HF directory of a
family transformers has) is read by iterserve's loader, and transformers gets those weights,
dequantized to --dtype, in its family's class (bench/transformers_checkpoint.py): both
engines hold the same values. iterserve (`LLM`, its defaults at that dtype: for bfloat16 the
file's blocks on int8 activations, for float32 dense fp32 weights, the reference path) and
then transformers (`generate`, greedy) continue the held-out prompts of
llama_cpp_agreement.py, one engine after the other. Printed as llama_cpp_agreement.py prints
(iterserve's log-probabilities of both tokens where they first differ). Asserts nothing.

    .venv/bin/python benchmarks/transformers_agreement.py [--model FILE.gguf] [--dtype float32]
        [--prompts 8] [--tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from _agreement import compare, iterserve_greedy  # type: ignore[import-not-found]
from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve import kernels
from iterserve.bench.machine import cpu_line
from iterserve.bench.peer_transformers import load_transformers_model
from iterserve.model.bundled import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the bundled one")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--json", default="bench_results/transformers_agreement.json")
    args = parser.parse_args()
    model = args.model or default_model_path()
    print(cpu_line())
    prompts, ours, plan = iterserve_greedy(model, args.dtype, args.prompts, args.tokens)
    reference, _ = load_transformers_model(str(model), args.dtype)
    theirs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,  # as ignore_eos
            )
            theirs.append(out[0, len(prompt) :].tolist())
    print(
        f"{model.name}: iterserve {plan.dtype}, weights {plan.weights}, step {plan.step}, "
        f"kernels {kernels.isa()}; transformers {args.dtype}; {len(prompts)} prompts, "
        f"{args.tokens} tokens each"
    )
    rows = compare(ours, theirs, prompts)
    write_results(
        args.json,
        {
            "cpu": cpu_line(),
            "kernels": kernels.isa(),
            "model": str(model),
            "dtype": args.dtype,
            "weights": plan.weights,
            "step": plan.step,
            "tokens": args.tokens,
            "identical": sum(r["agree"] is None for r in rows),
            "prompts": rows,
        },
    )


if __name__ == "__main__":
    main()
