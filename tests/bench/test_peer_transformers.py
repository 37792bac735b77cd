"""The `transformers` peer loads any family iterserve loads from GGUF as transformers' own
model of that family: the logits of the original transformers model, from the GGUF file."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from iterserve.bench.peer_transformers import load_transformers_model
from iterserve.bench.transformers_checkpoint import from_loaded
from iterserve.model.loader import load_model
from tiny_families import ENGINE_FAMILIES, SMALL_VOCAB, engine_family_model, family_checkpoint


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_peer_model_from_gguf_is_the_original(
    name: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Past Phi-3's original context and Gemma's window. The mixture-of-experts families from
    their HF directory's loaded weights (what their GGUFs load to: tests/model/test_moe.py),
    through from_loaded."""
    original = engine_family_model(name, gguf=True)
    kind = "hf" if name in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "lfm2_moe") else "f32"
    path = family_checkpoint(kind, original, tmp_path, tokenizer_dir)
    if kind == "hf":
        loaded = load_model(path, torch.float32)
        peer = from_loaded(loaded.config, loaded.weights, torch.float32)
    else:
        peer, _ = load_transformers_model(str(path), "float32")
    assert type(peer) is type(original)
    rng = random.Random(7)
    tokens = torch.tensor([[rng.randrange(SMALL_VOCAB) for _ in range(80)]])
    with torch.inference_mode():
        want, got = original(tokens).logits, peer(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
