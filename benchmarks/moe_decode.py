"""Decode speed of a small random Mixtral against the dense model of the same active size.

Two random checkpoints are written to a temporary directory with transformers' own classes:
a Mixtral (8 experts, top-2, each expert `--expert-width` wide) and a dense Mistral whose MLP
is top_k times as wide, so a token multiplies by the same number of weights in both (the MoE
adds only its router). Both have the same attention, embedding and tokenizer (the bundled
model's). Each batch of B requests (prompts of ordinary tokens, ignore_eos) runs to completion
on an offline engine with the engine's defaults (bf16 weights, iterserve's kernels where they
run), the two models alternating batch by batch so that a noisy spell of this shared machine
hits both. Prints, per model and batch size, decode tok/s (generated tokens of decode-only
steps over their wall time) and the median decode step, then the MoE/dense ratio.

What the ratio measures: at batch 1 a token reads its 2 experts' weights, as many bytes as the
dense MLP, so the gap is the MoE block's own overhead (routing, grouping, one product pair per
expert, the scatter) and the ops around it (the dense model runs one fused C++ op per layer;
the MoE model a compiled graph around one opaque expert op, compiled at start-up). At
batch 32 nearly every expert is hit: the step reads all 8 experts, 4x the dense MLP's weights.
Asserts nothing.

    .venv/bin/python benchmarks/moe_decode.py [--batch-sizes 1,32] [--enforce-eager] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import transformers

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve import kernels
from iterserve.bench.machine import cpu_line
from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
from iterserve.engine.llm import LLM
from iterserve.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"


def write_checkpoints(out: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The MoE and its dense twin as HF directories with the bundled tokenizer."""
    tokenizer = load_tokenizer(None)
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    models = {
        "moe": transformers.MixtralConfig(
            **shape,
            intermediate_size=args.expert_width,
            num_local_experts=args.experts,
            num_experts_per_tok=args.top_k,
        ),
        "dense": transformers.MistralConfig(
            **shape, intermediate_size=args.top_k * args.expert_width
        ),
    }
    paths = {}
    for name, config in models.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        paths[name] = out / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def decode_rate(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """Decode tok/s and the median decode step (ms) of one batch run to completion."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    decode_time, decode_tokens, steps = 0.0, 0, []
    while engine.has_unfinished():
        prefill_before, generated_before = (
            engine.stats.prefill_tokens,
            engine.stats.generated_tokens,
        )
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.stats.prefill_tokens == prefill_before:
            decode_time += elapsed
            decode_tokens += engine.stats.generated_tokens - generated_before
            steps.append(elapsed)
    return decode_tokens / decode_time, statistics.median(steps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=768)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per batch")
    parser.add_argument("--json", default=None, help="default: benchmarks/results/<date>-...")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    args = parser.parse_args()

    print(cpu_line(), flush=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    vocab = np.asarray(ordinary_token_ids(load_tokenizer(None)))
    rng = np.random.default_rng(0)
    prompts = [rng.choice(vocab, size=args.prompt_len).tolist() for _ in range(max(batch_sizes))]
    with tempfile.TemporaryDirectory(prefix="moe-decode-") as tmp:
        paths = write_checkpoints(Path(tmp), args)
        engines = {
            name: LLM(
                str(path),
                max_num_seqs=max(batch_sizes),
                enable_prefix_caching=False,
                compile=not args.enforce_eager,
            )
            for name, path in paths.items()
        }
    plans = {name: llm.engine.model_plan for name, llm in engines.items()}
    for name, plan in plans.items():
        print(f"{name:5s} step {plan.step}, weights {plan.weights}, linears {plan.linears}")
    for llm in engines.values():  # first-step effects (allocator, caches) out of the way
        decode_rate(llm, prompts[:2], 4)

    rows = []
    print(f"{'model':5s} {'batch':>5s} {'decode tok/s':>13s} {'step ms':>8s}")
    for batch in batch_sizes:
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                runs[name].append(decode_rate(llm, prompts[:batch], args.output_len))
        best = {name: max(r) for name, r in runs.items()}  # the least disturbed run
        for name, (rate, step_ms) in best.items():
            rows.append({"model": name, "batch": batch, "decode_tok_s": rate, "step_ms": step_ms})
            print(f"{name:5s} {batch:5d} {rate:13.1f} {step_ms:8.2f}", flush=True)
        print(
            f"      moe/dense decode tok/s at batch {batch}: {best['moe'][0] / best['dense'][0]:.2f}"
        )

    isa = kernels.isa() if kernels.available() else "torch"
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    write_results(
        args.json or RESULTS / f"{day}-moe_decode-{isa}.json",
        {
            "cpu": cpu_line(),
            "shape": {
                k: getattr(args, k)
                for k in ("hidden", "layers", "experts", "top_k", "expert_width")
            },
            "plans": {
                name: plan.describe() | {"linears": plan.linears} for name, plan in plans.items()
            },
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
