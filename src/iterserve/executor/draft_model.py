"""Draft tokens from a smaller model with the target's tokenizer (`--speculative-method
draft --draft-model PATH`).

The draft keeps its own paged KV cache, with its own block pool (core/kv_cache.py's,
prefix caching off) and a block table per request. Each step, for all the requests that
may speculate at once:

  1. catch up: the tokens the draft has not seen (the prompt the first time; then the
     tokens the target kept last step) run as one ragged batch; a request whose guesses
     were rejected first forgets the cache past the tokens it still shares;
  2. guess: k - 1 one-token steps over the batch, each feeding back the previous guess.

For a greedy request the guesses are the draft's greedy picks, and the target keeps a
guess where it equals its own pick. For a sampling request the draft samples each guess
from its own distribution q under the request's settings (temperature, top-k/p, min-p),
and the target keeps it by the ratio of its distribution to q (Leviathan et al.;
executor/torch_runner.py), which accepts far more than matching draws would at high
temperature. Either way the text is distributed as the target's own, whatever the draft.

A request under a grammar (structured output) guesses from the draft's logits masked by
its matcher, advanced along its guesses and rolled back after, so every guess is one the
grammar accepts and q is the masked distribution the guess was drawn from. The target's
sampling controls (penalties, logit bias, bad words, min_tokens) are not applied to the
draft: both acceptance rules stay exact for any guesses (a fixed guess is kept only where
the target draws it; a sampled one by the ratio to the q it was drawn from), so the
controls only lower how many guesses are kept (tests/sample/test_sampling_controls.py).

When the draft's pool is full, the least recently speculating requests lose their draft
cache (they catch up again if they speculate later); a request that still does not fit
gets no guesses that step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from iterserve.core.kv_cache import KVCacheManager
from iterserve.core.request import Request
from iterserve.core.speculation import DraftQuery
from iterserve.executor.paged_model import ForwardSeq, PagedModel
from iterserve.sample.sampler import Sampler, make_generator
from iterserve.sample.structured import StructuredBatch
from iterserve.sampling_params import SamplingParams


@dataclass
class _DraftSeq:
    """One request in the draft's cache: `tokens` are those whose K/V it holds."""

    blocks: Request  # the pool's bookkeeping: request_id, block_ids, num_computed_tokens
    tokens: list[int] = field(default_factory=list)

    def shared_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the cache already holds (at most all but the last, which
        must run to give the first guess)."""
        n = min(len(self.tokens), len(token_ids) - 1)
        if self.tokens[:n] == token_ids[:n]:
            return n
        return next(i for i in range(n) if self.tokens[i] != token_ids[i])


class DraftModelProposer:
    def __init__(self, network: PagedModel, num_blocks: int) -> None:
        self.network = network
        self.pool = KVCacheManager(num_blocks, network.block_size, enable_prefix_caching=False)
        self.sampler = Sampler(network.argmax_rows)
        self._seqs: OrderedDict[str, _DraftSeq] = OrderedDict()  # least recently used first
        # Sampled guesses' distributions [k, vocab], until the verifying step takes them.
        self._probs: dict[str, list[torch.Tensor]] = {}
        self._generators: dict[str, torch.Generator] = {}
        # The target's grammar matchers (set by the runner that verifies the guesses).
        self.structured: StructuredBatch | None = None

    def take_probs(self, request_id: str) -> torch.Tensor | None:
        """The distributions the last guesses for this request were sampled from (None:
        they were greedy picks)."""
        probs = self._probs.pop(request_id, None)
        return None if probs is None else torch.stack(probs)

    def warm_up(self) -> float:
        return self.network.warm_up()

    @torch.inference_mode()
    def propose(self, queries: list[DraftQuery]) -> list[list[int]]:
        asked = {q.request_id for q in queries}
        live: list[tuple[int, DraftQuery, _DraftSeq, int]] = []
        for i, query in enumerate(queries):
            seq = self._seqs.pop(query.request_id, None) or _DraftSeq(
                Request(query.request_id, [], SamplingParams(), 0.0)
            )
            self._seqs[query.request_id] = seq
            start = seq.shared_prefix(query.token_ids)
            del seq.tokens[start:]
            seq.blocks.num_computed_tokens = start
            # The unseen tokens, then k - 1 guesses fed back (the last guess is not).
            if self._allocate(seq, len(query.token_ids) - start + query.k - 1, asked):
                live.append((i, query, seq, start))
        drafts: list[list[int]] = [[] for _ in queries]
        if not live:
            return drafts
        batch = [
            ForwardSeq(tuple(seq.blocks.block_ids), start, query.token_ids[start:], 1)
            for _, query, seq, start in live
        ]
        grammar = _Grammars(self.structured, [query for _, query, _, _ in live])
        logits = self.network.forward(batch)
        grammar.mask(logits, [query for _, query, _, _ in live])
        for row, (i, query, seq, _) in enumerate(live):
            seq.tokens = list(query.token_ids)
            self._probs.pop(query.request_id, None)
            if grammar.allows_guess(query):
                drafts[i].append(self._guess(query, logits[row]))
                grammar.follow(query, drafts[i][-1])
        for step in range(1, max(query.k for _, query, _, _ in live)):
            going = [
                (i, query, seq)
                for i, query, seq, _ in live
                if query.k > step and len(drafts[i]) == step and grammar.allows_guess(query)
            ]
            if not going:
                break
            batch = [
                ForwardSeq(tuple(seq.blocks.block_ids), len(seq.tokens), [drafts[i][-1]], 1)
                for i, _, seq in going
            ]
            logits = self.network.forward(batch)
            grammar.mask(logits, [query for _, query, _ in going])
            for row, (i, query, seq) in enumerate(going):
                seq.tokens.append(drafts[i][-1])
                drafts[i].append(self._guess(query, logits[row]))
                grammar.follow(query, drafts[i][-1])
        grammar.rollback()
        for _, _, seq, _ in live:
            seq.blocks.num_computed_tokens = len(seq.tokens)
        return drafts

    def _guess(self, query: DraftQuery, logits: torch.Tensor) -> int:
        params = query.sampling_params
        if self.sampler.is_greedy(params):
            return int(logits.argmax())
        q = self.sampler.probs(logits.unsqueeze(0), params)[0]
        self._probs.setdefault(query.request_id, []).append(q)
        generator = None
        if params.seed is not None:  # a seeded request's guesses are repeatable too
            generator = self._generators.get(query.request_id)
            if generator is None:
                generator = make_generator(params.seed + 1, q.device)
                self._generators[query.request_id] = generator
        return int(torch.multinomial(q, 1, generator=generator))

    def forget(self, request_id: str) -> None:
        self._probs.pop(request_id, None)
        self._generators.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(seq.blocks)

    def _allocate(self, seq: _DraftSeq, num_tokens: int, keep: set[str]) -> bool:
        """Blocks for `num_tokens` more tokens of `seq`, evicting the least recently used
        sequences outside `keep` while the pool is short; False if it still is."""
        while not self.pool.allocate(seq.blocks, num_tokens):
            victim = next((rid for rid in self._seqs if rid not in keep), None)
            if victim is None:
                return False
            self.forget(victim)
        return True


class _Grammars:
    """One propose call's view of the constrained requests' matchers: each guesses from
    logits masked by its grammar after its guesses so far, then the matchers go back to
    where the target's output is."""

    def __init__(self, structured: StructuredBatch | None, queries: list[DraftQuery]) -> None:
        self.structured = structured
        self._followed: dict[str, int] = {}  # request id -> guesses its matcher consumed
        self._done: set[str] = set()
        if structured is None:
            return
        for query in queries:
            if query.sampling_params.structured_output is None:
                continue
            if query.request_id in structured:
                self._followed[query.request_id] = 0
            else:  # no matcher yet (nothing sampled): no guesses rather than unchecked ones
                self._done.add(query.request_id)

    def allows_guess(self, query: DraftQuery) -> bool:
        return query.request_id not in self._done

    def mask(self, logits: torch.Tensor, queries: list[DraftQuery]) -> None:
        """Mask row r of `logits` (one per query) for the constrained queries."""
        rows = [r for r, q in enumerate(queries) if q.request_id in self._followed]
        if rows and self.structured is not None:
            self.structured.mask(logits, [queries[r].request_id for r in rows], rows)

    def follow(self, query: DraftQuery, token_id: int) -> None:
        """Advance the matcher by a guess; a grammar that is complete (the guess was EOS)
        or refuses the guess ends this request's guessing."""
        if query.request_id not in self._followed or self.structured is None:
            return
        if self.structured.try_advance(query.request_id, token_id):
            self._followed[query.request_id] += 1
            if not self.structured.is_finished(query.request_id):
                return
        self._done.add(query.request_id)

    def rollback(self) -> None:
        if self.structured is not None:
            for request_id, count in self._followed.items():
                self.structured.rollback(request_id, count)
