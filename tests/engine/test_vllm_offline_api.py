"""`LLM` as vLLM's users write for it: prompt dicts, one output per prompt with its choices in
`outputs`, vLLM's logprob shapes, `truncate_prompt_tokens` and `detokenize`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from iterserve import LLM, SamplingParams
from iterserve.engine.outputs import EmbeddingOutput
from iterserve.sampling_params import InvalidRequestError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_llama_dir), dtype="float32", compile=False) as engine:
        yield engine


def test_one_output_per_prompt_with_its_completion(llm: LLM) -> None:
    prompts = ["The capital of France is", "Water boils at"]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        (completion,) = output.outputs
        assert completion.index == 0
        assert completion.text == output.text and completion.token_ids == output.token_ids
        assert len(completion.token_ids) == 6
        assert completion.finish_reason == "length" and completion.finished()
        assert completion.cumulative_logprob is None and completion.logprobs is None


def test_prompt_dicts_run_as_the_text_or_ids_they_hold(llm: LLM) -> None:
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    plain_text, plain_ids = llm.generate([text, ids], GREEDY, use_tqdm=False)
    from_text, from_ids = llm.generate(
        [{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False
    )
    assert from_text.token_ids == plain_text.token_ids and from_text.prompt == text
    assert from_ids.token_ids == plain_ids.token_ids and from_ids.prompt is None
    (single,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single.prompt_token_ids == ids


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ({"prompt": "Hi", "multi_modal_data": {"image": None}}, "multi_modal_data"),
        ({"prompt": "Hi", "prompt_token_ids": [1, 2]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": [1, 2]}, "prompt"),
        ({"prompt_token_ids": "1 2"}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
    ],
)
def test_other_prompt_dicts_are_refused_by_name(llm: LLM, prompt: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(["fine", prompt], GREEDY, use_tqdm=False)
    assert refused.value.param == field
    assert not llm.engine.has_unfinished()  # nothing of the batch was queued


def test_n_choices_are_one_output_each_as_if_run_alone(llm: LLM) -> None:
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    (output,) = llm.generate("Once upon a time", params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert output.choices is not None and output.choices[0] is output
    for index, completion in enumerate(output.outputs):
        alone = SamplingParams(max_tokens=8, temperature=1.0, seed=11 + index, ignore_eos=True)
        (single,) = llm.generate("Once upon a time", alone, use_tqdm=False)
        assert completion.token_ids == single.token_ids and completion.text == single.text
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_chat_choices_are_grouped_per_conversation(llm: LLM) -> None:
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    params = SamplingParams(n=2, max_tokens=5, seed=3, ignore_eos=True)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert len(outputs) == 2
    for output, conversation in zip(outputs, conversations, strict=True):
        assert [c.index for c in output.outputs] == [0, 1]
        assert output.prompt is not None and conversation[0]["content"] in output.prompt


def test_logprobs_in_vllms_shape(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    (output,) = llm.generate("The capital of France is", params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.logprobs is not None and output.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids) == 4
    for token, ours, theirs in zip(
        completion.token_ids, output.logprobs, completion.logprobs, strict=True
    ):
        assert ours is not None
        assert theirs[token].logprob == ours.logprob
        assert theirs[token].rank == 1  # greedy: the sampled token is the most likely
        ranked = sorted(theirs.values(), key=lambda p: p.rank or 0)
        assert [p.rank for p in ranked] == [1, 2, 3]
        assert [p.logprob for p in ranked] == sorted((p.logprob for p in ranked), reverse=True)
    expected = sum(entry.logprob for entry in output.logprobs if entry is not None)
    assert completion.cumulative_logprob == pytest.approx(expected)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    ids = list(range(100, 120))
    params = SamplingParams(max_tokens=2, temperature=0.0, truncate_prompt_tokens=5)
    (output,) = llm.generate(ids, params, use_tqdm=False)
    assert output.prompt_token_ids == ids[-5:]
    with pytest.raises(InvalidRequestError, match="not both"):
        SamplingParams(truncate_prompt_tokens=5, truncation=params.truncation)
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(truncate_prompt_tokens=0)
    assert refused.value.param == "truncate_prompt_tokens"


def test_detokenize_false_gives_the_same_tokens_without_text(llm: LLM) -> None:
    (text,) = llm.generate("Water boils at", GREEDY, use_tqdm=False)
    quiet = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False)
    (ids_only,) = llm.generate("Water boils at", quiet, use_tqdm=False)
    assert ids_only.token_ids == text.token_ids and text.text
    assert ids_only.text == "" and ids_only.outputs[0].text == ""
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(detokenize=False, stop=["."])
    assert refused.value.param == "detokenize"


def test_prompt_logprobs_read_as_vllms_dicts(llm: LLM) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    (output,) = llm.generate("The capital of France is", params, use_tqdm=False)
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    for token, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True):
        assert entry is not None
        # lm-eval's vLLM reader: the prompt token's logprob looked up by its id.
        assert entry[token].logprob == entry.logprob and entry[token].rank == entry.rank
        assert token in entry and len(entry) in (2, 3)  # the token, and the top 2 if not in it
        top = [entry[t] for t, _ in entry.top]
        assert [p.rank for p in top] == [1, 2]
        assert max(entry.values(), key=lambda p: p.logprob) == top[0]


def test_embeddings_in_vllms_shape_and_names(llm: LLM) -> None:
    (output,) = llm.embed({"prompt": "Water boils at"}, pooling_params=None, use_tqdm=False)
    assert output.embedding is not None and output.outputs == EmbeddingOutput(output.embedding)


def test_vllms_keyword_for_sampling_params(llm: LLM) -> None:
    (by_name,) = llm.generate("Water boils at", sampling_params=GREEDY, use_tqdm=False)
    (by_place,) = llm.generate("Water boils at", GREEDY, use_tqdm=False)
    assert by_name.token_ids == by_place.token_ids
    chat = [{"role": "user", "content": "Hi"}]
    (answer,) = llm.chat(chat, sampling_params=GREEDY, use_tqdm=False)
    assert len(answer.token_ids) == GREEDY.max_tokens
