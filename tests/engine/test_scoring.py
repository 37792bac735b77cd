"""Rerankers offline (LLM.score) against transformers on the same weights (fp32): a
ForSequenceClassification's score head, a causal LM scored from its rows of "no" and "yes"
(a Qwen3-Reranker directory), and that LM as llama.cpp's converter writes it into a GGUF;
pairs through chunked prefill and a cached prefix; the 400s."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iterserve.config import ConfigError
from iterserve.engine.llm import LLM
from iterserve.engine.outputs import ClassificationOutput, ScoringOutput
from iterserve.sampling_params import InvalidRequestError
from reranker_checkpoints import (
    TEMPLATE,
    save_classifier,
    save_yes_no_reranker,
    write_reranker_gguf,
)
from tiny_gguf import write_gguf

QUERY = "what do cats eat"
DOCUMENTS = [
    "Cats are carnivores: they eat meat and fish.",
    "The stock market closed higher on Tuesday. " * 12,  # ~100 tokens: 4 chunks of 32
    "a",
]
SMALL = dict(dtype="float32", compile=False, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_classifier(tmp_path_factory.mktemp("classifier"), tokenizer_dir)


@pytest.fixture(scope="module")
def yes_no_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_yes_no_reranker(tmp_path_factory.mktemp("yes-no"), tokenizer_dir)


def _scores(outputs: list) -> torch.Tensor:  # type: ignore[type-arg]
    return torch.tensor([out.score for out in outputs])


def test_classifier_scores_equal_transformers(classifier_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    llm = LLM(str(classifier_dir), **SMALL)
    # --task auto: scores (and the head's one label) only
    assert llm.engine.pooling.describe().startswith("score and classify (1 label) (")
    hf = AutoModelForSequenceClassification.from_pretrained(classifier_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    expected = []
    for document in DOCUMENTS:  # the pair as a cross-encoder reads it: query, then document
        ids = tokenizer(QUERY, document, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected.append(torch.sigmoid(hf(ids).logits[0, 0]))
    for _ in range(2):  # the second time the query's blocks come from the prefix cache
        outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        torch.testing.assert_close(_scores(outputs), torch.stack(expected), atol=1e-5, rtol=1e-5)
    assert len(outputs[1].prompt_token_ids) > 3 * 32  # through chunked prefill
    # Lists item by item; a generation request is refused by field.
    pairs = llm.score([QUERY, "x"], DOCUMENTS[:2], use_tqdm=False)
    assert pairs[0].score == pytest.approx(outputs[0].score, abs=1e-6)
    assert pairs[0].outputs == ScoringOutput(pairs[0].score)  # vLLM's shape
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("hello", use_tqdm=False)
    assert error.value.param == "model"
    with pytest.raises(InvalidRequestError) as error:
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    assert error.value.param == "text_2"
    with pytest.raises(InvalidRequestError) as error:
        llm.embed("hello", use_tqdm=False)
    assert error.value.param == "input"
    # The default road (bf16, the C++ kernels where they run) against this fp32 one.
    fast = LLM(str(classifier_dir), compile=False, max_num_batched_tokens=32, max_num_seqs=8)
    assert fast.engine.model_config is not None
    got = _scores(fast.score(QUERY, DOCUMENTS, use_tqdm=False))
    torch.testing.assert_close(got, torch.stack(expected), atol=0.02, rtol=0)


def _yes_probability(hf: torch.nn.Module, ids: list[int], yes: int, no: int) -> torch.Tensor:
    with torch.no_grad():
        last = hf(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(last[[no, yes]], 0)[1]  # Qwen3-Reranker's model card's score


@pytest.mark.slow
def test_yes_no_reranker_directory_and_its_gguf(yes_no_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(yes_no_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(yes_no_dir)
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    # Named Qwen3-Reranker: scored from "no" and "yes" in its own prompt, unasked.
    llm = LLM(str(yes_no_dir), **SMALL)
    assert llm.engine.pair_prompts.template is not None
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    for out, document in zip(outputs, DOCUMENTS, strict=True):
        text = llm.engine.pair_prompts.template.format(query=QUERY, document=document)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert out.score == pytest.approx(float(_yes_probability(hf, ids, yes, no)), abs=1e-5)
    del llm
    # A GGUF of it written before llama.cpp knew rerankers (no cls.output), named so.
    plain = tmp_path / "Qwen3-Reranker-tiny-Q8_0.gguf"
    write_gguf(plain, "qwen3", hf, tokenizer)
    llm = LLM(str(plain), **SMALL)
    template = llm.engine.pair_prompts.template
    assert template is not None
    for out, document in zip(llm.score(QUERY, DOCUMENTS, use_tqdm=False), DOCUMENTS, strict=True):
        # (this test's GGUF tokenizer splits some text otherwise than the directory's)
        text = template.format(query=QUERY, document=document)
        assert llm.engine.tokenizer.decode(out.prompt_token_ids) == text
        expected = _yes_probability(hf, out.prompt_token_ids, yes, no)
        assert out.score == pytest.approx(float(expected), abs=1e-5)
    del llm
    # The same LM as llama.cpp's converter writes it: cls.output, pooling rank, its template.
    gguf = write_reranker_gguf(tmp_path / "reranker.gguf", yes_no_dir)
    llm = LLM(str(gguf), **SMALL)
    assert llm.engine.pair_prompts.template == TEMPLATE
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    for out, document in zip(outputs, DOCUMENTS, strict=True):
        ids = tokenizer.encode(
            TEMPLATE.format(query=QUERY, document=document), add_special_tokens=False
        )
        assert out.prompt_token_ids == ids
        assert out.score == pytest.approx(float(_yes_probability(hf, ids, yes, no)), abs=1e-5)


def test_classifier_from_tokens_and_the_template_flag(
    yes_no_dir: Path, tiny_llama_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    # One token: its logit's sigmoid; the pair written into --rerank-template.
    llm = LLM(
        str(tiny_llama_dir),
        classifier_from_tokens="yes",
        rerank_template="Q: {query} D: {document}",
        **SMALL,
    )
    assert llm.engine.pooling.score and not llm.engine.pooling.generate  # auto: scores only
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    yes = llm.engine.tokenizer.convert_tokens_to_ids("yes")
    out = llm.score("q {document}", "d", use_tqdm=False)[0]
    assert llm.engine.tokenizer.decode(out.prompt_token_ids) == "Q: q {document} D: d"
    with torch.no_grad():
        logit = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1, yes]
    assert out.score == pytest.approx(float(torch.sigmoid(logit)), abs=1e-5)
    with pytest.raises(Exception, match="not a token"):
        LLM(str(tiny_llama_dir), classifier_from_tokens="no-such-token", **SMALL)
    with pytest.raises(ConfigError, match="no {document}"):
        LLM(str(yes_no_dir), rerank_template="{query} only", **SMALL)
    with pytest.raises(ConfigError, match="no score head"):
        LLM(str(tiny_llama_dir), task="score", **SMALL)


def test_a_classifier_of_several_labels(tmp_path: Path, tokenizer_dir: Path) -> None:
    """LLM.classify against transformers' softmax of a 3-label classifier's logits; it
    classifies but does not score (a score needs one label)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    labels = ("negative", "neutral", "positive")
    path = save_classifier(tmp_path / "three", tokenizer_dir, labels)
    llm = LLM(str(path), **SMALL)
    assert llm.engine.pooling.labels == labels and not llm.engine.pooling.score
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    outputs = llm.classify(DOCUMENTS, use_tqdm=False)
    for out, text in zip(outputs, DOCUMENTS, strict=True):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            expected = torch.softmax(hf(ids).logits[0], 0)
        torch.testing.assert_close(torch.tensor(out.probs), expected, atol=1e-5, rtol=1e-5)
        assert out.outputs == ClassificationOutput(out.probs)  # vLLM's shape
    with pytest.raises(InvalidRequestError, match="3 labels") as error:
        llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert error.value.param == "model"
