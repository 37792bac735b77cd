"""The vision projector file benchmarks/image_prompt.py times llama.cpp and iterserve on:
written as llama.cpp's converter writes Gemma 3's, it is what iterserve reads (a tower and
projector of its shape, an image encoded to its pooled rows, finite)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from iterserve.bench.shaped_mmproj import TowerShape, write_shaped_mmproj
from iterserve.model.gguf_images import load_mmproj
from tiny_vision import gemma3_tokenizer, picture

SHAPE = TowerShape(32, 64, 2, 2, image_size=112, patch_size=14, text_hidden=48)


def test_the_shaped_file_reads_as_gemma3s_tower(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = write_shaped_mmproj(tmp_path / "mmproj.gguf", SHAPE, seed=3)
    text = SimpleNamespace(hidden_size=SHAPE.text_hidden)
    images = load_mmproj(path, text, gemma3_tokenizer(tokenizer_dir), torch.float32)  # type: ignore[arg-type]
    assert images.tower.config.num_hidden_layers == 2
    encoded = images.encode(picture(1, 50, 70))
    assert encoded.rows.shape == (4, SHAPE.text_hidden)  # 8 x 8 patches pooled 4 x 4
    assert encoded.text.count("<image_soft_token>") == 4
    assert bool(torch.isfinite(encoded.rows).all())
