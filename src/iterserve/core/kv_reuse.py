"""Cached K/V reused at shifted positions: llama-server's `--cache-reuse N`.

The prefix cache serves a prompt only as far as it agrees with an earlier one from its
first token. An editor's fill-in-the-middle prompts rarely do for long: as the cursor moves
down, lines leave the head of the window of text before it, and the rest of the prompt
comes back a few tokens earlier than it stood. With `--cache-reuse N` the scheduler matches
a new prompt's tokens after its cached prefix against a recent sequence's, from left to
right (each run of at least N tokens the sequence holds too is taken: `reusable_runs`),
and copies each run's K/V from that sequence's blocks to the new positions; the executor
turns the keys by the distance moved, since RoPE's rotations compose (R(p + d) = R(d)
R(p)). Only the gaps between the runs are computed.

Copied K/V is exact in the first layer (a key there depends on its token and position
alone) and approximate after it, where it was computed after other tokens: the trade
llama-server makes, and why this is off by default. So the blocks from a request's first
copied position on are named in the prefix cache on a chain of their own
(Request.chain_break): an exact prompt never finds them, only another reuse does.

Pure Python like the rest of core/: the scheduler plans the copies (KVCopy, slot by slot)
and the executor moves the rows before the step's forward.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from iterserve.core.kv_cache import BlockHash, KVCacheManager, break_seed, chain_seed
from iterserve.core.request import Request

# Recent sequences a prompt is matched against (llama-server: one per slot), each in turn:
# the one it would take the most from is used.
MAX_SOURCES = 4

# A position held by no valid block: compares equal to no token.
_GONE = -1
# Runs are looked up by their first tokens (at most this many), at most this many places
# a prompt position, and compared this many tokens at a time.
_ANCHOR = 8
_CANDIDATES = 16
_SLICE = 32


@dataclass(frozen=True)
class ReusedRun:
    """`length` tokens found at `source` in a recent sequence and at `target` in the prompt."""

    source: int
    target: int
    length: int

    @property
    def shift(self) -> int:
        return self.target - self.source


@dataclass(frozen=True)
class KVCopy:
    """K/V rows the executor moves before a step's forward: slot `src_slots[i]` to
    `dst_slots[i]` in every layer, the keys rotated by `shift` positions. `target` is the
    first destination position, so a step that never ran knows what it left unwritten."""

    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    shift: int
    target: int


@dataclass(frozen=True)
class ReusePlan:
    """What a prompt takes from a recent sequence: its runs, the source blocks they read
    (by their index in the source's block table; held while the step is planned), and the
    position from which the prompt's K/V is no longer exact."""

    runs: list[ReusedRun]
    source_blocks: dict[int, int]
    approximate_from: int | None  # None: exact throughout

    @property
    def num_tokens(self) -> int:
        return sum(run.length for run in self.runs)

    @property
    def end(self) -> int:
        """The position after the last copied one."""
        return self.runs[-1].target + self.runs[-1].length

    def first_uncopied(self, position: int) -> int:
        """`position`, or past the runs that start there one after another."""
        return past_copied([(run.target, run.length) for run in self.runs], position)[0]

    def next_copied(self, position: int) -> int | None:
        """Where the first run at or after `position` starts (None: no run left)."""
        return next((run.target for run in self.runs if run.target >= position), None)

    def copies(self, target_blocks: Sequence[int], block_size: int) -> list[KVCopy]:
        """The runs as slot copies into the prompt's block table `target_blocks`."""

        def slots(
            blocks: Sequence[int] | dict[int, int], start: int, length: int
        ) -> tuple[int, ...]:
            return tuple(
                blocks[p // block_size] * block_size + p % block_size
                for p in range(start, start + length)
            )

        return [
            KVCopy(
                slots(self.source_blocks, run.source, run.length),
                slots(target_blocks, run.target, run.length),
                run.shift,
                run.target,
            )
            for run in self.runs
        ]


@dataclass
class _Source:
    """A finished sequence as the pool may still hold it: the tokens of its full blocks, the
    blocks' names, the seed of its chain (its LoRA adapter's) and where its K/V stopped
    being exact (its own reuse); its runs' index is made once, when first matched."""

    tokens: list[int]
    names: list[BlockHash]
    seed: BlockHash | None
    exact_upto: int
    index: dict[tuple[int, ...], list[int]] | None = None


def past_copied(spans: Sequence[tuple[int, int]], position: int) -> tuple[int, int]:
    """Computing at `position` passes over the copied spans (start, length; in order) that
    begin there one after another: where it then stands, and how many it passed."""
    passed = 0
    while passed < len(spans) and spans[passed][0] <= position:
        start, length = spans[passed]
        position = max(position, start + length)
        passed += 1
    return position, passed


def run_index(tokens: Sequence[int], anchor: int) -> dict[tuple[int, ...], list[int]]:
    """Where each `anchor` tokens in a row start in `tokens`."""
    starts: dict[tuple[int, ...], list[int]] = {}
    for c in range(len(tokens) - anchor + 1):
        starts.setdefault(tuple(tokens[c : c + anchor]), []).append(c)
    return starts


def reusable_runs(
    cached: Sequence[int],
    prompt: Sequence[int],
    start: int,
    min_length: int,
    index: dict[tuple[int, ...], list[int]] | None = None,
) -> list[ReusedRun]:
    """Runs of at least `min_length` tokens of `prompt` from `start` on that `cached` holds
    too, left to right over the prompt: at each place the longest run found (the one that
    goes on from the last, on a tie) is taken and passed; where none is, the token is left
    to compute. llama-server's walk moves only its cached head past a mismatch, so it stops
    at the first token the cache lacks and finds only runs that moved back; this one also
    finds the text after an insertion, moved forward. `index`: run_index of `cached` by
    min(min_length, _ANCHOR) tokens (of its tokens before any were lost, if it has one)."""
    anchor = min(min_length, _ANCHOR)
    starts = run_index(cached, anchor) if index is None else index
    runs: list[ReusedRun] = []
    resume = 0  # where the last run ended in `cached`
    p = start
    while p + min_length <= len(prompt):
        found = starts.get(tuple(prompt[p : p + anchor]), ())
        # The continuation of the last run first, then the rest in order, a few at most.
        order = sorted(found, key=lambda c: (c < resume, c))[:_CANDIDATES]
        best, best_length = -1, 0
        for c in order:
            length = _run_length(cached, c, prompt, p)
            if length > best_length:
                best, best_length = c, length
        if best_length >= min_length:
            runs.append(ReusedRun(best, p, best_length))
            p += best_length
            resume = best + best_length
        else:
            p += 1
    return runs


def _run_length(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
    """How many tokens a[i:] and b[j:] agree on, compared a slice at a time."""
    n = 0
    limit = min(len(a) - i, len(b) - j)
    while n + _SLICE <= limit and a[i + n : i + n + _SLICE] == b[j + n : j + n + _SLICE]:
        n += _SLICE
    while n < limit and a[i + n] == b[j + n]:
        n += 1
    return n


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class CacheReuse:
    """The recent sequences of one block pool, and the reuse a new prompt plans from them."""

    def __init__(self, kv: KVCacheManager, min_length: int) -> None:
        if not kv.enable_prefix_caching:
            raise ValueError("--cache-reuse needs prefix caching (--enable-prefix-caching)")
        if min_length < 1:
            raise ValueError(f"--cache-reuse takes runs of at least 1 token, got {min_length}")
        self.kv = kv
        self.min_length = min_length
        self._sources: deque[_Source] = deque(maxlen=MAX_SOURCES)
        self._breaks = itertools.count(1)
        self.num_reused_tokens = 0  # tokens copied rather than computed, in all

    @staticmethod
    def applies_to(request: Request) -> bool:
        """Generation from tokens only: prompt logprobs need every position's logits, a
        pooled embedding every position's states, and a prompt given as rows has no tokens
        to match."""
        return (
            request.pooling_params is None
            and request.sampling_params.prompt_logprobs is None
            and request.prompt_embeds is None
        )

    def remember(self, request: Request) -> None:
        """Keep an ending request's full blocks as a source for later prompts."""
        if not self.applies_to(request):
            return
        size = self.kv.block_size
        num_blocks = min(request.num_computed_tokens, request.num_tokens) // size
        if num_blocks == 0:
            return
        names = self.kv.block_names_of(request)[:num_blocks]
        tokens = request.all_token_ids[: num_blocks * size]
        exact_upto = min(request.exact_upto, len(tokens))
        self._sources.append(_Source(tokens, names, self._seed(request), exact_upto))

    def plan(self, request: Request, num_cached: int) -> ReusePlan | None:
        """Runs of `request`'s tokens after its `num_cached` prefix-cached ones that a recent
        sequence's blocks still hold, from the sequence that gives the most (the newest among
        equals), or None. The last token is always left to compute: its step yields the
        logits."""
        if not self.applies_to(request):
            return None
        tokens = request.all_token_ids[: request.num_tokens - 1]
        seed = self._seed(request)
        best: ReusePlan | None = None
        for source in reversed(self._sources):
            if source.seed == seed:
                plan = self._plan_from(source, tokens, num_cached)
                if plan is not None and (best is None or plan.num_tokens > best.num_tokens):
                    best = plan
        return best

    def _plan_from(self, source: _Source, tokens: list[int], num_cached: int) -> ReusePlan | None:
        size = self.kv.block_size
        block_ids = [self.kv.cached_block(name) for name in source.names]
        held = list(source.tokens)
        for index, block_id in enumerate(block_ids):
            if block_id is None:  # evicted since: its tokens match nothing
                held[index * size : (index + 1) * size] = [_GONE] * size
        lcp = common_prefix(held, tokens)
        runs: list[ReusedRun] = []
        approximate_from: int | None = None
        if lcp > num_cached:
            # The rest of the common prefix, past the cached blocks: taken at any length, and
            # exact as far as the source's own K/V was.
            runs.append(ReusedRun(num_cached, num_cached, lcp - num_cached))
            if source.exact_upto < lcp:
                approximate_from = max(num_cached, source.exact_upto)
        if source.index is None:
            source.index = run_index(source.tokens, min(self.min_length, _ANCHOR))
        found = reusable_runs(held, tokens, max(lcp, num_cached), self.min_length, source.index)
        if found:
            first = found[0].target
            approximate_from = first if approximate_from is None else min(approximate_from, first)
        runs += found
        if not runs:
            return None
        source_blocks: dict[int, int] = {}
        for run in runs:
            for index in range(run.source // size, (run.source + run.length - 1) // size + 1):
                block_id = block_ids[index]
                assert block_id is not None, "a run reads only blocks still held"
                source_blocks[index] = block_id
        return ReusePlan(runs, source_blocks, approximate_from)

    def break_chain(self, request: Request, plan: ReusePlan) -> None:
        """Name the request's blocks from its first approximate one on apart (see the module)."""
        if plan.approximate_from is None or plan.approximate_from >= request.exact_upto:
            return  # exact as far as it was (all of it, unless an earlier reuse broke it)
        request.exact_upto = plan.approximate_from
        request.chain_break = break_seed(self.kv.hash_algo, next(self._breaks))
        del request.block_hashes[plan.approximate_from // self.kv.block_size :]

    def _seed(self, request: Request) -> BlockHash | None:
        return chain_seed(self.kv.hash_algo, request.lora_id)
