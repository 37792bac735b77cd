"""Prompts given as input rows (vLLM's prompt_embeds) against transformers' `inputs_embeds`
on the same weights (the tiny random Llama, fp32), through chunking, preemption and the
prefix cache; the rows' content, not their placeholder tokens, names their cached blocks;
and what they cannot give is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.sampling_params import InvalidRequestError
from transformers_reference import PROMPTS

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _blended_rows(model_dir: Path) -> list[torch.Tensor]:
    """Rows no token embeds to: each prompt's token embeddings blended with the reversed
    prompt's, so a path that read the placeholder tokens, or the prompt's own tokens,
    would answer otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    table = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    embed = table.get_input_embeddings()
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor(tokenizer.encode(prompt))
            rows.append(0.75 * embed(ids) + 0.25 * embed(ids.flip(0)))
    return rows


def _transformers_greedy(model_dir: Path, rows: list[torch.Tensor]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    answers = []
    for given in rows:
        generated = model.generate(
            inputs_embeds=given[None],
            attention_mask=torch.ones(1, len(given), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            pad_token_id=0,
        )
        answers.append(generated[0, -MAX_TOKENS:].tolist())
    return answers


@pytest.fixture(scope="module")
def rows_and_reference(tiny_llama_dir: Path) -> tuple[list[torch.Tensor], list[list[int]]]:
    rows = _blended_rows(tiny_llama_dir)
    return rows, _transformers_greedy(tiny_llama_dir, rows)


@pytest.mark.parametrize(
    "settings",
    [
        {"compile": True},  # the compiled graphs serve the token steps; the rows' run eager
        {"max_num_batched_tokens": 5, "max_num_seqs": 5},  # every prompt's rows in chunks
        {"num_kv_blocks": 20, "block_size": 4},  # preemption: the rows computed again
    ],
    ids=["default", "chunked", "preemption"],
)
def test_rows_answer_as_transformers_inputs_embeds(
    tiny_llama_dir: Path,
    rows_and_reference: tuple[list[torch.Tensor], list[list[int]]],
    settings: dict,
) -> None:
    rows, reference = rows_and_reference
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        enable_prompt_embeds=True,
        **{"compile": False, **settings},
    )
    prompts = [{"prompt_embeds": given} for given in rows]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference
    assert llm.engine.scheduler.kv_cache_stats().num_used_blocks == 0, "every block back"
    if "num_kv_blocks" in settings:
        assert llm.engine.scheduler.num_preemptions > 0
    # Mixed in one batch with the prompts' own text, each keeps its answer.
    mixed = llm.generate([*prompts, *PROMPTS], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in mixed[: len(rows)]] == reference


def test_the_prefix_cache_names_blocks_by_the_rows(
    tiny_llama_dir: Path, rows_and_reference: tuple[list[torch.Tensor], list[list[int]]]
) -> None:
    """Rows behind the same placeholder tokens never share blocks; the same rows do."""
    rows, reference = rows_and_reference
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", compile=False, block_size=4, enable_prompt_embeds=True
    )
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    given = rows[longest]
    first = llm.generate({"prompt_embeds": given}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": given.clone()}, GREEDY, use_tqdm=False)[0]
    assert first.token_ids == again.token_ids == reference[longest]
    assert again.num_cached_tokens >= 4, "the same rows hit their cached blocks"
    other = llm.generate({"prompt_embeds": given.flip(0)}, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0, "other rows, same placeholders: no hit"
    fresh = LLM(str(tiny_llama_dir), dtype="float32", compile=False, enable_prompt_embeds=True)
    alone = fresh.generate({"prompt_embeds": given.flip(0)}, GREEDY, use_tqdm=False)[0]
    assert other.token_ids == alone.token_ids


def test_what_rows_cannot_give_is_refused_by_name(tiny_llama_dir: Path) -> None:
    rows = torch.randn(5, 64)
    off = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    with pytest.raises(InvalidRequestError, match="--enable-prompt-embeds") as refused:
        off.generate({"prompt_embeds": rows}, GREEDY, use_tqdm=False)
    assert refused.value.param == "prompt_embeds"
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False, enable_prompt_embeds=True)
    hidden = llm.engine.model_config.hidden_size
    cases = {
        "prompt_embeds": [
            ({"prompt_embeds": torch.randn(5, hidden + 1)}, GREEDY),
            ({"prompt_embeds": torch.zeros(0, hidden)}, GREEDY),
            ({"prompt_embeds": torch.full((3, hidden), float("nan"))}, GREEDY),
            ({"prompt_embeds": torch.ones(3, hidden, dtype=torch.long)}, GREEDY),
        ],
        "prompt_logprobs": [
            ({"prompt_embeds": torch.randn(5, hidden)}, SamplingParams(prompt_logprobs=1)),
        ],
    }
    for field, requests in cases.items():
        for prompt, params in requests:
            with pytest.raises(InvalidRequestError) as refused:
                llm.generate(prompt, params, use_tqdm=False)
            assert refused.value.param == field, refused.value
    with pytest.raises(InvalidRequestError, match="generation only"):
        llm.embed({"prompt_embeds": torch.randn(5, hidden)}, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache_stats().num_used_blocks == 0


@pytest.mark.parametrize("family", ["gemma3", "granite"])
def test_families_that_scale_embeddings_take_rows_as_transformers_does(
    tmp_path: Path, tokenizer_dir: Path, family: str
) -> None:
    """Gemma's embedding module scales its own output, so its rows come scaled; Granite
    scales `inputs_embeds` in its forward (and iterserve carries its stream over its
    residual multiplier): either way the answer is transformers' `inputs_embeds` one."""
    from tiny_families import family_checkpoint, family_model

    path = family_checkpoint("hf", family_model(family), tmp_path, tokenizer_dir)
    rows = _blended_rows(path)[:2]
    llm = LLM(str(path), dtype="float32", compile=False, enable_prompt_embeds=True)
    outputs = llm.generate([{"prompt_embeds": r} for r in rows], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == _transformers_greedy(path, rows)


def test_per_layer_inputs_by_token_id_refuse_rows(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Gemma 4 E2B's per-layer inputs are looked up by token id: rows have none to give."""
    from tiny_families import family_checkpoint, gemma4_model

    path = family_checkpoint("hf", gemma4_model("e2b"), tmp_path, tokenizer_dir)
    llm = LLM(str(path), dtype="float32", compile=False, enable_prompt_embeds=True)
    rows = torch.randn(4, llm.engine.model_config.hidden_size)
    with pytest.raises(InvalidRequestError, match="per-layer") as refused:
        llm.generate({"prompt_embeds": rows}, GREEDY, use_tqdm=False)
    assert refused.value.param == "prompt_embeds"


@pytest.mark.parametrize("bundled", [False, True], ids=["tiny", "bundled"])
def test_the_default_path_reads_rows_as_it_reads_tokens(
    tiny_llama_dir: Path, bundled: bool
) -> None:
    """bf16 on the default path (the tiny model's tiled projections and compiled graphs; the
    bundled model's fused C++ layers, one call for the stack): a prompt's own token
    embeddings given as rows answer as its tokens do, token for token."""
    llm = LLM(None if bundled else str(tiny_llama_dir), enable_prompt_embeds=True)
    if bundled and llm.engine.model_plan.kernels_isa:
        assert llm.engine.model_plan.paged_attention_kernel, "the fused layers run"
    table = llm.engine.executor.network.model.embedding
    assert table is not None
    ids = [llm.tokenizer.encode(prompt) for prompt in PROMPTS]
    by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    rows = [{"prompt_embeds": table(torch.tensor(i))} for i in ids]
    by_rows = llm.generate(rows, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in by_rows] == [o.token_ids for o in by_ids]
