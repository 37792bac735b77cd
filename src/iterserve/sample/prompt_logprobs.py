"""Prompt logprobs: the logprob of each prompt token under the logits of the position
before it, from the rows a prefill chunk already computed (no second pass)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from iterserve.core.outputs import ScheduledSeq, TokenLogprobs

# Rows turned into log-probabilities at a time: a long chunk's [rows, vocab] float32
# log_softmax would otherwise double the logits' own footprint (2048 x 49152 is 400 MB).
_ROWS_AT_ONCE = 128


def score_tokens(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprobs]:
    """Row i's log_softmax at token_ids[i], its rank there, and the row's top_n (token,
    logprob), best first: the raw distribution, as vLLM reports prompt logprobs."""
    scored: list[TokenLogprobs] = []
    for start in range(0, len(token_ids), _ROWS_AT_ONCE):
        rows = logits[start : start + _ROWS_AT_ONCE].float()
        logprobs = torch.log_softmax(rows, dim=-1)
        targets = torch.tensor(token_ids[start : start + len(rows)], device=rows.device)
        chosen_t = logprobs.gather(1, targets.unsqueeze(1))
        ranks = ((logprobs > chosen_t).sum(1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        top_values: list[list[float]] = [[] for _ in chosen]
        top_ids: list[list[int]] = [[] for _ in chosen]
        if top_n:
            values, indices = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)
            top_values, top_ids = values.tolist(), indices.tolist()
        for j, logprob in enumerate(chosen):
            top = list(zip(top_ids[j], top_values[j], strict=True))
            scored.append(TokenLogprobs(token_ids[start + j], logprob, top, ranks[j]))
    return scored


def take_prompt_logprobs(
    logits: torch.Tensor, seqs: Sequence[ScheduledSeq]
) -> tuple[torch.Tensor, dict[str, list[TokenLogprobs]]]:
    """Split a step's logits (each sequence's rows: its prompt-scoring ones, then its
    samples', ScheduledSeq.num_logits) into the sampling rows and the prompt logprobs."""
    sample_rows: list[int] = []
    scored: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for seq in seqs:
        num_scored = len(seq.scored_prompt_token_ids)
        if num_scored:
            top_n = seq.sampling_params.prompt_logprobs or 0
            scored[seq.request_id] = score_tokens(
                logits[row : row + num_scored], seq.scored_prompt_token_ids, top_n
            )
        sample_rows.extend(range(row + num_scored, row + seq.num_logits))
        row += seq.num_logits
    index = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)
    return logits.index_select(0, index), scored
