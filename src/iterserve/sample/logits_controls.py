"""The sampling controls that reshape logits before a token is drawn, vLLM's semantics:

- allowed_token_ids: every other token is banned;
- bad_words: a word's last token is banned where the output so far ends with the rest
  of the word (a one-token word is banned everywhere);
- min_tokens: EOS and stop_token_ids are banned until the output is that long;
- logit_bias: OpenAI's token id -> bias, added to the logit;
- repetition_penalty: logits of tokens seen in prompt or output are divided by it when
  positive and multiplied by it when negative;
- frequency_penalty / presence_penalty: subtract penalty x (count in the output so far)
  and penalty x (seen in the output so far);
  with `penalty_last_n` (llama.cpp's repeat_last_n) all three count the last N tokens of
  prompt and output together instead;
- a thinking budget (thinking_budget.py): past it, the token that closes the thinking is
  the only one left.

Applied in that order (vLLM's: the allowed tokens, bad words, then the argmax-changing
processors, then the penalties; a forced token last, as it overrides them all). Each is one batched tensor
operation over the rows that ask for it: the Python work is per row and per token of
history, never per vocabulary entry. A batch where no row asks costs one flag test per row
and nothing else.

The logprobs a request gets back stay those of the raw logits (vLLM's default,
`logprobs_mode=raw_logprobs`); the caller keeps the raw tensor for them.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from iterserve.core.outputs import ScheduledSeq, TokenContext
from iterserve.sampling_params import SamplingParams


def apply_logits_controls(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[TokenContext | None],
    keep_raw: bool = True,
) -> torch.Tensor:
    """The logits to sample from: `logits` itself when no row asks for a control, else
    with every row's controls applied, on a copy when `keep_raw` (the caller still needs
    the raw rows: logprobs) and in place otherwise. `contexts[i]` holds row i's tokens so
    far; it may be None for rows whose params do not look back
    (SamplingParams.uses_token_history)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.float()  # a new tensor unless the logits are float32 already
    if keep_raw and out is logits:
        out = out.clone()
    out = out.contiguous()
    banned: list[tuple[int, int]] = []  # (row, token) pairs set to -inf
    bias: list[tuple[int, int, float]] = []
    penalized: list[int] = []
    forced: list[tuple[int, int]] = []  # (row, the one token it may draw)
    for i in rows:
        p, context = params[i], contexts[i]
        if p.logit_bias:
            bias += [(i, token_id, value) for token_id, value in p.logit_bias.items()]
        if context is None:
            continue
        banned += [(i, token_id) for token_id in _bad_word_bans(context)]
        if len(context.output_token_ids) < p.min_tokens:
            banned += [(i, token_id) for token_id in context.stop_token_ids]
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            penalized.append(i)
        token = (
            None
            if p.thinking_budget is None
            else p.thinking_budget.forced_token(context.output_token_ids)
        )
        if token is not None:
            forced.append((i, token))
    device = out.device
    for i in rows:  # the allowed tokens first: what the other controls see
        allowed = params[i].allowed_token_ids
        if allowed is not None:
            index = torch.tensor(allowed, device=device)
            kept = out[i, index]
            out[i] = float("-inf")
            out[i, index] = kept
    if banned:
        row_ids, token_ids = zip(*banned, strict=True)
        index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
        out.index_put_(index, torch.tensor(float("-inf"), device=device))
    if bias:
        row_ids, token_ids, values = zip(*bias, strict=True)
        index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
        out.index_put_(index, torch.tensor(values, dtype=out.dtype, device=device), accumulate=True)
    if penalized:
        _penalize(
            out,
            penalized,
            [params[i] for i in penalized],
            [contexts[i] for i in penalized],  # type: ignore[misc]
        )
    for row, token in forced:
        out[row] = float("-inf")
        out[row, token] = 0.0
    return out


def row_contexts(seqs: Sequence[ScheduledSeq]) -> list[TokenContext | None]:
    """One context per sampled position (ScheduledSeq.num_samples rows per sequence): a
    speculating sequence's draft j is sampled after drafts 0..j-1, which count as output
    there. Rejected drafts never reach the scheduler's record, so they count nowhere else."""
    contexts: list[TokenContext | None] = []
    for seq in seqs:
        context = seq.context
        for j in range(seq.num_samples):
            if context is not None and j:
                output = context.output_token_ids + seq.draft_token_ids[:j]
                contexts.append(replace(context, output_token_ids=output))
            else:
                contexts.append(context)
    return contexts


