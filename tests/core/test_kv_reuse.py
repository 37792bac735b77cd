"""--cache-reuse's scheduling (core/kv_reuse.py), without torch: a stand-in executor keeps
what every slot of the pool holds (a token at a position), moves rows as the plan's copies
say, and checks that each step's tokens see exactly their sequence, token by token and
position by position, whatever was copied and whatever was computed."""

from __future__ import annotations

import random

import pytest

from fake_executor import Clock, expected_output, make_request, next_token
from iterserve.config import SchedulerConfig
from iterserve.core.kv_cache import KVCacheManager
from iterserve.core.kv_reuse import CacheReuse, ReusedRun, reusable_runs
from iterserve.core.outputs import ModelOutput, SampledToken, SchedulerOutput
from iterserve.core.scheduler import Scheduler

BLOCK = 4


class SlotExecutor:
    """What each slot holds: (token, position), as a real pool's K (rotated by position)
    and V (of the token) would. A copy moves a row and adds its shift to the position."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, int]] = {}
        self.copied = 0

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        for seq in out.seqs:  # every copy before any forward, as TorchRunner runs them
            for copy in seq.kv_copies:
                rows = [self.slots[s] for s in copy.src_slots]
                for dst, (token, position) in zip(copy.dst_slots, rows, strict=True):
                    self.slots[dst] = (token, position + copy.shift)
                self.copied += len(rows)
        sampled = {}
        for seq in out.seqs:
            start = seq.num_computed_tokens
            for i, token in enumerate(seq.token_ids):
                self.slots[_slot(seq.block_ids, start + i)] = (token, start + i)
            end = start + len(seq.token_ids)
            seen = [self.slots[_slot(seq.block_ids, p)] for p in range(end)]
            positions = [position for _, position in seen]
            assert positions == list(range(end)), f"{seq.request_id} reads rows out of place"
            if seq.sample:
                sampled[seq.request_id] = [SampledToken(next_token([t for t, _ in seen]))]
        return ModelOutput(sampled)


def _slot(block_ids: tuple[int, ...], position: int) -> int:
    return block_ids[position // BLOCK] * BLOCK + position % BLOCK


def make(num_blocks: int = 256, min_run: int = 4, **config: object) -> tuple[Scheduler, Clock]:
    clock = Clock()
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", 4)
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(**config), kv, 4096, clock, cache_reuse=min_run)  # type: ignore[arg-type]
    return scheduler, clock


def serve(
    scheduler: Scheduler, executor: SlotExecutor, rid: str, prompt: list[int], max_tokens: int = 6
) -> tuple[list[int], list[SchedulerOutput]]:
    """Run one request to its end; its output and the steps' plans."""
    scheduler.add_request(make_request(rid, prompt, max_tokens=max_tokens))
    output: list[int] = []
    plans: list[SchedulerOutput] = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        plans.append(out)
        for update in scheduler.update(out, executor.execute(out)):
            output += update.new_token_ids
        scheduler.check_invariants()
    return output, plans


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 10_000) for _ in range(n)]


def test_runs_are_found_as_llama_server_walks() -> None:
    cached = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    # Lines left the head: the rest comes back 3 tokens earlier, in one run.
    assert reusable_runs(cached, [4, 5, 6, 7, 8, 9, 10, 11], 0, 3) == [ReusedRun(3, 0, 7)]
    # Two runs around an edit; a run shorter than the minimum is computed.
    assert reusable_runs(cached, [1, 2, 3, 4, 99, 7, 8, 9, 10], 0, 3) == [
        ReusedRun(0, 0, 4),
        ReusedRun(6, 5, 4),
    ]
    assert reusable_runs(cached, [1, 2, 99, 5, 6, 7], 0, 3) == [ReusedRun(4, 3, 3)]
    # Text inserted before a run moves it later (llama-server's walk stops at the insertion).
    assert reusable_runs(cached, [50, 51, 1, 2, 3, 4, 5], 0, 3) == [ReusedRun(0, 2, 5)]
    # The longest run wins; on a tie, the one that goes on from the last run.
    assert reusable_runs([1, 2, 3, 9, 1, 2, 3, 4], [1, 2, 3, 4], 0, 3) == [ReusedRun(4, 0, 4)]
    assert reusable_runs([5, 6, 7, 1, 2, 3, 8, 1, 2, 3], [5, 6, 7, 0, 1, 2, 3], 0, 3) == [
        ReusedRun(0, 0, 3),
        ReusedRun(3, 4, 3),
    ]
    # Positions no block holds any more match nothing.
    assert reusable_runs([1, 2, -1, 4, 5, 6], [1, 2, 3, 4, 5, 6], 0, 2) == [
        ReusedRun(0, 0, 2),
        ReusedRun(3, 3, 3),
    ]
    # Runs longer than the lookup's anchor and its slices.
    long = list(range(100, 200))
    assert reusable_runs([1] + long, [2, 3] + long, 0, 40) == [ReusedRun(1, 2, 100)]
    assert reusable_runs(cached, [1, 2, 3, 4], 2, 2) == [ReusedRun(2, 2, 2)]


