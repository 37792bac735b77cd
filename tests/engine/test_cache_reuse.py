"""--cache-reuse on the real executor: moved keys are the keys each layer's own rotary tables
make at the new position (every RoPE kind the families here use), a one-layer model (whose
keys depend on their token and position alone) answers a shifted prompt exactly as if it
had computed it, and models whose cache cannot move are refused at start-up."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from conftest import VOCAB
from iterserve import LLM, SamplingParams
from iterserve.config import ConfigError, engine_config
from iterserve.core.kv_reuse import KVCopy
from iterserve.executor.paged_model import PagedModel
from iterserve.model.kv_cache_format import dequantize_rows, quantize_rows
from iterserve.model.kv_shift import turned_keys
from iterserve.model.rope import apply_rope, rope_inv_freq, rope_tables
from tiny_checkpoints import save_checkpoint, tiny_hf_model
from tiny_families import family_model, gemma4_model

pytestmark = pytest.mark.timeout(300)

BLOCK = 4


def network_of(llm: LLM) -> PagedModel:
    return llm.engine.executor.network


def keys_at(k: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], first: int) -> torch.Tensor:
    """Keys k [n, heads, dim] turned by `tables` to positions first..., as [heads, n, dim]."""
    cos, signed_sin = tables
    where = torch.arange(first, first + k.shape[0])
    return apply_rope(k, cos[where][:, None], signed_sin[where][:, None]).transpose(0, 1)


def rows_at(network: PagedModel, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = network.kv_caches[layer]
    flat = [c.view(c.shape[0], -1, c.shape[-1]) for c in (keys, values)]
    return flat[0][:, slots], flat[1][:, slots]


@pytest.mark.parametrize(
    "family", ["gemma3", "olmo3", "smollm3", "exaone4", "ministral3", "gemma4-e2b", "gemma4-31b"]
)
def test_moved_keys_are_the_layers_own_keys_at_their_new_place(
    family: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Each family's layers turn by their own tables (Gemma 3: a windowed layer's base and a
    full layer's linear scaling; OLMo 3: YaRN with an attention factor; SmolLM3 and EXAONE 4:
    layers without RoPE; Ministral 3: YaRN with a query temperature; Gemma 4: proportional
    RoPE on heads of their own, layers reading earlier layers' K/V, keys as values)."""
    hf = gemma4_model(family[7:]) if family.startswith("gemma4") else family_model(family)
    path = save_checkpoint(hf, tmp_path / family, tokenizer_dir)
    llm = LLM(str(path), dtype="float32", compile=False, block_size=BLOCK, cache_reuse=8)
    network = network_of(llm)
    model = network.model
    torch.manual_seed(0)
    n = 10
    src, dst = list(range(40, 40 + n)), list(range(80, 80 + n))
    for shift in (-3, 21):
        start = 30
        for layer in range(model.config.num_hidden_layers):
            if model.config.layer_kv_source(layer) != layer:
                continue
            tables = model.layer_rope_tables(layer)
            keys, values = network.kv_caches[layer]
            k = torch.randn(n, keys.shape[0], keys.shape[-1])
            v = torch.randn(keys.shape[0], n, keys.shape[-1])
            flat_k = keys.view(keys.shape[0], -1, keys.shape[-1])
            flat_v = values.view(values.shape[0], -1, values.shape[-1])
            flat_k[:, src] = keys_at(k, tables, start)
            flat_v[:, src] = v
            network.copy_kv([KVCopy(tuple(src), tuple(dst), shift, 0)])
            moved_k, moved_v = rows_at(network, layer, dst)
            expected = keys_at(k, tables, start + shift)
            torch.testing.assert_close(moved_k, expected, atol=2e-5, rtol=1e-5)
            assert torch.equal(moved_v, v)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "proportional", "partial_rotary_factor": 0.5},
    ],
)  # fmt: skip
@pytest.mark.parametrize("rotated", [64, 48])
def test_turning_composes_with_every_fixed_frequency_rope(
    scaling: dict[str, object] | None, rotated: int
) -> None:
    """A key turned from p by d equals the key at p + d over the first `rotated` of 64
    dimensions (a partial rotary), YaRN's attention factor kept; int8 rows within a step."""
    tables = rope_tables(rotated, 10000.0, scaling, 512, torch.float32, torch.device("cpu"))
    inv_freq = rope_inv_freq(rotated, 10000.0, scaling, 512)[0].double()
    torch.manual_seed(1)
    k = torch.randn(12, 2, 64)

    def at(first: int) -> torch.Tensor:
        return keys_at(k, tables, first)

    for start, shift in ((0, 300), (400, -377), (5, 1)):
        # The tables' own angles are float32 products: a few ulps of a large angle apart.
        turned = turned_keys(at(start), inv_freq, shift)
        torch.testing.assert_close(turned, at(start + shift), atol=5e-5, rtol=1e-4)
        # Quantized when cached and again when turned: within a step of each.
        quantized = turned_keys(quantize_rows(at(start)), inv_freq, shift)
        steps = (
            at(start).abs().amax(-1, keepdim=True) / 127 + turned.abs().amax(-1, keepdim=True) / 127
        )
        error = dequantize_rows(quantized, torch.float32) - at(start + shift)
        assert error.abs().le(steps).all()


