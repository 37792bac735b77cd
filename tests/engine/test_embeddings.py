"""Embeddings offline (LLM.embed) against sentence-transformers and transformers (fp32):
last-token and mean pools, batched, through chunked prefill, with and without the prefix
cache; and the bundled model's mean pool through the fast kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embedding_checkpoints import resave_bare, save_embedding_qwen3
from iterserve.engine.llm import LLM
from iterserve.pooling_params import PoolingParams
from iterserve.sampling_params import InvalidRequestError

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog " * 20,  # ~180 tokens: six 32-token chunks
    "a",
    "Embeddings come from the final norm's hidden states.",
]
SMALL = dict(dtype="float32", compile=False, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def sentence_transformer(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):  # type: ignore[no-untyped-def]
    from sentence_transformers import SentenceTransformer

    path = save_embedding_qwen3(tmp_path_factory.mktemp("st-qwen3"), tokenizer_dir)
    return SentenceTransformer(str(path), device="cpu")


@pytest.mark.slow
def test_last_token_pool_equals_sentence_transformers(
    sentence_transformer,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    # The checkpoint as sentence-transformers saves it: a bare Qwen3Model without LM head.
    llm = LLM(str(resave_bare(sentence_transformer, tmp_path / "bare")), **SMALL)
    assert llm.engine.pooling.describe().startswith("embed;")  # --task auto: embeddings only
    expected = sentence_transformer.encode(TEXTS, convert_to_tensor=True)
    batched = llm.embed(TEXTS, use_tqdm=False)
    single = [llm.embed(text, use_tqdm=False)[0] for text in TEXTS]
    for outputs in (batched, single):
        got = torch.tensor([out.embedding for out in outputs])
        torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)
    assert len(batched[1].prompt_token_ids) > 5 * 32  # through chunked prefill
    # Token ids in, the same vector out; the second run took its prefix from the cache.
    again = llm.embed([batched[1].prompt_token_ids], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    torch.testing.assert_close(
        torch.tensor(again.embedding), expected[1].float(), atol=1e-5, rtol=1e-5
    )
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("hello", use_tqdm=False)
    assert error.value.param == "model"


def test_mean_pool_equals_transformers_mean_of_final_norm_states(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama_dir), pooling="mean", **SMALL)
    assert llm.engine.pooling.generate and llm.engine.pooling.embed  # --task auto: both
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    raw = PoolingParams(normalize=False)
    for _ in range(2):  # the second time its blocks are cached: a mean pool recomputes them
        outputs = llm.embed(TEXTS, raw, use_tqdm=False)
        for out in outputs:
            assert out.num_cached_tokens == 0
            with torch.no_grad():
                states = hf.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
            torch.testing.assert_close(
                torch.tensor(out.embedding), states.mean(0), atol=1e-5, rtol=1e-5
            )
    normalized = llm.embed(TEXTS[0], use_tqdm=False)[0].embedding
    expected = torch.nn.functional.normalize(torch.tensor(outputs[0].embedding), dim=0)
    torch.testing.assert_close(torch.tensor(normalized), expected, atol=1e-6, rtol=1e-6)
    # Generation beside embeddings in the same engine.
    assert llm.generate("hello", use_tqdm=False)[0].token_ids
    with pytest.raises(InvalidRequestError) as error:
        llm.embed("hello", PoolingParams(dimensions=16), use_tqdm=False)
    assert error.value.param == "dimensions"
    for bad in ("", [], [10**6]):
        with pytest.raises(InvalidRequestError) as error:
            llm.embed([bad], use_tqdm=False)  # type: ignore[list-item]
        assert error.value.param == "input"
    with pytest.raises(InvalidRequestError) as error:
        llm.embed("word " * 600, use_tqdm=False)  # past the 512-token context
    assert error.value.param == "input"
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
def test_bundled_model_mean_pool_through_the_fast_kernels() -> None:
    """The bundled Q4_1 model on iterserve's kernels (int8 activations) against its own
    dequantized fp32 weights on plain torch: the same direction."""
    fast = LLM(None, pooling="mean", compile=False).embed(TEXTS, use_tqdm=False)
    exact = LLM(
        None, pooling="mean", dtype="float32", kernels="torch", weights="bf16", compile=False
    )
    reference = exact.embed(TEXTS, use_tqdm=False)
    for got, want in zip(fast, reference, strict=True):
        cosine = torch.nn.functional.cosine_similarity(
            torch.tensor(got.embedding), torch.tensor(want.embedding), dim=0
        )
        assert cosine > 0.99, cosine


def test_pooling_metadata_in_both_sentence_transformers_spellings(tmp_path: Path) -> None:
    from iterserve.config import PoolingConfig
    from iterserve.engine.pooling import model_pooling
    from iterserve.model.errors import ModelLoadError
    from iterserve.model.pooling_metadata import read_pooling_metadata

    (tmp_path / "config.json").write_text(
        '{"architectures": ["Qwen3Model"], "is_matryoshka": true}'
    )
    (tmp_path / "modules.json").write_text(
        '[{"path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]'
    )
    (tmp_path / "1_Pooling").mkdir()
    pooling = tmp_path / "1_Pooling" / "config.json"
    pooling.write_text('{"pooling_mode_cls_token": false, "pooling_mode_mean_tokens": true}')
    meta = read_pooling_metadata(tmp_path)  # sentence-transformers < 6
    assert (meta.pooling, meta.normalize, meta.embedding_model, meta.has_lm_head) == (
        "mean",
        False,
        True,
        False,
    )
    assert meta.matryoshka and meta.matryoshka_dimensions is None
    pooling.write_text('{"pooling_mode": "max"}')
    with pytest.raises(ModelLoadError, match="--pooling"):
        model_pooling(PoolingConfig(), tmp_path, 64)
    chosen = model_pooling(PoolingConfig(pooling="last"), tmp_path, 64)  # --pooling overrides
    # (no Normalize module listed: not normalized)
    assert (chosen.pooling, chosen.normalize, chosen.generate, chosen.embed) == (
        "last",
        False,
        False,
        True,
    )
    with pytest.raises(Exception, match="no LM head|without an LM head"):
        model_pooling(PoolingConfig(task="both", pooling="last"), tmp_path, 64)