def test_a_prompt_whose_head_moved_copies_its_rest_and_reads_it_in_place() -> None:
    scheduler, _ = make()
    executor = SlotExecutor()
    head, body = tokens(10, 1), tokens(30, 2)
    first = head + body
    assert serve(scheduler, executor, "first", first)[0] == expected_output(first, 6)
    moved = head[3:] + body + tokens(5, 3)
    output, plans = serve(scheduler, executor, "moved", moved)
    assert output == expected_output(moved, 6)
    (copy,) = plans[0].seqs[0].kv_copies
    assert (copy.shift, copy.target, len(copy.src_slots)) == (-3, 0, 37)
    assert executor.copied == 37
    # The copied run is passed over: the first step computes the 5 new tokens only.
    assert plans[0].seqs[0].num_computed_tokens == 37
    assert plans[0].seqs[0].num_new_tokens == 5
    assert scheduler.reuse is not None and scheduler.reuse.num_reused_tokens == 37


def test_runs_between_edits_are_copied_and_the_gaps_computed_in_order() -> None:
    scheduler, _ = make(max_num_batched_tokens=6)
    executor = SlotExecutor()
    a, b, c = tokens(12, 4), tokens(16, 5), tokens(12, 6)
    serve(scheduler, executor, "first", a + [1, 2] + b + [3] + c)
    edited = a[2:] + [7, 8, 9] + b + [10] + c + [11]
    output, plans = serve(scheduler, executor, "edited", edited)
    assert output == expected_output(edited, 6)
    copies = plans[0].seqs[0].kv_copies
    assert [(c.target, len(c.src_slots), c.shift) for c in copies] == [
        (0, 10, -2),
        (13, 16, -1),
        (30, 12, -1),
    ]
    computed = [(s.num_computed_tokens, s.num_new_tokens) for p in plans for s in p.seqs]
    # The gaps, each in its own step (chunks stop where a copied run starts), then decodes.
    assert computed[:3] == [(10, 3), (29, 1), (42, 1)]
    assert scheduler.requests == {} and scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_copied_blocks_are_named_apart_from_exact_prompts() -> None:
    scheduler, _ = make()
    executor = SlotExecutor()
    head, body = tokens(8, 7), tokens(24, 8)
    serve(scheduler, executor, "first", head + body)
    moved = head[4:] + body + [5]
    serve(scheduler, executor, "moved", moved)
    # Its blocks hold copied (approximate) K/V: an exact lookup of its prompt finds none,
    # while the first prompt's own blocks are still found.
    assert scheduler.kv.find_cached_prefix(make_request("x", moved + [6])) == []
    assert len(scheduler.kv.find_cached_prefix(make_request("y", head + body + [6]))) == 8
    # A reuse finds them (the common prefix with the last sequence, copied as it is).
    output, plans = serve(scheduler, executor, "again", moved + [6])
    assert output == expected_output(moved + [6], 6)
    assert sum(len(c.src_slots) for c in plans[0].seqs[0].kv_copies) == len(moved)


def test_an_exact_common_prefix_past_the_cached_blocks_keeps_exact_names() -> None:
    scheduler, _ = make()
    executor = SlotExecutor()
    prompt = tokens(32, 9)
    serve(scheduler, executor, "first", prompt + [1], max_tokens=1)
    # The same first 30 tokens: 7 blocks from the prefix cache, 2 more tokens copied from
    # the 8th block (the same tokens at the same places: exact).
    longer = prompt[:30] + tokens(10, 10)
    output, plans = serve(scheduler, executor, "longer", longer)
    assert output == expected_output(longer, 6)
    (copy,) = plans[0].seqs[0].kv_copies
    assert (copy.target, copy.shift, len(copy.src_slots)) == (28, 0, 2)
    request = make_request("z", longer + [1])
    assert len(scheduler.kv.find_cached_prefix(request)) == len(longer) // BLOCK


