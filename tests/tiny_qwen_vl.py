"""Tiny random Qwen3-VL and Qwen2.5-VL checkpoints with their vision towers, saved with the
bundled tokenizer plus Qwen's image tokens and Qwen's Pillow image processor (Qwen3-VL as
transformers saves it, Qwen2.5-VL as its released files are: its language model under
`model.*`, its tower under `visual.*`, its rope's type "mrope"); and what transformers' own
greedy generate makes of a prompt with images on them (fp32), built without iterserve's
code."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tiny_vision import TEXT_SHAPE, random_weights, template

# The image's pad token (what the chat template writes between the other two), its start
# and its end, as Qwen's tokenizer names them.
QWEN3VL_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
QWEN3VL_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
# 16-pixel patches merged 2 x 2: an image of up to 16 merged patches, of at least 2.
_FACTOR = 32
QWEN3VL_PIXELS = {"shortest_edge": 2 * _FACTOR**2, "longest_edge": 16 * _FACTOR**2}


def llama_cpp_pixels(factor: int) -> dict[str, int]:
    """llama.cpp's bounds for Qwen's towers (8 to 4,096 rows), which a projector file does
    not say, in pixels for rows of `factor` x `factor` (Qwen3-VL's 32, Qwen2.5-VL's 28)."""
    return {"shortest_edge": 8 * factor**2, "longest_edge": 4096 * factor**2}


def save_tiny_qwen3vl(
    out: Path, tokenizer_dir: Path, pixels: dict[str, int] = QWEN3VL_PIXELS
) -> Path:
    """Qwen3-VL's shape in small: Qwen3's layers turned by interleaved M-RoPE (a head's 16
    frequencies split 6, 5, 5 between time, height and width, as 2B's 64 are 24, 20, 20),
    and a tower whose first and third layers' rows are added after the language model's
    first two layers (DeepStack; the third layer gets none, as in the releases)."""
    tokenizer, (image, start, end) = _qwen_tokenizer(tokenizer_dir)
    rope = {
        "rope_type": "default",
        "rope_theta": 100.0,  # a base this low turns each frequency by a grid's few positions
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    }
    text = transformers.Qwen3VLTextConfig(
        **{**TEXT_SHAPE, "num_hidden_layers": 3, "vocab_size": len(tokenizer)},
        max_position_embeddings=1024,
        rope_parameters=rope,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = transformers.models.qwen3_vl.Qwen3VLVisionConfig(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=TEXT_SHAPE["hidden_size"],
        num_position_embeddings=64,  # an 8 x 8 grid, resampled to each image's
        deepstack_visual_indexes=[0, 2],
    )
    config = transformers.Qwen3VLConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=image,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    random_weights(transformers.Qwen3VLForConditionalGeneration(config)).save_pretrained(out)
    tokenizer.chat_template = template(QWEN3VL_MARKER)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(
        patch_size=16, size=pixels, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(out)
    return out


def _qwen_tokenizer(tokenizer_dir: Path) -> tuple[Any, list[int]]:
    """The bundled tokenizer with Qwen's image tokens, and their ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN3VL_TOKENS)})
    return tokenizer, tokenizer.convert_tokens_to_ids(list(QWEN3VL_TOKENS))


def save_tiny_qwen25vl(out: Path, tokenizer_dir: Path) -> Path:
    """Qwen2.5-VL's shape in small: Qwen2's layers (q/k/v biases) turned by M-RoPE whose
    frequencies take a run each (a head's 16 split 4, 6, 6, as 3B's 64 are 16, 24, 24); a
    tower of 14-pixel patches whose layers attend within windows of 4 x 4 patches, but the
    last, which sees the whole image (window_size 56 pixels, fullatt_block_indexes [2]);
    saved as the released files are."""
    tokenizer, (image, start, end) = _qwen_tokenizer(tokenizer_dir)
    # A base this low turns each frequency by a grid's few positions (1e6's hardly would).
    rope = {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [4, 6, 6]}
    shape = {k: v for k, v in TEXT_SHAPE.items() if k != "head_dim"}  # hidden / heads: 32
    text = transformers.Qwen2_5_VLTextConfig(
        **shape, vocab_size=len(tokenizer), max_position_embeddings=1024,
        rope_parameters=rope, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vision = Qwen2_5_VLVisionConfig(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
        out_hidden_size=TEXT_SHAPE["hidden_size"], window_size=56, fullatt_block_indexes=[2],
    )  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=image,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    random_weights(transformers.Qwen2_5_VLForConditionalGeneration(config)).save_pretrained(out)
    _as_released(out)
    tokenizer.chat_template = template(QWEN3VL_MARKER)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(
        patch_size=14,
        size={"shortest_edge": 2 * 28 * 28, "longest_edge": 16 * 28 * 28},
    ).save_pretrained(out)  # CLIP's mean and deviation, as the releases'
    return out


def _as_released(out: Path) -> None:
    """Rename a transformers 5 save of Qwen2.5-VL to the released files' tensor names and
    rope spelling."""
    tensors = load_file(out / "model.safetensors")
    renamed = {}
    for name, value in tensors.items():
        for ours, theirs in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(ours):
                name = theirs + name.removeprefix(ours)
                break
        renamed[name] = value
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    rope = config["text_config"].pop("rope_parameters")
    config["text_config"]["rope_scaling"] = {
        "type": "mrope",
        "mrope_section": rope["mrope_section"],
    }
    config["text_config"]["rope_theta"] = rope["rope_theta"]
    (out / "config.json").write_text(json.dumps(config, indent=2))


def qwen_vl_greedy(
    directory: Path, text: str, images: list[Image.Image], max_tokens: int
) -> list[int]:
    """`text` holds <|image_pad|> once per image (between its start and end tokens); each
    becomes a pad a merged patch, as Qwen's processors lay it out, marked as an image's
    (mm_token_type_ids, by which transformers places the M-RoPE grid); the checkpoint's own
    class (Qwen3-VL's or Qwen2.5-VL's) generates."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    pad = tokenizer.convert_tokens_to_ids(QWEN3VL_TOKENS[0])
    pixels = Qwen2VLImageProcessorPil.from_pretrained(directory)(images=images, return_tensors="pt")
    ids: list[int] = []
    for i, piece in enumerate(text.split(QWEN3VL_TOKENS[0])):
        ids += tokenizer.encode(piece, add_special_tokens=False)
        if i < len(images):
            ids += [pad] * (int(pixels["image_grid_thw"][i].prod()) // 4)
    whole = json.loads((directory / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, whole).from_pretrained(directory, dtype=torch.float32)
    input_ids = torch.tensor([ids])
    generated = model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=(input_ids == pad).int(),
        pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
        do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0,
    )  # fmt: skip
    return generated[0, len(ids) :].tolist()


# What the converter names the merger's and the DeepStack mergers' parts.
_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def _mmproj_header(
    path: Path, model: transformers.PreTrainedModel, directory: Path, image_size: int, kind: str
) -> gguf.GGUFWriter:
    """A Qwen projector file's header as llama.cpp's converter starts it (MmprojModel's keys,
    then the projector's type); the family's own keys follow."""
    vision = model.config.vision_config
    processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type("mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.projection_dim", model.config.text_config.hidden_size)
    for key, value in {
        "image_size": image_size,
        "patch_size": vision.patch_size,
        "embedding_length": vision.hidden_size,
        "feed_forward_length": vision.intermediate_size,
        "block_count": vision.depth,
        "attention.head_count": vision.num_heads,
    }.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_array("clip.vision.image_mean", list(processor.image_mean))
    writer.add_array("clip.vision.image_std", list(processor.image_std))
    writer.add_string("clip.projector_type", kind)
    return writer


def _add_tower(
    writer: gguf.GGUFWriter,
    model: transformers.PreTrainedModel,
    name_of: Callable[[str], str],
    split_qkv: bool = False,
) -> None:
    """The tower's tensors in F32 under `name_of(its name)`, the patch embedding's 3D kernel
    ([out, in, 2 frames, p, p]) as its two frames' 2D kernels, with `split_qkv` the fused
    q/k/v as three (Qwen2.5-VL's); then the file closed."""
    for name, value in model.model.visual.state_dict().items():
        data = value.detach().float().numpy()
        if name == "patch_embed.proj.weight":
            writer.add_tensor("v.patch_embd.weight", np.ascontiguousarray(data[:, :, 0]))
            writer.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(data[:, :, 1]))
            continue
        pieces = {name: data}
        if split_qkv and ".qkv." in name:
            third = len(data) // 3
            pieces = {name.replace("qkv", part): data[i * third : (i + 1) * third]
                      for i, part in enumerate("qkv")}  # fmt: skip
        for piece, array in pieces.items():
            writer.add_tensor(name_of(piece), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_qwen3vl_mmproj(
    path: Path, model: transformers.Qwen3VLForConditionalGeneration, directory: Path
) -> None:
    """The model's tower as llama.cpp's converter writes Qwen3-VL's vision projector file
    (qwen3vl_merger: its names and metadata; the patch embedding's 3D kernel as its two
    frames' 2D kernels; each DeepStack merger under its tower layer's number), every tensor
    in F32."""
    vision = model.config.vision_config
    side = int(vision.num_position_embeddings**0.5)  # the converter's image size: the grid's
    writer = _mmproj_header(path, model, directory, side * vision.patch_size, "qwen3vl_merger")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.spatial_merge_size", vision.spatial_merge_size)
    eps = model.config.text_config.rms_norm_eps
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", eps)
    deepstack = [i in vision.deepstack_visual_indexes for i in range(vision.depth)]
    writer.add_array("clip.vision.is_deepstack_layers", deepstack)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision.depth, 3))

    def name_of(name: str) -> str:
        parts = name.split(".")
        if parts[0] == "merger":
            return ".".join((_MERGER[parts[1]], *parts[2:]))
        if parts[0] == "deepstack_merger_list":
            layer = vision.deepstack_visual_indexes[int(parts[1])]
            return ".".join(("v.deepstack", str(layer), _DEEPSTACK[parts[2]], *parts[3:]))
        found = names.get_name("visual." + name, try_suffixes=(".weight", ".bias"))
        assert found is not None, name
        return found

    _add_tower(writer, model, name_of)


def write_qwen25vl_mmproj(
    path: Path, model: transformers.Qwen2_5_VLForConditionalGeneration, directory: Path
) -> None:
    """The model's tower as llama.cpp's converter writes Qwen2.5-VL's vision projector file
    (qwen2.5vl_merger: its names and metadata, the whole-image layers by their period
    `n_wa_pattern`; the fused q/k/v split in three, the patch embedding's 3D kernel as its
    two frames' 2D kernels), every tensor in F32."""
    vision = model.config.vision_config
    # The converter's default image size (the config has none).
    writer = _mmproj_header(path, model, directory, 560, "qwen2.5vl_merger")
    writer.add_bool("clip.use_silu", True)
    writer.add_uint32("clip.vision.n_wa_pattern", vision.fullatt_block_indexes[0] + 1)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision.depth, 3))

    def name_of(name: str) -> str:
        found = names.get_name("visual." + name, try_suffixes=(".weight", ".bias"))
        assert found is not None, name
        return found

    _add_tower(writer, model, name_of, split_qkv=True)
