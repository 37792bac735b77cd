"""The vision projector files benchmarks/image_prompt.py times llama.cpp and iterserve on:
written as llama.cpp's converter writes Gemma 3's, Mistral 3's, Gemma 4's and Qwen3-VL's, each is what
iterserve reads (a tower and projector of its shape, an image encoded to its rows, finite)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

from iterserve.bench.shaped_mmproj import TowerShape, write_shaped_mmproj
from iterserve.model.gguf_images import load_mmproj
from tiny_qwen_vl import QWEN3VL_TOKENS
from tiny_vision import GEMMA4_TOKENS, IMAGE_TOKENS, gemma3_tokenizer, picture

GEMMA3 = TowerShape("gemma3", 32, 64, 2, 2, image_size=112, patch_size=14, text_hidden=48)
PIXTRAL = TowerShape("pixtral", 32, 64, 2, 2, 112, 14, text_hidden=48, eps=1e-5, merge=2)


def test_the_shaped_file_reads_as_gemma3s_tower(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = write_shaped_mmproj(tmp_path / "mmproj.gguf", GEMMA3, seed=3)
    text = SimpleNamespace(hidden_size=GEMMA3.text_hidden)
    images = load_mmproj(path, text, gemma3_tokenizer(tokenizer_dir), torch.float32)  # type: ignore[arg-type]
    assert images.tower.config.num_hidden_layers == 2
    encoded = images.encode(picture(1, 50, 70))
    assert encoded.rows.shape == (4, GEMMA3.text_hidden)  # 8 x 8 patches pooled 4 x 4
    assert encoded.text.count("<image_soft_token>") == 4
    assert bool(torch.isfinite(encoded.rows).all())


def test_the_shaped_file_reads_as_pixtrals_tower(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = write_shaped_mmproj(tmp_path / "mmproj.gguf", PIXTRAL, seed=3)
    text = SimpleNamespace(hidden_size=PIXTRAL.text_hidden)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    images = load_mmproj(path, text, tokenizer, torch.float32)  # type: ignore[arg-type]
    assert images.tower.config.num_hidden_layers == 2
    encoded = images.encode(picture(1, 56, 84))
    assert encoded.rows.shape == (2 * 3, PIXTRAL.text_hidden)  # 4 x 6 patches merged 2 x 2
    assert encoded.text == "[IMG]" * 3 + "[IMG_BREAK]" + "[IMG]" * 3 + "[IMG_END]"
    assert bool(torch.isfinite(encoded.rows).all())


def test_the_shaped_file_reads_as_gemma4s_tower(tmp_path: Path, tokenizer_dir: Path) -> None:
    shape = TowerShape(
        "gemma4v", 32, 64, 2, 2, 224, 16, text_hidden=48, merge=3,
        mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), positions=64,
    )  # fmt: skip
    path = write_shaped_mmproj(tmp_path / "mmproj.gguf", shape, seed=3)
    text = SimpleNamespace(hidden_size=shape.text_hidden)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA4_TOKENS)})
    images = load_mmproj(path, text, tokenizer, torch.float32)  # type: ignore[arg-type]
    assert images.tower.config.use_clipped_linears and images.tower.config.num_hidden_layers == 2
    encoded = images.encode(picture(1, 96, 96))
    assert encoded.text == images.placeholder(picture(1, 96, 96))
    assert encoded.rows.shape[1] == shape.text_hidden and bool(torch.isfinite(encoded.rows).all())


def test_the_shaped_file_reads_as_qwen3vls_tower(tmp_path: Path, tokenizer_dir: Path) -> None:
    shape = TowerShape(
        "qwen3vl_merger", 32, 64, 3, 2, 128, 16, text_hidden=48, merge=2, positions=64,
        deepstack=(0, 2),
    )  # fmt: skip
    path = write_shaped_mmproj(tmp_path / "mmproj.gguf", shape, seed=3)
    text = SimpleNamespace(hidden_size=shape.text_hidden, mrope_section=(6, 5, 5))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN3VL_TOKENS)})
    images = load_mmproj(path, text, tokenizer, torch.float32)  # type: ignore[arg-type]
    assert images.tower.config.deepstack_visual_indexes == [0, 2]
    encoded = images.encode(picture(1, 128, 96))  # 4 x 3 merged patches (8 at the least)
    assert encoded.grid == (4, 3) and encoded.text == "<|image_pad|>" * 12
    # Each row: its input row, then the two DeepStack mergers' rows.
    assert encoded.rows.shape == (12, 3 * shape.text_hidden)
    assert bool(torch.isfinite(encoded.rows).all())


def test_the_shaped_file_reads_as_qwen25vls_tower(tmp_path: Path, tokenizer_dir: Path) -> None:
    shape = TowerShape(
        "qwen2.5vl_merger", 32, 64, 4, 2, 560, 14, text_hidden=48, merge=2, window_period=2,
    )  # fmt: skip
    path = write_shaped_mmproj(tmp_path / "mmproj.gguf", shape, seed=3)
    text = SimpleNamespace(hidden_size=shape.text_hidden, mrope_section=(4, 6, 6))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN3VL_TOKENS)})
    images = load_mmproj(path, text, tokenizer, torch.float32)  # type: ignore[arg-type]
    assert images.tower.config.fullatt_block_indexes == [1, 3]
    encoded = images.encode(picture(1, 112, 84))  # 4 x 3 merged patches of 28 pixels
    assert encoded.grid == (4, 3) and encoded.rows.shape == (12, shape.text_hidden)
    assert bool(torch.isfinite(encoded.rows).all())
