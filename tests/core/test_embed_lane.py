"""Embedding requests in the scheduler: prefill only, in the embed lane, with a bounded share
of each step beside generation (fake executor, no torch)."""

from __future__ import annotations

import math
import random

import pytest

from fake_executor import FakeExecutor, expected_output, make_request, make_scheduler, run
from iterserve.core.request import Request
from iterserve.pooling_params import PoolingParams
from iterserve.sampling_params import InvalidRequestError

BUDGET = 64
SHARE = 0.125
EMBED_CAP = math.ceil(SHARE * BUDGET)


def embedding(rid: str, prompt: list[int], pooling: str = "mean", arrival: float = 0.0) -> Request:
    return make_request(
        rid, prompt, arrival=arrival, lane="embed", pooling_params=PoolingParams(pooling)
    )  # type: ignore[arg-type]


def _embed_tokens(plan, ids: set[str]) -> int:  # type: ignore[no-untyped-def]
    return sum(s.num_new_tokens for s in plan.seqs if s.request_id in ids)


def test_an_embedding_burst_leaves_every_decode_scheduled_every_step() -> None:
    scheduler, clock = make_scheduler(max_num_batched_tokens=BUDGET, embed_lane_share=SHARE)
    rng = random.Random(0)
    chats = {f"chat{i}": [rng.randrange(1, 50) for _ in range(5)] for i in range(4)}
    for rid, prompt in chats.items():
        scheduler.add_request(make_request(rid, prompt, max_tokens=40))
    executor = FakeExecutor()
    chat_tokens: dict[str, list[int]] = {rid: [] for rid in chats}
    first = scheduler.schedule()  # the chats' prompts, then they decode
    for update in scheduler.update(first, executor.execute(first)):
        chat_tokens[update.request_id] += update.new_token_ids
    burst = {
        f"emb{i}": [rng.randrange(1, 50) for _ in range(rng.randint(3, 30))] for i in range(60)
    }
    for rid, prompt in burst.items():
        scheduler.add_request(embedding(rid, prompt))
    vectors: dict[str, list[float]] = {}
    steps_with_embeddings = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        live_chats = [rid for rid in chats if rid in scheduler.requests]
        if live_chats:
            assert {s.request_id for s in plan.seqs} >= set(live_chats), "a decode was skipped"
            assert _embed_tokens(plan, set(burst)) <= EMBED_CAP
        steps_with_embeddings += _embed_tokens(plan, set(burst)) > 0
        for update in scheduler.update(plan, executor.execute(plan)):
            if update.embedding is not None:
                assert update.finish_reason == "stop" and not update.new_token_ids
                vectors[update.request_id] = update.embedding
            else:
                chat_tokens[update.request_id] += update.new_token_ids
        scheduler.check_invariants()
        clock.now += 0.01
    # Each embedding computed every one of its tokens, once, in order (the fake's "pool").
    assert vectors == {rid: [float(sum(p)), float(len(p))] for rid, p in burst.items()}
    assert chat_tokens == {rid: expected_output(p, 40) for rid, p in chats.items()}
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert steps_with_embeddings > 0


def test_embeddings_alone_take_the_whole_budget() -> None:
    scheduler, clock = make_scheduler(max_num_batched_tokens=BUDGET, embed_lane_share=SHARE)
    for i in range(20):
        scheduler.add_request(embedding(f"e{i}", [i + 1] * 20, "last"))
    _, plans = run(scheduler, clock)
    assert plans[0].num_batched_tokens == BUDGET
    assert len(plans) == math.ceil(20 * 20 / BUDGET)


def test_prompts_leave_waiting_embeddings_their_share() -> None:
    scheduler, clock = make_scheduler(max_num_batched_tokens=BUDGET, embed_lane_share=SHARE)
    for i in range(6):
        scheduler.add_request(make_request(f"doc{i}", [i + 1] * 200, max_tokens=2))
    scheduler.add_request(embedding("e", list(range(1, 41))))
    _, plans = run(scheduler, clock)
    steps = [p for p in plans if _embed_tokens(p, {"e"})]
    assert [_embed_tokens(p, {"e"}) for p in steps] == [EMBED_CAP] * 5
    assert steps[0] is plans[0]  # not behind 1200 prompt tokens


@pytest.mark.parametrize(("pooling", "reuses"), [("last", True), ("mean", False), ("cls", False)])
def test_only_a_last_token_pool_takes_a_cached_prefix(pooling: str, reuses: bool) -> None:
    scheduler, clock = make_scheduler(max_num_batched_tokens=BUDGET)
    prompt = list(range(1, 30))
    scheduler.add_request(embedding("first", prompt, pooling))
    run(scheduler, clock)
    second = embedding("second", prompt, pooling)
    scheduler.add_request(second)
    run(scheduler, clock)
    assert (second.num_cached_tokens > 0) is reuses


def test_the_embed_lane_is_for_embeddings_alone_and_a_prompt_may_fill_the_context() -> None:
    scheduler, _ = make_scheduler(max_num_batched_tokens=BUDGET, max_model_len=32)
    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_request(make_request("chat", [1, 2], lane="embed"))
    assert error.value.param == "lane"
    with pytest.raises(InvalidRequestError):
        scheduler.add_request(
            make_request("e", [1, 2], pooling_params=PoolingParams("mean"))  # type: ignore[arg-type]
        )
    scheduler.add_request(embedding("full", list(range(1, 33))))  # no token to sample after it
    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_request(embedding("over", list(range(1, 34))))
    assert error.value.param == "prompt"
