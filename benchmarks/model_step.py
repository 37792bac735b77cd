"""Time one engine step of the Llama network at SmolLM2-135M's shapes (random bf16 weights).

Prints ms per step and tok/s for decode batches at ~256 tokens of context, a 512-token
prefill and a mixed step, then the same decode shapes through transformers' own forward and
KV cache, and the ratio. `--kernels` adds the decode-attention alternatives side by side.
Asserts nothing about time: the machine is shared and noisy; compare numbers from one run.

    .venv/bin/python benchmarks/model_step.py [--threads 2] [--json out.json] [--kernels]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from iterserve.model import attention
from iterserve.model.attention import allocate_kv_caches, paged_attention
from iterserve.model.attention_metadata import SeqSpan, build_attention_metadata
from iterserve.model.config import ModelConfig
from iterserve.model.llama import LlamaForCausalLM

SMOLLM2_135M = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
CPU = torch.device("cpu")


def timed(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median seconds per call: the median shrugs off other tenants' bursts better than a mean."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class StepBench:
    """Our model on a shuffled block pool; a step is (metadata build + forward) like the runner's."""

    def __init__(self, num_blocks: int) -> None:
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(SMOLLM2_135M, DTYPE, CPU)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.normal_(1.0, 0.02) if "norm" in name else param.normal_(0.0, 0.02)
        self.caches = allocate_kv_caches(SMOLLM2_135M, num_blocks, BLOCK_SIZE, DTYPE, CPU)
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)  # scattered blocks, as after hours of churn

    def span(self, cached: int, new: int) -> SeqSpan:
        blocks = [self.free.pop() for _ in range(-(-(cached + new) // BLOCK_SIZE))]
        return SeqSpan(tuple(blocks), cached, new)

    def step_fn(self, spans: list[SeqSpan]) -> Callable[[], torch.Tensor]:
        num_tokens = sum(s.num_new_tokens for s in spans)
        ids = torch.randint(0, SMOLLM2_135M.vocab_size, (num_tokens,))
        positions = torch.cat(
            [
                torch.arange(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
                for s in spans
            ]
        )
        last_rows = torch.tensor([s.num_new_tokens for s in spans]).cumsum(0) - 1

        def step() -> torch.Tensor:
            meta = build_attention_metadata(spans, BLOCK_SIZE, CPU)
            return self.model(ids, positions, meta, self.caches, last_rows)

        return step


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call, calls alternating so a noisy spell hits every contender."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def hf_decode_step(batch: int, context: int) -> Callable[[], None]:
    """transformers' forward + DynamicCache, one new token per sequence at `context`."""
    c = SMOLLM2_135M
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).to(DTYPE).eval()
    with torch.inference_mode():
        prompt = torch.randint(0, c.vocab_size, (batch, context - 1))
        cache = transformers.DynamicCache(config=hf_config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = torch.randint(0, c.vocab_size, (batch, 1))

    @torch.inference_mode()
    def step() -> None:
        model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.crop(-1)  # drop the new token: every timed step sees the same context

    return step


def decode_kernels(bench: StepBench, spans: list[SeqSpan], repeats: int) -> dict[str, float]:
    """Decode attention alone over all 30 layers' paged caches, ms per step.

    The two paths paged_attention picks between (forced through its size threshold), plus
    the alternatives that lost. Walking every layer keeps the pool as cold as in a real step.
    """
    c = SMOLLM2_135M
    heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    batch, group, scale = len(spans), heads // kv_heads, head_dim**-0.5
    q = torch.randn(batch, heads, head_dim, dtype=DTYPE)
    k = torch.randn(batch, kv_heads, head_dim, dtype=DTYPE)
    meta = build_attention_metadata(spans, BLOCK_SIZE, CPU)
    rows = attention._plan(meta, heads, bench.caches[0][0]).decode_key_rows
    bias = meta.decode_mask.view(batch, 1, 1, -1)

    def paged(threshold: int) -> Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        step_meta = build_attention_metadata(spans, BLOCK_SIZE, CPU)
        saved, attention._SDPA_DECODE_MAX_BYTES = attention._SDPA_DECODE_MAX_BYTES, threshold
        try:  # the path is fixed when a step's plan is built, i.e. right here
            attention._plan(step_meta, heads, bench.caches[0][0])
        finally:
            attention._SDPA_DECODE_MAX_BYTES = saved
        return lambda kv: paged_attention(q, k, k, kv, step_meta, scale)  # writes 1 token too

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [B, kv_heads, context, head_dim]
        flat = cache.view(-1, cache.shape[2] * head_dim).index_select(0, rows)
        return flat.view(kv_heads, batch, -1, head_dim).transpose(0, 1)

    def sdpa_fp32(kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        keys, values = gather(kv[0]).float(), gather(kv[1]).float()
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).float(), keys, values, bias, scale=scale, enable_gqa=True
        )
        return out.to(DTYPE)

    def grouped_matmul_both(kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        keys, values = gather(kv[0]), gather(kv[1])
        grouped_q = q.view(batch, kv_heads, group, head_dim)
        scores = torch.matmul(grouped_q, keys.transpose(-1, -2)).float() * scale + bias
        return torch.matmul(torch.softmax(scores, dim=-1).to(DTYPE), values)

    kernels: dict[str, Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = {
        "gather_sdpa_bf16": paged(1 << 62),
        "matmulK_embagV": paged(0),
        "gather_sdpa_fp32": sdpa_fp32,
        "gather_grouped_matmul": grouped_matmul_both,
    }
    with torch.inference_mode():
        return {
            name: timed(lambda fn=fn: [fn(kv) for kv in bench.caches], repeats) * 1e3
            for name, fn in kernels.items()
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--kernels", action="store_true", help="compare decode-attention kernels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ctx = args.context

    # Scenarios share the 64 decoding sequences, so the pool holds them once.
    bench = StepBench(num_blocks=64 * -(-ctx // BLOCK_SIZE) + 2 * 512 // BLOCK_SIZE)
    decodes = [bench.span(ctx - 1, 1) for _ in range(64)]
    scenarios = {f"decode_b{b}": decodes[:b] for b in (1, 8, 32, 64)}
    scenarios["prefill_512"] = [bench.span(0, 512)]
    # The chunk follows a 256-token cached prefix, so it also exercises the gather path.
    scenarios["mixed_32dec_256chunk"] = [*decodes[:32], bench.span(256, 256)]

    results: dict[str, dict[str, float]] = {}
    print(f"SmolLM2-135M shapes, bf16, {args.threads} threads, context ~{ctx}, block {BLOCK_SIZE}")
    for name, spans in scenarios.items():
        step = bench.step_fn(spans)
        ms = timed(step, args.repeats) * 1e3
        meta_ms = timed(lambda s=spans: build_attention_metadata(s, BLOCK_SIZE, CPU), 20) * 1e3
        tokens = sum(s.num_new_tokens for s in spans)
        results[name] = {"ms": ms, "tok_s": tokens / ms * 1e3, "metadata_ms": meta_ms}
        print(
            f"  {name:24s} {ms:8.1f} ms/step {tokens / ms * 1e3:8.0f} tok/s  (metadata {meta_ms:.2f} ms)"
        )

    if not args.skip_hf:
        print("vs transformers LlamaForCausalLM + DynamicCache (sdpa), same shapes, interleaved:")
        for batch in (1, 32):
            pair = {"ours": bench.step_fn(scenarios[f"decode_b{batch}"])}
            pair["hf"] = hf_decode_step(batch, ctx)
            ms_each = {name: t * 1e3 for name, t in interleaved(pair, 2 * args.repeats).items()}
            ratio = ms_each["hf"] / ms_each["ours"]
            results[f"vs_hf_decode_b{batch}"] = {
                "ours_ms": ms_each["ours"],
                "hf_ms": ms_each["hf"],
                "hf_tok_s": batch / ms_each["hf"] * 1e3,
                "speedup": ratio,
            }
            print(
                f"  decode_b{batch:<3d} iterserve {ms_each['ours']:7.1f} ms  transformers "
                f"{ms_each['hf']:7.1f} ms ({batch / ms_each['hf'] * 1e3:4.0f} tok/s)"
                f"  -> iterserve {ratio:.2f}x faster"
            )

    if args.kernels:
        print(f"decode attention alone, all 30 layers, context {ctx} (ms per step; the engine")
        print(
            f"  uses gather_sdpa_bf16 up to {attention._SDPA_DECODE_MAX_BYTES >> 20} MiB of K+V, else matmulK_embagV):"
        )
        for batch in (1, 32, 64):
            timings = decode_kernels(bench, decodes[:batch], args.repeats)
            results[f"attention_kernels_b{batch}"] = timings
            print(f"  batch {batch:3d}: " + "  ".join(f"{k} {v:.1f}" for k, v in timings.items()))

    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
