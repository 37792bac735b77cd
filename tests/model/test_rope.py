"""RoPE variants (model/rope.py) against transformers' rotary embedding and model, past the
original context: tiny configs with an original context of 64 tokens, checked to ~200.

transformers changes longrope's and dynamic NTK's frequencies with the length of the forward
it is given; iterserve freezes each position's rotation as transformers computes it when
generating token by token (rope.py's docstring), so the reference here is transformers run
one token at a time past the original context, over its own KV cache.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb

from iterserve.bench.transformers_checkpoint import from_loaded
from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_loader import GGUFTensorInfo, gguf_model_config
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import hf_model_config, load_model
from iterserve.model.rope import apply_rope, rope_tables
from paged_runner import PagedRunner
from tiny_checkpoints import hf_token_by_token, model_config_of, tiny_hf_model
from tiny_gguf import write_gguf

ORIGINAL = 64
HEAD_DIM = 32
VOCAB = 128


def _variants() -> dict[str, dict[str, object]]:
    half = HEAD_DIM // 2
    rng = random.Random(0)
    return {
        "linear": {"rope_type": "linear", "factor": 4.0},
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        "yarn": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        "yarn-mscale": {
            "rope_type": "yarn",
            "factor": 4.0,
            "mscale": 0.8,
            "mscale_all_dim": 0.6,
            "beta_fast": 16.0,
            "original_max_position_embeddings": ORIGINAL,
        },
        "longrope": {
            "rope_type": "longrope",
            "short_factor": [1.0 + rng.random() * 0.5 for _ in range(half)],
            "long_factor": [1.0 + rng.random() * 8 for _ in range(half)],
            "original_max_position_embeddings": ORIGINAL,
        },
        "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    }


def _max_positions(name: str) -> int:
    # Dynamic NTK: transformers' max_position_embeddings is the original context.
    return ORIGINAL if name == "dynamic" else 4 * ORIGINAL


def _hf_config_kwargs(name: str) -> dict[str, object]:
    return dict(
        rope_parameters={"rope_theta": 10000.0, **_variants()[name]},
        max_position_embeddings=_max_positions(name),
        head_dim=HEAD_DIM,
    )


@pytest.mark.parametrize("name", list(_variants()))
def test_tables_match_transformers_rotary_embedding_token_by_token(name: str) -> None:
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, **_hf_config_kwargs(name)
    )
    rotary = LlamaRotaryEmbedding(config)
    hf = model_config_of(transformers.LlamaForCausalLM(config))
    positions = 200
    assert hf.max_position_embeddings >= positions
    cos, signed_sin = rope_tables(
        HEAD_DIM,
        hf.rope_theta,
        hf.rope_scaling,
        hf.max_position_embeddings,
        torch.float32,
        torch.device("cpu"),
    )
    x = torch.zeros(1, 1, HEAD_DIM)
    half = HEAD_DIM // 2
    # Angles reach ~200 rad, whose float32 spacing is 1.5e-5: a last-bit difference in a
    # frequency (vectorised vs scalar pow) moves cos/sin that much. A wrong variant is off by
    # far more (a wrong band or factor changes angles by whole radians).
    tol = {"atol": 3e-5, "rtol": 0.0}
    for p in range(positions):
        ref_cos, ref_sin = rotary(x, torch.tensor([[p]]))
        torch.testing.assert_close(cos[p], ref_cos[0, 0], **tol)
        torch.testing.assert_close(signed_sin[p, half:], ref_sin[0, 0, half:], **tol)
        torch.testing.assert_close(signed_sin[p, :half], -ref_sin[0, 0, :half], **tol)


@pytest.mark.parametrize("name", ["linear", "yarn", "longrope", "dynamic"])
def test_model_matches_transformers_past_the_original_context(name: str) -> None:
    hf = tiny_hf_model(
        vocab_size=VOCAB,
        weight_std=0.15,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        attn_implementation="eager",
        **_hf_config_kwargs(name),
    )
    config: ModelConfig = model_config_of(hf)
    ours = LlamaForCausalLM(config, torch.float32, torch.device("cpu"))
    ours.load_weights(hf.state_dict())
    rng = random.Random(1)
    tokens = [rng.randrange(VOCAB) for _ in range(180)]
    ref = hf_token_by_token(hf, tokens, prompt=40)
    runner = PagedRunner(ours, block_size=8, num_blocks=64)
    runner.add("s", tokens)
    # Chunks inside, across and past the original context, then decodes around position 180.
    got = [runner.step([("s", n)])["s"] for n in (40, 30, 70, 35)]
    got += [runner.step([("s", 1)])["s"] for _ in range(5)]
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["default", "longrope"])
def test_partial_rotary_turns_the_first_dimensions_as_transformers_phi3(variant: str) -> None:
    """Phi-4-mini's rope: 96 of a head's 128 dimensions, frequencies (and longrope's factors
    and attention factor) over those 96, the other 32 passed through unscaled."""
    rotated, rng = 96, random.Random(2)
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + rng.random() * 0.5 for _ in range(rotated // 2)],
        "long_factor": [1.0 + rng.random() * 8 for _ in range(rotated // 2)],
    }
    config = transformers.Phi3Config(
        hidden_size=256,
        num_attention_heads=2,
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            **(longrope if variant == "longrope" else {"rope_type": "default"}),
        },
    )
    ours = hf_model_config(config.to_dict() | {"architectures": ["Phi3ForCausalLM"]})
    assert (ours.head_dim, ours.rotary_dim, ours.rope_dim) == (128, 96, 96)
    cos, signed_sin = rope_tables(
        ours.rope_dim, ours.rope_theta, ours.rope_scaling, 200, torch.float32, torch.device("cpu")
    )
    rotary = Phi3RotaryEmbedding(config)
    q, k = torch.randn(2, 1, 2, 1, 128).unbind(0)  # [batch, heads, tokens, head_dim]
    for p in (0, 5, ORIGINAL - 1, 150):  # past the original context: longrope's long factors
        ref_cos, ref_sin = rotary(q, torch.tensor([[p]]))
        ref_q, ref_k = phi3_apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
        for x, ref in ((q, ref_q), (k, ref_k)):
            got = apply_rope(
                x[0].transpose(0, 1), cos[p : p + 1, None], signed_sin[p : p + 1, None]
            )
            torch.testing.assert_close(got, ref[0].transpose(0, 1), atol=3e-5, rtol=0)
            assert torch.equal(got[..., rotated:], x[0].transpose(0, 1)[..., rotated:])


def test_longrope_attention_factor_is_the_served_contexts_not_the_first_tables() -> None:
    """Phi-3.5-mini's config: 128k served over a 4k original, no `factor`. The model builds
    its first rotary table 4096 positions long; the cos/sin scale must still be transformers'
    sqrt(1 + ln 32 / ln 4096), not the 1.0 a 4096-long table's own ratio gives."""
    half = HEAD_DIM // 2
    config = transformers.Phi3Config(
        hidden_size=64,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * half,
            "long_factor": [2.0] * half,
        },
    )
    ours = LlamaForCausalLM(
        hf_model_config(config.to_dict() | {"architectures": ["Phi3ForCausalLM"]}),
        torch.float32,
        torch.device("cpu"),
    )
    assert ours.rope_positions < 131072  # the table grows later
    expected = Phi3RotaryEmbedding(config).attention_scaling
    assert expected == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert float(ours.rope_cos[0, 0]) == pytest.approx(expected, rel=1e-6)


