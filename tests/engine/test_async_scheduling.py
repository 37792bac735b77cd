"""Asynchronous scheduling (engine/engine_core.py, engine/step_pipeline.py): a step planned
while the one before it computes gives every request exactly the tokens the one-by-one loop
gives, through chunked prefill, preemption, prefix hits, stops, aborts and failed steps,
with the block pool consistent after every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fake_executor import make_request, make_scheduler, next_token
from iterserve import LLM, SamplingParams
from iterserve.core.outputs import ModelOutput, SampledToken, SchedulerOutput
from iterserve.core.request import RequestStatus
from iterserve.core.scheduler import Scheduler
from iterserve.engine.engine_core import EngineCore, StepFailedError
from iterserve.sampling_params import SamplingParams as Params
from transformers_reference import PROMPTS


class PagedFakeExecutor:
    """The fake model (fake_executor.next_token) over a real block table: each step writes
    its tokens into the slots of the blocks it was given and reads every position back
    from them, so a block read before it was written, or overwritten while still in use,
    changes the tokens or fails."""

    def __init__(self, block_size: int = 4) -> None:
        self.block_size = block_size
        self.slots: dict[int, list[int | None]] = {}

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        sampled = {}
        size = self.block_size
        for seq in out.seqs:
            assert not seq.draft_token_ids
            for offset, token_id in enumerate(seq.token_ids):
                position = seq.num_computed_tokens + offset
                block = self.slots.setdefault(seq.block_ids[position // size], [None] * size)
                block[position % size] = token_id
            if seq.sample:
                end = seq.num_computed_tokens + seq.num_new_tokens
                history = [self.slots[seq.block_ids[p // size]][p % size] for p in range(end)]
                assert None not in history and -1 not in history, "a slot read before written"
                sampled[seq.request_id] = [SampledToken(next_token(history))]  # type: ignore[arg-type]
        return ModelOutput(sampled)


def _requests(seed: int, n: int, stop_token: int | None) -> list[tuple[str, list[int], Params]]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(3, 40))]
        stops = [stop_token] if stop_token is not None and i % 2 else []
        params = Params(max_tokens=rng.randint(1, 14), ignore_eos=True, stop_token_ids=stops)
        requests.append((f"r{i}", prompt, params))
    return requests


def _run(
    core: EngineCore,
    requests: list[tuple[str, list[int], Params]],
    abort_after: dict[str, int] | None = None,
) -> dict[str, tuple[list[int], str | None]]:
    """Every request's tokens and finish reason; `abort_after`: abort a request once it has
    that many tokens (the same point of its output in either loop)."""
    scheduler = core.scheduler
    for rid, prompt, params in requests:
        scheduler.add_request(_request(rid, prompt, params))
    results: dict[str, tuple[list[int], str | None]] = {rid: ([], None) for rid, _, _ in requests}
    for _ in range(5_000):
        if not scheduler.has_unfinished():
            break
        for update in core.step(no_more_arrivals=True).updates:
            tokens, _ = results[update.request_id]
            tokens.extend(update.new_token_ids)
            results[update.request_id] = (tokens, update.finish_reason)
            limit = (abort_after or {}).get(update.request_id)
            if limit is not None and len(tokens) >= limit and update.finish_reason is None:
                scheduler.finish_request(update.request_id, RequestStatus.FINISHED_ABORTED)
                results[update.request_id] = (tokens, "abort")
        scheduler.check_invariants()
    else:
        raise AssertionError("the engine did not finish")
    core.drain()
    scheduler.check_invariants()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    return results


def _request(rid: str, prompt: list[int], params: Params):  # noqa: ANN202
    request = make_request(rid, prompt)
    request.sampling_params = params
    return request


def _core(
    async_scheduling: bool, executor: PagedFakeExecutor | None = None, **config: object
) -> EngineCore:
    scheduler, _ = make_scheduler(**config)
    return EngineCore(scheduler, executor or PagedFakeExecutor(), async_scheduling)


@pytest.mark.parametrize(
    "config",
    [
        {"max_num_batched_tokens": 512},
        {"max_num_batched_tokens": 7},  # every prompt chunked, decodes mixed in
        {"num_blocks": 24, "max_num_batched_tokens": 32},  # preemption
        {"num_blocks": 40, "prefix_caching": False, "enable_chunked_prefill": False},
        {"step_policy": "prefill-first", "max_num_batched_tokens": 64},
        {"batching": "static", "batch_size": 3},
        {"batching": "dynamic", "batch_size": 4},
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_ahead_gives_the_same_tokens_as_in_order(config: dict[str, object], seed: int) -> None:
    requests = _requests(seed, 10, stop_token=None)
    in_order = _run(_core(False, **config), requests)
    # A token the fake model often samples ends half the requests (a stop token is seen
    # only once the step after it has been planned).
    stop = max(
        {t for tokens, _ in in_order.values() for t in tokens},
        key=lambda t: sum(tokens.count(t) for tokens, _ in in_order.values()),
    )
    requests = _requests(seed, 10, stop_token=stop)
    assert _run(_core(True, **config), requests) == _run(_core(False, **config), requests)


def test_a_request_ended_while_its_next_step_runs_is_discarded_and_counted() -> None:
    requests = _requests(3, 8, stop_token=None)
    aborts = {"r1": 2, "r4": 5}
    ahead, in_order = _core(True), _core(False)
    assert _run(ahead, requests, aborts) == _run(in_order, requests, aborts)
    assert ahead.scheduler.num_discarded_tokens > 0
    assert in_order.scheduler.num_discarded_tokens == 0


def test_max_tokens_costs_no_discarded_step() -> None:
    ahead = _core(True)
    _run(ahead, _requests(4, 8, stop_token=None))
    assert ahead.scheduler.num_discarded_tokens == 0


class _FailingExecutor(PagedFakeExecutor):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.calls = 0
        self.fail_at = fail_at

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("boom")
        return super().execute(out)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_ends_its_requests_and_the_rest_go_on(async_scheduling: bool) -> None:
    requests = _requests(5, 6, stop_token=None)
    expected = _run(_core(False), requests)
    core = _core(async_scheduling, _FailingExecutor(fail_at=6))
    scheduler: Scheduler = core.scheduler
    for rid, prompt, params in requests:
        scheduler.add_request(_request(rid, prompt, params))
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    failed: list[str] = []
    while scheduler.has_unfinished():
        try:
            step = core.step(no_more_arrivals=True)
        except StepFailedError as error:
            failed = error.request_ids
            for rid in failed:
                scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            continue
        for update in step.updates:
            outputs[update.request_id] += update.new_token_ids
        scheduler.check_invariants()
    assert failed
    for rid, _, _ in requests:
        if rid not in failed:
            assert outputs[rid] == expected[rid][0]
    # Nothing the failed step was to write is named in the prefix cache: a request with a
    # failed one's prompt reads its cached blocks (all written) and gets the same tokens.
    rid, prompt, params = next(r for r in requests if r[0] == failed[0])
    scheduler.add_request(_request("again", prompt, params))
    again: list[int] = []
    while scheduler.has_unfinished():
        again += [t for u in core.step(True).updates for t in u.new_token_ids]
    assert again == expected[rid][0]


# ---- the real engine ----------------------------------------------------------------------


def _generate(
    model: Path, async_scheduling: bool, params: list[SamplingParams], **settings: object
):  # noqa: ANN202
    with LLM(
        str(model), dtype="float32", compile=False, async_scheduling=async_scheduling, **settings
    ) as llm:
        assert llm.engine.core.async_scheduling == (
            async_scheduling and "speculative_method" not in settings
        )
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        discarded = llm.engine.scheduler.num_discarded_tokens
        assert llm.engine.scheduler.kv_cache_stats().num_used_blocks == 0
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs], discarded


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 7, "max_num_seqs": 7},  # chunked prefill
        {"num_kv_blocks": 20, "block_size": 4},  # preemption
        {"speculative_method": "ngram"},  # speculation runs in order: same tokens either way
    ],
)
def test_engine_greedy_and_seeded_text_is_the_same_ahead(
    tiny_llama_dir: Path, settings: dict[str, object]
) -> None:
    full, _ = _generate(
        tiny_llama_dir, False, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4
    )
    stop_text = full[0][1][len(full[0][1]) // 2 :][:3]
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop=[stop_text]),
        SamplingParams(temperature=0.8, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[full[2][0][2]]),
        SamplingParams(
            temperature=1.0, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True, presence_penalty=0.5
        ),
    ]
    in_order, none_discarded = _generate(tiny_llama_dir, False, params, **settings)
    ahead, discarded = _generate(tiny_llama_dir, True, params, **settings)
    assert ahead == in_order
    assert in_order[0][2] == "stop" and in_order[2][2] == "stop"
    assert none_discarded == 0
    if "speculative_method" not in settings:
        assert discarded >= 2  # the stop string's and the stop token's requests, one step each


# ---- the simulator -------------------------------------------------------------------------


def test_the_simulator_hides_the_step_overhead_only_beside_a_gpu() -> None:
    from iterserve.config import EngineConfig, resolve_async_scheduling
    from iterserve.core.outputs import ScheduledSeq
    from iterserve.sim.executor import HARDWARE, MODELS, RooflineCostModel

    seqs = [ScheduledSeq(str(i), [0], 100, (), True, Params()) for i in range(8)]
    step = SchedulerOutput(seqs, num_decode_tokens=8)
    for name, hides in [("a100-80g", True), ("cpu-2core", False)]:
        hardware = HARDWARE[name]
        model = MODELS["llama3-8b"] if hides else MODELS["smollm2-135m"]
        in_order = RooflineCostModel(hardware, model).step_time(step)
        ahead = RooflineCostModel(hardware, model, async_scheduling=True).step_time(step)
        device = in_order - hardware.step_overhead
        assert ahead == pytest.approx(max(hardware.step_overhead, device) if hides else in_order)
        # And the engine's own default on that device is what the simulator takes.
        assert resolve_async_scheduling(EngineConfig(), hardware.device_type)[0] == hides


# ---- served -------------------------------------------------------------------------------


@pytest.mark.slow
def test_served_streams_are_the_same_ahead(tiny_llama_dir: Path) -> None:
    """Concurrent streams through `iterserve serve --async-scheduling` (the official client)
    get the in-order engine's greedy text; a stop string costs a discarded step, counted on
    /metrics; a client that goes away mid-stream frees its blocks."""
    import concurrent.futures

    import openai

    from server_fixtures import MODEL_NAME, running_server, wait_until

    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(tiny_llama_dir), dtype="float32", compile=False) as llm:
        expected = [o.text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    stop = expected[1][3:6]
    with running_server(tiny_llama_dir, async_scheduling=True) as server:
        assert server.engine.core.async_scheduling
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")

        def stream(prompt: str, stops: list[str] | None = None) -> str:
            chunks = client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                stop=stops, extra_body={"ignore_eos": True},
            )  # fmt: skip
            return "".join(chunk.choices[0].text for chunk in chunks)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(stream, PROMPTS))
            stopped = pool.submit(stream, PROMPTS[1], [stop]).result()
        assert texts == expected
        assert stopped == expected[1][: expected[1].index(stop)]
        assert server.metrics()["iterserve:discarded_tokens_total"] >= 1

        chunks = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=200, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(chunks))
        chunks.close()  # the client goes away mid-stream
        assert wait_until(lambda: server.metrics()["iterserve:kv_cache_used_blocks"] == 0)
