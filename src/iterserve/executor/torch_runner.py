"""Runs one step on the model: flattens the step plan into one ragged batch.

Every scheduled sequence contributes its new tokens to a single flat batch
(decodes first, then prefill chunks); attention metadata is built once per
step; logits are computed only where a token is sampled.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from iterserve.core.outputs import ModelOutput, SampledToken, SchedulerOutput
from iterserve.model.attention_metadata import (
    AttentionMetadata,
    SeqSpan,
    build_attention_metadata,
)
from iterserve.model.llama import LlamaForCausalLM
from iterserve.sample.sampler import Sampler, make_generator


class TorchRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        seed: int = 0,
        paged_attention_kernel: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.device = device
        self.paged_attention_kernel = paged_attention_kernel
        self.batch_invariant = batch_invariant
        self.sampler = Sampler()
        # Per-request generators for requests that give a seed: their draws then
        # never depend on what else shares the batch.
        self._generators: dict[str, torch.Generator] = {}
        # Requests without a seed share one stream, seeded so runs are repeatable.
        torch.manual_seed(seed)

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        for request_id in scheduled.finished_ids:
            self._generators.pop(request_id, None)
        if scheduled.is_empty:
            return ModelOutput({})
        input_ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        logits_indices: list[int] = []
        for seq in scheduled.seqs:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids)
            positions.extend(range(start, start + seq.num_new_tokens))
            spans.append(SeqSpan(seq.block_ids, start, seq.num_new_tokens))
            # The last token's position and every draft's (num_logits is 0 without sampling).
            logits_indices.extend(range(len(input_ids) - seq.num_logits, len(input_ids)))
        meta = self._metadata(spans)
        forward_start = time.perf_counter()
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            meta,
            self.kv_caches,
            torch.tensor(logits_indices, dtype=torch.long, device=self.device),
        )
        forward_time = time.perf_counter() - forward_start
        sampling = [seq for seq in scheduled.seqs if seq.sample]
        generators = [self._generator(seq.request_id, seq.sampling_params.seed) for seq in sampling]
        # A speculating seeded request draws a uniform per position; only those of the
        # tokens it keeps may count, so its draws stay those of one token per step.
        rewind = {
            i: generator.get_state()
            for i, (seq, generator) in enumerate(zip(sampling, generators, strict=True))
            if seq.draft_token_ids and generator is not None
        }
        result = self.sampler(
            logits,
            [seq.sampling_params for seq in sampling for _ in range(seq.num_logits)],
            [g for seq, g in zip(sampling, generators, strict=True) for _ in range(seq.num_logits)],
        )
        sampled: dict[str, list[SampledToken]] = {}
        row = 0
        for i, seq in enumerate(sampling):
            tokens = result.token_ids[row : row + seq.num_logits]
            kept = 1 + num_accepted(seq.draft_token_ids, tokens)
            sampled[seq.request_id] = [
                SampledToken(token_id, logprobs)
                for token_id, logprobs in zip(
                    tokens[:kept], result.logprobs[row : row + kept], strict=True
                )
            ]
            if i in rewind and kept < seq.num_logits:
                self.sampler.replay_draws(generators[i], rewind[i], kept, seq.sampling_params)
            row += seq.num_logits
        return ModelOutput(sampled, forward_time)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run dummy steps of the shapes serving meets (a lone decode, a prompt, decodes beside
        a chunk over a cached prefix), so compiling, loading compiled graphs and the kernels'
        first-call set-up happen before the first request. Returns the seconds it took.

        The steps write K/V into blocks 0 and 1, which are free at start-up: any request that
        gets them later overwrites every slot before reading it.
        """
        start = time.perf_counter()
        two_blocks = min(2, self.kv_caches[0][0].shape[1])
        steps = [
            [SeqSpan((0,), 0, 1)],
            [SeqSpan((0,), 0, 3)],
            [SeqSpan((0,), 2, 1), SeqSpan((two_blocks - 1,), 1, 2)],
        ]
        for spans in steps:
            num_tokens = sum(s.num_new_tokens for s in spans)
            positions = [
                p
                for s in spans
                for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
            ]
            meta = self._metadata(spans)
            self.model(
                torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                meta,
                self.kv_caches,
                torch.arange(num_tokens, device=self.device),
            )
        self.model.freeze_compiled()
        return time.perf_counter() - start

    def _metadata(self, spans: Sequence[SeqSpan]) -> AttentionMetadata:
        return build_attention_metadata(
            spans,
            self.block_size,
            self.device,
            self.paged_attention_kernel,
            self.model.config.sliding_window,
            self.batch_invariant,
        )

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = make_generator(seed, self.device)
        return generator


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Drafts kept: those before the first that differs from the target's own token at
    its position. `sampled[i]` was drawn from the target's distribution given the
    context and drafts[:i], so keeping drafts[i] only where it equals that draw leaves
    every kept token distributed exactly as in one-token decoding (for a draft that is
    a fixed guess this is the Leviathan et al. rule: accept with probability p(draft),
    otherwise a draw from p without the draft)."""
    accepted = 0
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted
