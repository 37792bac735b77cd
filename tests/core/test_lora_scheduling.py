"""LoRA adapters in the scheduler: at most --max-loras adapters in any step, no request
starved for a slot, and the prefix cache never sharing blocks between adapters."""

from __future__ import annotations

from fake_executor import expected_output, make_request, make_scheduler, run
from iterserve.core.lora import LoRASlots
from iterserve.core.outputs import SchedulerOutput


def test_more_adapters_than_slots_never_starve() -> None:
    scheduler, clock = make_scheduler(max_num_batched_tokens=64, max_num_seqs=16)
    scheduler.lora_slots = LoRASlots(2)
    prompts = {}
    # Six adapters and the base, arriving in turns; adapter 1 keeps getting new requests, so
    # a scheduler that admitted whatever was resident would run it and 2 for ever.
    for i in range(30):
        lora = [1, 2, 3, 1, 4, 0, 5, 1, 6, 2][i % 10]
        prompts[f"r{i}"] = [i + 1] * (5 + i % 7)
        scheduler.add_request(make_request(f"r{i}", prompts[f"r{i}"], 12, arrival=i, lora_id=lora))
    first_step: dict[str, int] = {}

    def check(out: SchedulerOutput) -> None:
        loras = {seq.lora_id for seq in out.seqs if seq.lora_id}
        assert len(loras) <= 2, f"{len(loras)} adapters in one step"
        for seq in out.seqs:
            assert (seq.lora_slot >= 0) == bool(seq.lora_id)
            first_step.setdefault(seq.request_id, len(plans))

    plans: list[SchedulerOutput] = []
    outputs, plans = run(scheduler, clock, on_step=lambda out: (plans.append(out), check(out)))
    assert outputs == {rid: expected_output(p, 12) for rid, p in prompts.items()}
    # FCFS: requests start in arrival order, whatever their adapter.
    order = sorted(first_step, key=lambda rid: (first_step[rid], int(rid[1:])))
    assert order == sorted(first_step, key=lambda rid: int(rid[1:]))


def test_an_adapter_in_use_keeps_its_slot() -> None:
    slots = LoRASlots(2)
    assert slots.acquire(7, busy=[]) == 0 and slots.acquire(8, busy=[]) == 1
    assert slots.acquire(9, busy=[7, 8]) is None  # both in use: wait
    assert slots.acquire(9, busy=[8]) == 0  # 7 idle: evicted, least recently used
    assert slots.slot_of(7) == -1 and slots.resident == [8, 9]


def test_the_same_prompt_under_two_adapters_shares_no_blocks() -> None:
    scheduler, clock = make_scheduler()
    prompt = list(range(1, 33))
    for rid, lora in (("base", 0), ("a", 1), ("b", 2), ("a-again", 1)):
        scheduler.add_request(make_request(rid, prompt, 4, lora_id=lora))
        run(scheduler, clock)
    stats = scheduler.kv_cache_stats()
    # Only the second request of adapter 1 found its prompt's blocks (7 of its 8 full ones:
    # the last token is always computed).
    assert stats.prefix_hits == 28
