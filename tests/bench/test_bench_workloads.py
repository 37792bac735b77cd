"""Workloads: exact token lengths from the bundled model's real vocabulary, seeded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from iterserve.bench.copy_texts import PASSAGES
from iterserve.bench.tokenizer import load_tokenizer, ordinary_token_ids
from iterserve.bench.workloads import WorkloadSpec, build_workload, sample_lengths


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()  # the bundled GGUF's vocabulary, read from its header


def test_fixed_lengths_are_exact_and_ids_are_ordinary(tokenizer: Any) -> None:
    w = build_workload(WorkloadSpec(num_requests=10, input_len=37, output_len=9), tokenizer)
    assert [r.prompt_len for r in w.requests] == [37] * 10
    assert [r.output_len for r in w.requests] == [9] * 10
    ordinary = set(ordinary_token_ids(tokenizer))
    assert all(t in ordinary for r in w.requests for t in r.prompt_token_ids)
    assert tokenizer.eos_token_id not in ordinary
    again = build_workload(WorkloadSpec(num_requests=10, input_len=37, output_len=9), tokenizer)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in w.requests]


def test_text_prompts_retokenize_to_the_exact_length(tokenizer: Any) -> None:
    spec = WorkloadSpec(num_requests=8, input_len=50, length_dist="uniform", prompt_format="text")
    w = build_workload(spec, tokenizer)
    for r in w.requests:
        assert isinstance(r.prompt, str)
        assert tokenizer.encode(r.prompt_text, add_special_tokens=False) == r.prompt_token_ids


def test_length_distributions() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    uniform = sample_lengths(rng, 2000, 100, "uniform", range_ratio=0.5)
    assert min(uniform) >= 50 and max(uniform) <= 150
    assert np.mean(uniform) == pytest.approx(100, rel=0.03)
    lognormal = sample_lengths(rng, 4000, 100, "lognormal", sigma=0.5)
    assert np.mean(lognormal) == pytest.approx(100, rel=0.05)  # the mean, not the median
    capped = sample_lengths(rng, 500, 100, "lognormal", sigma=1.0, cap=120)
    assert max(capped) == 120 and min(capped) >= 1
    with pytest.raises(ValueError):
        sample_lengths(rng, 1, 10, "zipf")


def test_shared_prefix_workload(tokenizer: Any) -> None:
    spec = WorkloadSpec(
        "shared-prefix", num_requests=6, input_len=20, prefix_len=64, num_prefixes=2
    )
    w = build_workload(spec, tokenizer)
    assert [r.prompt_len for r in w.requests] == [84] * 6
    prefixes = [tuple(r.prompt_token_ids[:64]) for r in w.requests]
    assert len(set(prefixes)) == 2 and prefixes[0] == prefixes[2] == prefixes[4]
    assert len({tuple(r.prompt_token_ids[64:]) for r in w.requests}) == 6


def test_mixed_chat_docs_puts_documents_in_the_batch_lane(tokenizer: Any) -> None:
    spec = WorkloadSpec(
        "mixed-chat-docs",
        num_requests=20,
        input_len=30,
        output_len=12,
        doc_fraction=0.25,
        doc_len=400,
        doc_output_len=5,
    )
    w = build_workload(spec, tokenizer)
    docs = [r for r in w.requests if r.lane == "batch"]
    chats = [r for r in w.requests if r.lane == "interactive"]
    assert len(docs) == 5 and len(chats) == 15
    assert {(r.prompt_len, r.output_len) for r in docs} == {(400, 5)}
    assert {(r.prompt_len, r.output_len) for r in chats} == {(30, 12)}
    assert w.summary()["lanes"] == ["batch", "interactive"]


def test_azure_conv_workload_carries_trace_times(tokenizer: Any, tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n0,300,20\n2,40,500\n3,77,3\n"
    )
    spec = WorkloadSpec(
        "azure-conv", num_requests=2, trace=str(trace), time_scale=0.5, max_output_len=64
    )
    w = build_workload(spec, tokenizer)
    assert w.has_arrival_times
    assert [(r.arrival, r.prompt_len, r.output_len) for r in w.requests] == [
        (0.0, 300, 20),
        (1.0, 40, 64),
    ]


def test_azure_lengths_draws_trace_lengths_for_any_number_of_requests(
    tokenizer: Any, tmp_path: Path
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "arrived_at,num_prefill_tokens,num_decode_tokens\n0,300,20\n2,40,500\n3,77,3\n"
    )
    spec = WorkloadSpec("azure-lengths", num_requests=50, trace=str(trace), max_output_len=64)
    w = build_workload(spec, tokenizer)
    assert len(w.requests) == 50 and not w.has_arrival_times  # arrivals come from --arrival
    pairs = {(r.prompt_len, r.output_len) for r in w.requests}
    assert pairs == {(300, 20), (40, 64), (77, 3)}
    ordinary = set(ordinary_token_ids(tokenizer))
    for r in w.requests:
        assert len(r.token_ids()) == r.prompt_len and set(r.token_ids()) <= ordinary
        assert r.prompt == r.token_ids()  # what a client sends: a plain list
    assert len({tuple(r.token_ids()[:16]) for r in w.requests}) == 50  # no shared first block
    again = build_workload(spec, tokenizer)
    assert [r.token_ids() for r in again.requests] == [r.token_ids() for r in w.requests]
    with pytest.raises(ValueError, match="token ids"):
        build_workload(
            WorkloadSpec("azure-lengths", trace=str(trace), prompt_format="text"), tokenizer
        )


def test_copy_edit_is_chat_text_whose_answer_is_in_the_prompt(tokenizer: Any) -> None:
    spec = WorkloadSpec(name="copy-edit", num_requests=6, output_len=40, prompt_format="text")
    workload = build_workload(spec, tokenizer)
    again = build_workload(spec, tokenizer)
    assert [r.prompt_token_ids for r in workload.requests] == [
        r.prompt_token_ids for r in again.requests
    ]
    for request in workload.requests:
        assert request.output_len == 40
        assert request.prompt_text is not None and "<|im_start|>assistant" in request.prompt_text
        assert any(passage in request.prompt_text for passage in PASSAGES)
        assert tokenizer.encode(request.prompt_text, add_special_tokens=False) == (
            request.prompt_token_ids
        )