def test_evicted_sources_are_not_read() -> None:
    scheduler, _ = make(num_blocks=14)
    executor = SlotExecutor()
    head, body = tokens(4, 11), tokens(36, 12)
    serve(scheduler, executor, "first", head + body)
    serve(scheduler, executor, "other", tokens(40, 13))  # takes most of the pool
    moved = head[2:] + body + [1]
    output, plans = serve(scheduler, executor, "moved", moved)
    assert output == expected_output(moved, 6)
    copied = sum(len(c.src_slots) for c in plans[0].seqs[0].kv_copies)
    assert 0 < copied < len(head) - 2 + len(body)


def test_a_step_that_never_ran_leaves_its_copies_unmade() -> None:
    scheduler, _ = make()
    executor = SlotExecutor()
    head, body = tokens(8, 14), tokens(24, 15)
    serve(scheduler, executor, "first", head + body)
    moved = head[1:] + body + [1, 2]
    scheduler.add_request(make_request("moved", moved, max_tokens=6))
    out = scheduler.schedule()
    assert out.seqs[0].kv_copies
    scheduler.unplan(out)  # the step failed before it ran
    request = scheduler.requests["moved"]
    assert request.num_computed_tokens == 0 and not request.reused_spans
    output: list[int] = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        assert not any(s.kv_copies for s in out.seqs)
        for update in scheduler.update(out, executor.execute(out)):
            output += update.new_token_ids
    assert output == expected_output(moved, 6)


def test_random_edits_always_read_their_own_sequence() -> None:
    rng = random.Random(16)
    scheduler, _ = make(num_blocks=40, max_num_batched_tokens=8)
    executor = SlotExecutor()
    text = tokens(60, 17)
    for i in range(25):
        at = rng.randrange(len(text))
        match rng.randrange(3):
            case 0:
                del text[at : at + rng.randint(1, 6)]
            case 1:
                text[at:at] = tokens(rng.randint(1, 6), 100 + i)
            case _:
                text = text[rng.randint(1, 5) :] + tokens(rng.randint(1, 5), 200 + i)
        prompt = list(text)
        assert serve(scheduler, executor, f"r{i}", prompt, 3)[0] == expected_output(prompt, 3)
    assert executor.copied > 0


def test_prompt_logprobs_and_embeddings_do_not_reuse() -> None:
    """Prompt logprobs need every position's logits, an embedding every position's states."""
    from iterserve.pooling_params import PoolingParams
    from iterserve.sampling_params import SamplingParams

    scheduler, _ = make()
    executor = SlotExecutor()
    head, body = tokens(8, 18), tokens(24, 19)
    serve(scheduler, executor, "first", head + body)
    assert scheduler.reuse is not None
    moved = head[2:] + body + [1]
    assert scheduler.reuse.plan(make_request("plain", moved), 0) is not None
    scored = make_request("scored", moved)
    scored.sampling_params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    embedded = make_request("embedded", moved, pooling_params=PoolingParams())
    for request in (scored, embedded):
        assert not CacheReuse.applies_to(request)
        assert scheduler.reuse.plan(request, 0) is None


@pytest.mark.parametrize("min_run", [0, -1])
def test_the_shortest_run_is_positive(min_run: int) -> None:
    with pytest.raises(ValueError, match="at least 1 token"):
        CacheReuse(KVCacheManager(8, BLOCK), min_run)


def test_edits_served_together_under_a_tight_pool() -> None:
    """Several edits of one text at once, in a pool too small for them all: preempted
    requests (some of them mid-way through their copied runs) come back and still read only
    their own sequence."""
    rng = random.Random(20)
    scheduler, _ = make(num_blocks=44, max_num_batched_tokens=16)
    executor = SlotExecutor()
    text = tokens(56, 21)
    serve(scheduler, executor, "seed", text)
    outputs: dict[str, list[int]] = {}
    prompts: dict[str, list[int]] = {}
    for round_ in range(6):
        for i in range(4):
            edited = list(text)
            at = rng.randrange(len(edited))
            edited[at : at + rng.randint(0, 4)] = tokens(rng.randint(1, 4), 300 + 10 * round_ + i)
            rid = f"r{round_}-{i}"
            prompts[rid] = edited[rng.randint(0, 6) :]
            scheduler.add_request(make_request(rid, prompts[rid], max_tokens=12))
        while scheduler.has_unfinished():
            out = scheduler.schedule()
            for update in scheduler.update(out, executor.execute(out)):
                outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            scheduler.check_invariants()
    assert scheduler.num_preemptions > 0 and executor.copied > 0
    for rid, prompt in prompts.items():
        assert outputs[rid] == expected_output(prompt, 12), rid
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
