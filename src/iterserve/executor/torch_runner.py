"""Runs one step on the model: the step plan as one ragged batch, then sampling.

Every scheduled sequence contributes its new tokens to a single flat batch
(decodes first, then prefill chunks; executor/paged_model.py); logits are
computed only where a token is sampled or a prompt token is scored (prompt
logprobs), the sampling controls reshape the sampled rows (penalties, logit
bias, ...), and speculative drafts are verified against the samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from iterserve.core.outputs import (
    ModelOutput,
    SampledToken,
    ScheduledSeq,
    SchedulerOutput,
    TokenLogprobs,
)
from iterserve.executor.draft_model import DraftModelProposer
from iterserve.executor.lora_adapters import LoRAAdapters
from iterserve.executor.paged_model import ForwardSeq, PagedModel
from iterserve.executor.pooler import Pooler, hidden_rows
from iterserve.model.llama import LlamaForCausalLM
from iterserve.sample.logits_controls import apply_logits_controls, row_contexts
from iterserve.sample.prompt_logprobs import take_prompt_logprobs
from iterserve.sample.rejection import verify_by_ratio
from iterserve.sample.sampler import Sampler, make_generator
from iterserve.sample.structured import StructuredBatch


class TorchRunner:
    def __init__(
        self, network: PagedModel, seed: int = 0, drafts: DraftModelProposer | None = None
    ) -> None:
        self.network = network
        # The draft model's proposer, whose sampled guesses come with their distributions.
        self.drafts = drafts
        self.sampler = Sampler(network.argmax_rows)
        # Per-request generators for requests that give a seed: their draws then
        # never depend on what else shares the batch.
        self._generators: dict[str, torch.Generator] = {}
        # Grammar matchers of constrained requests (structured output), by request id; the
        # draft model masks its guesses with them too.
        self.structured = StructuredBatch()
        # Embedding requests' pools across their prompt chunks.
        self.pooler = Pooler(network.model.score_head)
        if drafts is not None:
            drafts.structured = self.structured
        # The LoRA adapters it serves, when the network has slots for them.
        self.adapters = LoRAAdapters(network.lora) if network.lora is not None else None
        # Requests without a seed share one stream, seeded so runs are repeatable.
        torch.manual_seed(seed)

    @property
    def model(self) -> LlamaForCausalLM:
        return self.network.model

    @property
    def device(self) -> torch.device:
        return self.network.device

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        output = self._execute(scheduled)
        if any(seq.pooling for seq in scheduled.seqs):  # embedding requests' chunks
            output.pooled = self.pooler.take(scheduled.seqs, self.network.last_hidden)
        return output

    def _execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        for request_id in scheduled.finished_ids:
            self._generators.pop(request_id, None)
            self.structured.drop(request_id)
            self.pooler.drop(request_id)
        if scheduled.is_empty:
            return ModelOutput({})
        if self.adapters is not None:
            self.adapters.prepare(scheduled.seqs)
        copies = [copy for seq in scheduled.seqs for copy in seq.kv_copies]
        if copies:  # reused K/V in place before any token reads it (--cache-reuse)
            self.network.copy_kv(copies)
        # The last token's position and every draft's, after any prompt-scoring rows; the
        # rows an embedding pools.
        logits = self.network.forward(
            [
                ForwardSeq(
                    seq.block_ids,
                    seq.num_computed_tokens,
                    seq.token_ids,
                    seq.num_logits,
                    hidden_rows(seq),
                    lora_slot=seq.lora_slot,
                    embeds=given_rows(seq),
                    attend_within=spans_within(seq),
                    rope_shift=seq.rope_shift,
                    grid_positions=grid_positions(seq),
                )
                for seq in scheduled.seqs
            ]
        )
        forward_time = self.network.last_forward_seconds
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if any(seq.scored_prompt_token_ids for seq in scheduled.seqs):
            logits, prompt_logprobs = take_prompt_logprobs(logits, scheduled.seqs)
        sampling = [seq for seq in scheduled.seqs if seq.sample]
        if not sampling:  # prompt chunks and embeddings only
            return ModelOutput({}, forward_time, prompt_logprobs)
        # The controls' logits are sampled from; the raw ones give the logprobs, so they
        # are copied first only when a controlled row reports logprobs.
        controlled = logits
        controlled_params = [
            s.sampling_params for s in sampling if s.sampling_params.adjusts_logits
        ]
        if controlled_params:
            controlled = apply_logits_controls(
                logits,
                [seq.sampling_params for seq in sampling for _ in range(seq.num_samples)],
                row_contexts(sampling),
                # logprobs report the raw logits; a grammar falls back on them (below)
                keep_raw=any(
                    p.logprobs is not None or p.structured_output is not None
                    for p in controlled_params
                ),
            )
        constrained = [seq for seq in sampling if seq.sampling_params.structured_output]
        if constrained:  # after the controls: the grammar has the last word
            self._mask_by_grammar(controlled, logits, sampling, constrained)
        # Guesses a draft model sampled from its own distribution q are accepted by the
        # ratio rule; fixed guesses (n-gram, greedy drafts) by matching the target's draw.
        by_ratio = {
            i: q
            for i, seq in enumerate(sampling)
            if seq.draft_token_ids and (q := self._draft_probs(seq.request_id)) is not None
        }
        if not by_ratio:  # every step without a draft model's sampled guesses
            sampled = self._sample_matching(controlled, logits, sampling)
            return self._advanced(sampled, constrained, forward_time, prompt_logprobs)
        starts = list(itertools.accumulate((seq.num_samples for seq in sampling), initial=0))
        by_match = [i for i in range(len(sampling)) if i not in by_ratio]
        sampled: dict[str, list[SampledToken]] = {}
        if by_match:
            rows = [r for i in by_match for r in range(starts[i], starts[i + 1])]
            sampled |= self._sample_matching(
                controlled[rows], logits[rows], [sampling[i] for i in by_match]
            )
        for i, q in by_ratio.items():
            seq, rows_i = sampling[i], slice(starts[i], starts[i + 1])
            sampled[seq.request_id] = self._sample_by_ratio(
                controlled[rows_i], logits[rows_i], seq, q
            )
        return self._advanced(sampled, constrained, forward_time, prompt_logprobs)

    def _mask_by_grammar(
        self,
        logits: torch.Tensor,
        raw_logits: torch.Tensor,
        sampling: list[ScheduledSeq],
        constrained: list[ScheduledSeq],
    ) -> None:
        """Forbid, in one pass, every token a constrained request's grammar rejects next,
        at each of its positions: a speculating request's row j is masked by its grammar
        after its first j drafts, so verification keeps only drafts the grammar accepts
        and draws every token from the masked distribution (sample/structured.py).
        Its matcher is made when it first samples: after its whole prompt, so a chunked
        prefill or a recompute after preemption (whose tokens were sampled already and are
        not sampled again) leaves the matcher where the output is."""
        structured = self.structured
        row_of = {}
        row = 0
        for seq in sampling:
            row_of[seq.request_id] = row
            row += seq.num_samples
        for seq in constrained:
            spec = seq.sampling_params.structured_output
            assert spec is not None
            if seq.request_id not in structured:
                if spec.compiled is None:
                    raise RuntimeError(f"request {seq.request_id}: its grammar was not compiled")
                structured.add(seq.request_id, spec.compiled, spec.after_thinking)
        ids = [seq.request_id for seq in constrained]
        rows = [row_of[request_id] for request_id in ids]
        drafts = [seq.draft_token_ids for seq in constrained]
        fallback = raw_logits if raw_logits is not logits else None
        structured.mask(logits, ids, rows, drafts if any(drafts) else None, fallback)

    def _advanced(
        self,
        sampled: dict[str, list[SampledToken]],
        constrained: list[ScheduledSeq],
        forward_time: float,
        prompt_logprobs: dict[str, list[TokenLogprobs]],
    ) -> ModelOutput:
        """The step's output, once each constrained request's matcher took its token."""
        for seq in constrained:
            tokens = [token.token_id for token in sampled[seq.request_id]]
            self.structured.advance(seq.request_id, tokens)
        return ModelOutput(sampled, forward_time, prompt_logprobs)

    def _sample_matching(
        self, logits: torch.Tensor, raw_logits: torch.Tensor, seqs: list[ScheduledSeq]
    ) -> dict[str, list[SampledToken]]:
        """One draw per position; drafts kept up to the first that differs from the draw
        at its position, then that draw."""
        generators = [self._generator(seq.request_id, seq.sampling_params.seed) for seq in seqs]
        # A speculating seeded request draws a uniform per position; only those of the
        # tokens it keeps may count, so its draws stay those of one token per step.
        rewind = {
            i: generator.get_state()
            for i, (seq, generator) in enumerate(zip(seqs, generators, strict=True))
            if seq.draft_token_ids and generator is not None
        }
        result = self.sampler(
            logits,
            [seq.sampling_params for seq in seqs for _ in range(seq.num_samples)],
            [g for seq, g in zip(seqs, generators, strict=True) for _ in range(seq.num_samples)],
            raw_logits,
        )
        sampled: dict[str, list[SampledToken]] = {}
        row = 0
        for i, seq in enumerate(seqs):
            tokens = result.token_ids[row : row + seq.num_samples]
            kept = 1 + num_accepted(seq.draft_token_ids, tokens)
            sampled[seq.request_id] = [
                SampledToken(token_id, logprobs)
                for token_id, logprobs in zip(
                    tokens[:kept], result.logprobs[row : row + kept], strict=True
                )
            ]
            if i in rewind and kept < seq.num_samples:
                self.sampler.replay_draws(generators[i], rewind[i], kept, seq.sampling_params)
            row += seq.num_samples
        return sampled

    def _sample_by_ratio(
        self, logits: torch.Tensor, raw_logits: torch.Tensor, seq: ScheduledSeq, q: torch.Tensor
    ) -> list[SampledToken]:
        """Guesses the draft sampled, kept by the ratio rule (sample/rejection.py)."""
        params = seq.sampling_params
        generator = self._generator(seq.request_id, params.seed)
        tokens = verify_by_ratio(
            self.sampler.probs(logits, params),
            q,
            seq.draft_token_ids,
            lambda: self.sampler.uniform(generator),
            generator,
        )
        logprobs = self.sampler.logprobs_of(raw_logits[: len(tokens)], params, tokens)
        return [SampledToken(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]

    def _draft_probs(self, request_id: str) -> torch.Tensor | None:
        return None if self.drafts is None else self.drafts.take_probs(request_id)

    def warm_up(self) -> float:
        return self.network.warm_up()

    def close(self) -> None:
        self.network.close()

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


def spans_within(seq: ScheduledSeq) -> tuple[tuple[int, int], ...]:
    """The [first, end) position ranges this chunk reaches whose positions attend to each
    other both ways (PromptEmbeds.bidirectional: Gemma 3's images)."""
    embeds = seq.prompt_embeds
    if embeds is None or not embeds.bidirectional:
        return ()
    lo, hi = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_new_tokens
    return tuple(
        (first, first + count) for first, count in embeds.spans if first < hi and first + count > lo
    )


def grid_positions(seq: ScheduledSeq) -> list[tuple[int, int, int]] | None:
    """Each token's (time, height, width) rotary positions where this chunk places an
    image's grid (M-RoPE); None otherwise."""
    embeds = seq.prompt_embeds
    if embeds is None or not embeds.grids:
        return None
    return embeds.grid_positions(seq.num_computed_tokens, seq.num_new_tokens)


def given_rows(seq: ScheduledSeq) -> tuple[list[int], torch.Tensor] | None:
    """The positions of this chunk of a prompt that are given as input rows (offsets into
    the chunk) and those rows, in place of their tokens' embeddings; None where there are
    none."""
    embeds = seq.prompt_embeds
    if embeds is None:
        return None
    pieces = embeds.pieces(seq.num_computed_tokens, seq.num_new_tokens)
    if not pieces:
        return None
    offsets = [offset + i for offset, _, count in pieces for i in range(count)]
    rows = [embeds.rows[row : row + count] for _, row, count in pieces]
    return offsets, rows[0] if len(rows) == 1 else torch.cat(rows)