def _llama_cpp_rope_freqs(scaling: dict[str, object], theta: float) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py for Llama 3.1: per-frequency divisors, transcribed."""
    factor, low, high = (
        float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor")
    )
    old = float(scaling["original_max_position_embeddings"])  # type: ignore[arg-type]
    freqs = 1.0 / (theta ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_gguf_rope_freqs_match_transformers(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A Llama 3.1-style GGUF (rope_freqs tensor) runs like the HF model past the original
    context."""
    hf = tiny_hf_model(
        vocab_size=VOCAB,
        weight_std=0.15,
        num_hidden_layers=2,
        attn_implementation="eager",
        **_hf_config_kwargs("llama3"),
    )
    path = tmp_path / "tiny-llama3.gguf"
    freqs = _llama_cpp_rope_freqs(_variants()["llama3"], 10000.0)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    write_gguf(path, "llama", hf, tokenizer, rope_tensors={"rope_freqs": freqs})
    loaded = load_model(path, dtype=torch.float32)
    assert loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    ours = LlamaForCausalLM(loaded.config, torch.float32, torch.device("cpu"))
    ours.load_weights(loaded.weights)
    rng = random.Random(2)
    tokens = [rng.randrange(VOCAB) for _ in range(200)]
    runner = PagedRunner(ours, block_size=8, num_blocks=64)
    runner.add("s", tokens)
    got = torch.cat([runner.step([("s", n)])["s"] for n in (50, 150)])
    # The benchmark's transformers peer, from the same file: its rope gets the factors too.
    peer = from_loaded(loaded.config, loaded.weights, torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0].float()
        peer_logits = peer(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(peer_logits, ref, atol=1e-4, rtol=0)


def test_gguf_rope_metadata_is_read_or_refused_by_name() -> None:
    base = {
        "general.architecture": "llama",
        "llama.context_length": 256,
        "llama.embedding_length": 64,
        "llama.attention.head_count": 2,
        "llama.feed_forward_length": 128,
        "llama.block_count": 1,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    embd = GGUFTensorInfo(
        "token_embd.weight", (VOCAB, 64), GGMLQuantizationType.F32, 0, 0, Path("unread.gguf")
    )
    tensors = {embd.name: embd}
    yarn = {
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 64,
    }
    config = gguf_model_config({**base, **yarn}, tensors)
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert config.max_position_embeddings == 256
    linear = gguf_model_config(
        {**base, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, tensors
    )
    assert linear.rope_scaling is not None
    assert (linear.rope_scaling["rope_type"], linear.rope_scaling["factor"]) == ("linear", 2.0)
    with pytest.raises(ModelLoadError, match="'longrope' is not supported; supported: none"):
        gguf_model_config({**base, "llama.rope.scaling.type": "longrope"}, tensors)
    # yarn_log_multiplier read as llama.cpp reads it: mscale_all_dim, over an mscale of 1.
    log_multiplied = {**base, **yarn, "llama.rope.scaling.yarn_log_multiplier": 0.5}
    scaling = gguf_model_config(log_multiplied, tensors).rope_scaling
    assert scaling is not None and (scaling["mscale"], scaling["mscale_all_dim"]) == (1.0, 0.5)
    with pytest.raises(ModelLoadError, match="yarn_ext_factor"):
        gguf_model_config({**base, **yarn, "llama.rope.scaling.yarn_ext_factor": 0.5}, tensors)
    with pytest.raises(ModelLoadError, match="'llama' with rope over 16 of 32 head dim"):
        gguf_model_config({**base, "llama.rope.dimension_count": 16}, tensors)
    phi3 = {k.replace("llama.", "phi3."): v for k, v in base.items()}
    phi3["general.architecture"] = "phi3"
    assert gguf_model_config({**phi3, "phi3.rope.dimension_count": 16}, tensors).rotary_dim == 16
    assert gguf_model_config({**phi3, "phi3.rope.dimension_count": 32}, tensors).rotary_dim is None
    with pytest.raises(ModelLoadError, match="rope.dimension_count 15: rope over 15 of 32"):
        gguf_model_config({**phi3, "phi3.rope.dimension_count": 15}, tensors)


def test_unsupported_hf_rope_is_refused_by_name() -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ModelLoadError, match="'mrope' is not supported; supported: default"):
        hf_model_config({**raw, "rope_scaling": {"rope_type": "mrope", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="partial_rotary_factor=0.5"):
        hf_model_config({**raw, "partial_rotary_factor": 0.5})
