"""RoPE variants (model/rope.py) against transformers' rotary embedding and model, past the
original context: tiny configs with an original context of 64 tokens, checked to ~200.

transformers changes longrope's and dynamic NTK's frequencies with the length of the forward
it is given; iterserve freezes each position's rotation as transformers computes it when
generating token by token (rope.py's docstring), so the reference here is transformers run
one token at a time past the original context, over its own KV cache.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from iterserve.model.config import ModelConfig
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.rope import rope_tables
from paged_runner import PagedRunner
from tiny_checkpoints import model_config_of, tiny_hf_model

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


@torch.inference_mode()
def _hf_token_by_token(hf: transformers.PreTrainedModel, tokens: list[int], prompt: int) -> torch.Tensor:
    """Logits of every position: the prompt in one forward, then one token per forward."""
    out = hf(torch.tensor([tokens[:prompt]]), use_cache=True)
    rows, cache = [out.logits[0]], out.past_key_values
    for p in range(prompt, len(tokens)):
        out = hf(torch.tensor([[tokens[p]]]), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0])
        cache = out.past_key_values
    return torch.cat(rows).float()


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
    ref = _hf_token_by_token(hf, tokens, prompt=40)
    runner = PagedRunner(ours, block_size=8, num_blocks=64)
    runner.add("s", tokens)
    # Chunks inside, across and past the original context, then decodes around position 180.
    got = [runner.step([("s", n)])["s"] for n in (40, 30, 70, 35)]
    got += [runner.step([("s", 1)])["s"] for _ in range(5)]
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=0)
