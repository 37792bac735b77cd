"""The whole model path against transformers on the same weights (tiny random
checkpoints, fp32): greedy text must be identical whatever the batching does."""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve import LLM, SamplingParams
from iterserve.config import ConfigError
from iterserve.sampling_params import InvalidRequestError
from transformers_reference import PROMPTS, reference

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_dir: Path) -> list[list[int]]:
    return reference(tiny_llama_dir, PROMPTS, MAX_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    "settings",
    [
        {"compile": True},  # the default path, compiled graph included
        {"max_num_batched_tokens": 7, "max_num_seqs": 7},  # every prompt chunked, decodes mixed in
        {"num_kv_blocks": 20, "block_size": 4},  # preemption: prompts fit, outputs do not
        {"enable_prefix_caching": False, "enable_chunked_prefill": False},
        {"step_policy": "prefill-first", "max_num_seqs": 2},
        {"batching": "static", "batch_size": 3},
        {"batching": "dynamic", "batch_size": 3},
    ],
    ids=["default", "chunked", "preemption", "plain", "prefill-first", "static", "dynamic"],
)
def test_greedy_matches_transformers(
    tiny_llama_dir: Path, llama_reference: list[list[int]], settings: dict
) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", **{"compile": False, **settings})
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == llama_reference
    assert [o.finish_reason for o in outputs] == ["length"] * len(PROMPTS)
    assert llm.engine.scheduler.kv_cache_stats().num_used_blocks == 0, "every block back"
    if "num_kv_blocks" in settings:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_keep_the_text(tiny_llama_dir: Path) -> None:
    system = "You are a helpful assistant who answers briefly and precisely. " * 3
    prompts = [system + "What is two plus two?", system + "Name a colour."]
    expected = reference(tiny_llama_dir, prompts, 8)
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert [first[0].token_ids] == expected[:1]
    assert [o.token_ids for o in second] == expected
    assert second[0].num_cached_tokens > 0 and second[1].num_cached_tokens > 0
    assert llm.engine.scheduler.kv_cache_stats().prefix_hits > 0


def test_int8_kv_cache_through_chunking_preemption_and_prefix_hits(tiny_llama_dir: Path) -> None:
    """The 8-bit pool changes the numbers a little (so no transformers comparison here), but
    never with the schedule: chunked prompts, preempted and recomputed sequences and prefix
    hits read and write the same rows as one plain pass."""
    plain = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        compile=False,
        kv_cache_dtype="int8",
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
    )
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    stressed = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        compile=False,
        kv_cache_dtype="int8",
        max_num_batched_tokens=7,
        max_num_seqs=7,
        num_kv_blocks=20,
        block_size=4,
    )
    for _ in range(2):  # the second pass starts from prefix-cache hits
        outputs = stressed.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected
    assert stressed.engine.scheduler.num_preemptions > 0
    assert stressed.engine.scheduler.kv_cache_stats().prefix_hits > 0
    assert stressed.engine.scheduler.kv_cache_stats().num_used_blocks == 0


def test_int8_kv_cache_holds_more_tokens_in_the_same_memory(tiny_llama_dir: Path) -> None:
    engines = {
        kind: LLM(
            str(tiny_llama_dir),
            dtype="bfloat16",
            compile=False,
            kv_cache_memory=0.01,
            kv_cache_dtype=kind,
        ).engine
        for kind in ("auto", "int8")
    }
    blocks = {kind: e.scheduler.kv_cache_stats().num_blocks for kind, e in engines.items()}
    head_dim = engines["auto"].model_config.head_dim
    # A row: head_dim bf16 values (2 bytes each), or head_dim int8 values and a 4-byte scale.
    assert blocks["int8"] / blocks["auto"] == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.01)


def test_qwen2_matches_transformers(tiny_qwen2_dir: Path) -> None:
    expected = reference(tiny_qwen2_dir, PROMPTS, MAX_TOKENS)
    llm = LLM(
        str(tiny_qwen2_dir),
        dtype="float32",
        compile=False,
        max_num_batched_tokens=16,
        max_num_seqs=16,
    )
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected


def test_seed_gives_the_same_text_whatever_the_batch(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    crowd = llm.generate(PROMPTS[1:] + [PROMPTS[0]], [others] * 3 + [seeded], use_tqdm=False)
    assert crowd[-1].token_ids == alone
    other_seed = llm.generate(
        [PROMPTS[0]],
        SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert other_seed[0].token_ids != alone


def test_stop_strings_and_stop_tokens(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    full = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    cut_at = full.text[len(full.text) // 2 :][:3]
    assert cut_at
    stopped = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[cut_at]),
        use_tqdm=False,
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(cut_at)]
    token = full.token_ids[3]
    by_token = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[token]),
        use_tqdm=False,
    )[0]
    assert by_token.finish_reason == "stop"
    stop_at = full.token_ids.index(token)
    assert by_token.token_ids == full.token_ids[: stop_at + 1]
    # The stop token is counted among the output's tokens, and its text is not the answer's.
    decode = llm.engine.tokenizer.decode
    assert by_token.text == decode(full.token_ids[:stop_at])
    assert by_token.text != decode(full.token_ids[: stop_at + 1])
    assert llm.engine.scheduler.kv_cache_stats().num_used_blocks == 0


def test_bad_input_is_refused_clearly(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="maximum context length is 512 tokens"):
        llm.generate("word " * 600, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert not llm.engine.has_unfinished()
    # The engine still serves after refusing.
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].finish_reason == "length"


def test_unknown_model_path_is_a_clear_error(tmp_path: Path) -> None:
    from iterserve.model.loader import ModelLoadError

    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path / "no-such-model"))


@pytest.mark.parametrize(
    ("setting", "flag"),
    [
        ({"kv_cache_memory": 2.0**26}, "--kv-cache-memory"),
        ({"num_kv_blocks": 2**40}, "--num-kv-blocks"),
    ],
)
def test_a_kv_cache_larger_than_the_machine_is_a_clear_error(
    tiny_llama_dir: Path, setting: dict[str, float], flag: str
) -> None:
    with pytest.raises(ConfigError, match=f"{flag}.*more than this machine's"):
        LLM(str(tiny_llama_dir), compile=False, **setting)


def test_batch_invariant_is_refused_where_the_fused_kernels_do_not_run(
    tiny_llama_dir: Path,
) -> None:
    with pytest.raises(ConfigError, match="--batch-invariant"):
        LLM(str(tiny_llama_dir), kernels="torch", batch_invariant=True, compile=False)