def _bad_word_bans(context: TokenContext) -> list[int]:
    output = context.output_token_ids
    banned = []
    for word in context.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned


def _penalize(
    logits: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    contexts: Sequence[TokenContext],
) -> None:
    """vLLM's penalties, in place: repetition, then frequency and presence.

    Sparse: only the entries of tokens a row has seen change, so the work follows the
    history's length, not the vocabulary's (dense [rows, vocab] passes cost ~2 ms a row on
    a CPU core at vocab 49152). Entries are addressed in the flat view as row * vocab +
    token."""
    vocab = logits.shape[1]
    flat_logits = logits.view(-1)
    device, dtype = logits.device, logits.dtype  # a penalty may be given as an int

    def keys(histories: list[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat key, index into `rows`) of every token of every row's history."""
        lengths = torch.tensor([len(h) for h in histories], device=device)
        tokens = _long_tensor(itertools.chain.from_iterable(histories)).to(device)
        owner = torch.arange(len(histories), device=device).repeat_interleave(lengths)
        return torch.tensor(rows, device=device)[owner] * vocab + tokens, owner

    def per_key(name: str, owner: torch.Tensor) -> torch.Tensor:
        values = torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)
        return values[owner]

    # What frequency and presence count, and what repetition sees besides it: vLLM's output
    # and prompt, or llama.cpp's window over both (and nothing besides).
    counted = [_counted(c, p.penalty_last_n) for c, p in zip(contexts, params, strict=True)]
    output_keys, output_owner = keys(counted)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [c.prompt_token_ids if p.penalty_last_n is None else ()
                   for c, p in zip(contexts, params, strict=True)]  # fmt: skip
        prompt_keys, prompt_owner = keys(prompts)
        seen, first = _unique(torch.cat([output_keys, prompt_keys]))
        owner = torch.cat([output_owner, prompt_owner])[first]
        # Any positive penalty is allowed, but in float32 one below ~1e-45 is 0 and one
        # above ~3e38 is inf, and a banned token's -inf x 0 or a 0 logit x inf is NaN.
        scale = per_key("repetition_penalty", owner).clamp(1e-30, 1e30)
        values = flat_logits[seen]
        values = torch.where(values > 0, values / scale, values * scale)
        # Nor may a seen token's logit become +inf (inf - inf is NaN downstream): the
        # largest float keeps it the favourite.
        flat_logits[seen] = values.clamp(max=torch.finfo(values.dtype).max)
    if any(p.frequency_penalty for p in params):  # once per occurrence
        frequency = per_key("frequency_penalty", output_owner)
        flat_logits.index_put_((output_keys,), -frequency, accumulate=True)
    if any(p.presence_penalty for p in params):  # once per distinct token
        present, first = _unique(output_keys)
        presence = per_key("presence_penalty", output_owner[first])
        flat_logits.index_put_((present,), -presence, accumulate=True)


def _counted(context: TokenContext, last_n: int | None) -> Sequence[int]:
    """The tokens frequency and presence count: the output (vLLM's), or the last `last_n`
    of prompt and output (llama.cpp's repeat_last_n)."""
    output = context.output_token_ids
    if last_n is None:
        return output
    if last_n <= len(output):
        return output[len(output) - last_n :]
    prompt = context.prompt_token_ids
    return [*prompt[max(0, len(prompt) - (last_n - len(output))) :], *output]


def _long_tensor(values: Iterable[int]) -> torch.Tensor:
    """torch.tensor(list(values)) at ~2x the speed for long histories: through an array,
    whose buffer torch reads directly instead of converting one Python int at a time."""
    buffer = array("q", values)
    if not buffer:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(buffer, dtype=torch.long)


def _unique(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct keys, and for each the index of one of its occurrences."""
    distinct, inverse = torch.unique(keys, return_inverse=True)
    first = torch.empty_like(distinct).scatter_(0, inverse, torch.arange(len(keys)))
    return distinct, first