def one_layer_model(tmp_path: Path, tokenizer_dir: Path) -> Path:
    # Weights large enough that attention is sharp: a key in the wrong place changes tokens.
    model = tiny_hf_model(
        "llama", vocab_size=VOCAB, num_hidden_layers=1, weight_std=0.15, tie_word_embeddings=True,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return save_checkpoint(model, tmp_path / "one-layer", tokenizer_dir)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "async_scheduling"), [("auto", False), ("auto", True), ("int8", False)]
)
def test_a_one_layer_model_answers_a_moved_prompt_as_if_computed(
    tmp_path: Path, tokenizer_dir: Path, kv_cache_dtype: str, async_scheduling: bool
) -> None:
    """One layer: a key depends on its token and position only, so the copies are exact and
    every log-probability is the full computation's, planned ahead of the step before or
    not. An int8 pool quantizes a moved key twice: its first token's log-probabilities
    within int8's own error (0.02 from float32's here), the answers after may part."""
    path = one_layer_model(tmp_path, tokenizer_dir)
    rng = random.Random(2)
    head, body, edit = ([rng.randrange(3, 5000) for _ in range(n)] for n in (20, 70, 6))
    first = head + body
    moved = head[7:] + body[:30] + edit + body[30:] + [11, 12]
    exact = kv_cache_dtype == "auto"
    params = SamplingParams(max_tokens=8 if exact else 1, temperature=0, logprobs=10)
    answers = {}
    for reuse in (0, 8):
        llm = LLM(
            str(path), dtype="float32", compile=False, block_size=BLOCK, cache_reuse=reuse,
            kv_cache_dtype=kv_cache_dtype, async_scheduling=async_scheduling,
        )  # fmt: skip
        llm.generate([first], SamplingParams(max_tokens=8, temperature=0))
        answers[reuse] = llm.generate([moved], params)[0]
        llm.engine.close()
    computed, reused = answers[0], answers[8]
    assert computed.num_cached_tokens == 0
    assert reused.num_cached_tokens == len(moved) - len(edit) - 2
    assert reused.outputs[0].token_ids == computed.outputs[0].token_ids
    tolerance = 1e-5 if exact else 0.03
    for ours, theirs in zip(reused.outputs[0].logprobs, computed.outputs[0].logprobs, strict=True):
        both = [token for token in theirs if token in ours]
        assert len(both) >= 8
        for token in both:
            assert ours[token].logprob == pytest.approx(theirs[token].logprob, abs=tolerance)


def test_a_deeper_model_reuses_and_keeps_serving(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Past the first layer the copies are approximate: the answers are the model's own
    tokens, the pool is whole after, and a prompt never moved is computed exactly."""
    model = tiny_hf_model("llama", vocab_size=VOCAB, num_hidden_layers=3, tie_word_embeddings=True,
                          max_position_embeddings=512, bos_token_id=1, eos_token_id=2)  # fmt: skip
    path = save_checkpoint(model, tmp_path / "three", tokenizer_dir)
    llm = LLM(str(path), dtype="float32", compile=False, block_size=BLOCK, cache_reuse=4)
    exact = LLM(str(path), dtype="float32", compile=False, block_size=BLOCK)
    rng = random.Random(3)
    text = [rng.randrange(3, 5000) for _ in range(80)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([text], params)
    fresh = [rng.randrange(3, 5000) for _ in range(30)]
    assert llm.generate([fresh], params)[0].outputs[0].token_ids == (
        exact.generate([fresh], params)[0].outputs[0].token_ids
    )
    for cut in range(1, 6):
        answer = llm.generate([text[cut:] + [cut]], params)[0]
        assert answer.num_cached_tokens >= len(text) - cut - BLOCK
        assert len(answer.outputs[0].token_ids) == 4
    stats = llm.engine.scheduler.kv_cache_stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize(("family", "why"), [("lfm2", "convolution"), ("phi3", "change with")])
def test_a_model_whose_cache_cannot_move_is_refused(
    family: str, why: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    path = save_checkpoint(family_model(family), tmp_path / family, tokenizer_dir)
    with pytest.raises(ConfigError, match=why):
        LLM(str(path), dtype="float32", compile=False, cache_reuse=16)


def test_cache_reuse_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="prefix cache"):
        engine_config({"cache_reuse": 16, "enable_prefix_caching": False})
    with pytest.raises(ConfigError, match="--cache-reuse must be"):
        engine_config({"cache_reuse": -1})
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2"):
        engine_config({"cache_reuse": 16, "tensor_parallel_size": 2})
