"""A vision projector file as llama.cpp writes one (`mmproj-*.gguf`, `--mmproj`): the tower
and projector of the model beside it, made into the family's image encoder
(model/images.py). Gemma 3's (`clip.projector_type` gemma3), Mistral 3's (pixtral: Ministral
3, Mistral Small 3.1/3.2), Gemma 4 E2B's and E4B's (gemma4v), Qwen3-VL's (qwen3vl_merger)
and Qwen2.5-VL's (qwen2.5vl_merger; model/gguf_qwen_vl.py) are read.

The file's tensors carry llama.cpp's names (`v.blk.N.attn_q`, `mm.input_projection`), which
the gguf package's own map (the converter's) gives for each of transformers' names; the
image's preparation comes from the file's metadata (`clip.vision.image_size`, its mean and
deviation), and the image tokens from the model's tokenizer. What the converter changed is
undone: Gemma's projector norm is stored as 1 + w (the one Gemma's RMS norm adds at run
time), Pixtral's q/k rows are permuted for llama.cpp's rope as a Llama's are, and Gemma 4's
patch projection is stored as a convolution's kernel, its clamps as one-value tensors."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.gemma3_images import Gemma3Images
from iterserve.model.gemma4_images import GEMMA4_TOKENS, Gemma4Images
from iterserve.model.gguf_loader import (
    GGUFTensorInfo,
    holds_ollama_tower,
    read_gguf_header,
    unpermute_rope_rows,
)
from iterserve.model.gguf_qwen_vl import read_qwen3vl, read_qwen25vl
from iterserve.model.images import ImageEncoder
from iterserve.model.pixtral_images import PIXTRAL_TOKENS, PixtralImages
from iterserve.model.projector_file import ProjectorFile, mmproj_names

_GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# llama.cpp's default: 64 x 64 patches pooled 4 x 4, 256 rows (Gemma 3 4B-27B).
_GEMMA3_POOL = 4


def load_mmproj(path: Path, text: ModelConfig, tokenizer: Any, dtype: torch.dtype) -> ImageEncoder:
    """The image encoder of `path`: a vision projector file, or a model GGUF that holds its
    tower too, as Ollama's Gemma 3 files do (read through the projector file's view)."""
    metadata, tensors = read_gguf_header(path)
    arch = metadata.get("general.architecture")
    if holds_ollama_tower(metadata):  # its v.* and mm.* tensors under Ollama's names
        file = _ollama_gemma3_view(path, metadata, tensors)
        return _gemma3(file, text, tokenizer, dtype)
    if arch != "clip":
        raise ModelLoadError(
            f"{path} is not a vision projector (its architecture is {arch!r}, not clip)"
        )
    # A file of one tower says its projector's type; one of a vision and an audio tower
    # (Gemma 4's), each tower's.
    kind = metadata.get("clip.projector_type", metadata.get("clip.vision.projector_type"))
    if kind not in _READERS:
        raise ModelLoadError(
            f"{path}: a {kind!r} projector; those read here: {', '.join(_READERS)}"
        )
    width = metadata.get("clip.vision.projection_dim")
    if width is not None and int(width) != text.hidden_size:
        raise ModelLoadError(
            f"{path}: its rows are {width} wide and the model's {text.hidden_size}: is it "
            "the projector of the model beside it?"
        )
    return _READERS[kind](ProjectorFile(path, metadata, tensors), text, tokenizer, dtype)


# What Ollama's converter (convert/convert_gemma3.go) renames in a checkpoint's tensor names
# for the tower and projector, in its order: at each place the first that fits.
_OLLAMA_GEMMA3_NAMES = (
    ("vision_tower.vision_model.embeddings", "v"),
    ("vision_tower.vision_model", "v"),
    ("encoder.layers", "blk"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.out_proj", "attn_output"),
    ("input_projection_weight", "input_projection.weight"),
    ("multi_modal_projector", "mm"),
)


def _ollama_name(hf: str, _names: Any = None) -> str:
    """A checkpoint's tensor's name in Ollama's file, replaced as Go's strings.Replacer
    replaces: left to right, without overlaps."""
    out, i = [], 0
    while i < len(hf):
        for old, new in _OLLAMA_GEMMA3_NAMES:
            if hf.startswith(old, i):
                out.append(new)
                i += len(old)
                break
        else:
            out.append(hf[i])
            i += 1
    return "".join(out)


def _ollama_gemma3_view(
    path: Path, metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo]
) -> ProjectorFile:
    """An Ollama Gemma 3 file's tower as a projector file: its `gemma3.vision.*` keys under
    clip's names, Gemma's mean and deviation (0.5, which Ollama's image processor uses and
    its file does not say), the pooling from `gemma3.mm.tokens_per_image`."""
    clip = {
        f"clip.vision.{key.removeprefix('gemma3.vision.')}": value
        for key, value in metadata.items()
        if key.startswith("gemma3.vision.")
    }
    clip["clip.vision.image_mean"] = clip["clip.vision.image_std"] = [0.5, 0.5, 0.5]
    clip["clip.vision.projection_dim"] = metadata.get("gemma3.embedding_length")
    if (rows := metadata.get("gemma3.mm.tokens_per_image")) is not None:
        side = int(clip.get("clip.vision.image_size", 0)) // int(
            clip.get("clip.vision.patch_size", 1)
        )
        clip["clip.vision.projector.scale_factor"] = side // max(1, math.isqrt(int(rows)))
    return ProjectorFile(path, clip, tensors, _ollama_name)


def _gemma3(
    file: ProjectorFile, text: ModelConfig, tokenizer: Any, dtype: torch.dtype
) -> Gemma3Images:
    key = file.key
    size, patch = int(key("image_size")), int(key("patch_size"))
    vision = transformers.SiglipVisionConfig(
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=int(key("attention.head_count")),
        image_size=size,
        patch_size=patch,
        layer_norm_eps=float(key("attention.layer_norm_epsilon")),
        vision_use_head=False,  # SigLIP's pooling head: not Gemma's (nor in the file)
    )
    pool = int(file.metadata.get("clip.vision.projector.scale_factor", _GEMMA3_POOL))
    ids = file.token_ids(tokenizer, _GEMMA3_TOKENS, "Gemma 3")
    config = transformers.Gemma3Config(
        text_config={"hidden_size": text.hidden_size},
        vision_config=vision.to_dict(),
        mm_tokens_per_image=(size // patch // pool) ** 2,
        boi_token_index=ids[0],
        eoi_token_index=ids[1],
        image_token_index=ids[2],
    )
    processor = Gemma3ImageProcessorPil(
        size={"height": size, "width": size},
        image_mean=list(key("image_mean")),
        image_std=list(key("image_std")),
    )
    images = Gemma3Images(config, processor, _GEMMA3_TOKENS, dtype)

    def theirs(prefix: str, name: str) -> str:
        # The released checkpoints keep SigLIP's under vision_model.
        return (f"{prefix}vision_model." if prefix == "vision_tower." else prefix) + name

    def value(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor - 1 if name.endswith("soft_emb_norm.weight") else tensor  # 1 + w stored

    file.load(images, vision.num_hidden_layers, theirs, value, dtype)
    return images


def _pixtral(
    file: ProjectorFile, text: ModelConfig, tokenizer: Any, dtype: torch.dtype
) -> PixtralImages:
    key = file.key
    size, patch = int(key("image_size")), int(key("patch_size"))
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    vision = transformers.PixtralVisionConfig(
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        head_dim=hidden // heads,
        image_size=size,
        patch_size=patch,
        # The base llama.cpp's code fixes for Pixtral's rope, as the checkpoints have it.
        rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"},
        hidden_act="silu" if file.metadata.get("clip.use_silu") else "gelu",
    )
    ids = file.token_ids(tokenizer, PIXTRAL_TOKENS, "Mistral 3")
    config = transformers.Mistral3Config(
        text_config={"hidden_size": text.hidden_size},
        vision_config=vision.to_dict(),
        image_token_id=ids[0],
        spatial_merge_size=int(file.metadata.get("clip.vision.spatial_merge_size", 1)),
        multimodal_projector_bias="mm.1.bias" in file.tensors,
        vision_feature_layer=-1,
    )
    processor = PixtralImageProcessorPil(
        size={"longest_edge": size},
        patch_size=patch,
        image_mean=list(key("image_mean")),
        image_std=list(key("image_std")),
    )
    images = PixtralImages(config, processor, dtype)

    def value(name: str, tensor: torch.Tensor) -> torch.Tensor:
        rope = name.endswith(("attention.q_proj.weight", "attention.k_proj.weight"))
        return unpermute_rope_rows(tensor, heads) if rope else tensor

    file.load(images, vision.num_hidden_layers, lambda prefix, name: prefix + name, value, dtype)
    return images


# What llama.cpp's converter renames in Gemma 4's tower before its map names a tensor, and the
# suffixes its map reads (the clipped linears' clamps among them).
_GEMMA4_RENAMES = (
    ("model.vision_tower.encoder.", "vision_model.model."),
    (".linear.weight", ".weight"),
)
_GEMMA4_SUFFIXES = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")


def gemma4_file_name(hf: str, layers: int) -> str:
    """A Gemma 4 checkpoint's tower or embedder tensor's name in llama.cpp's projector file
    (what bench/shaped_mmproj.py writes)."""
    found = _gemma4_name(hf, mmproj_names(layers))
    if found is None:
        raise ModelLoadError(f"no name in a projector file for {hf}")
    return found


def _gemma4_name(hf: str, names: Any) -> str | None:
    for old, new in _GEMMA4_RENAMES:
        hf = hf.replace(old, new)
    if hf.endswith(("layer_scalar", "position_embedding_table")):
        hf += ".weight"
    return names.get_name(hf, try_suffixes=_GEMMA4_SUFFIXES)


def _gemma4(
    file: ProjectorFile, text: ModelConfig, tokenizer: Any, dtype: torch.dtype
) -> Gemma4Images:
    """Gemma 4's tower (E2B, E4B: `gemma4v`). What the file says by its tensors rather than
    its keys is read from them: the position table's size, the clipped linears' clamps, the
    standardizing bias and scale."""
    key = file.key
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    patch = int(key("patch_size"))
    table = file.tensors.get("v.position_embd.weight")
    if table is None:
        raise ModelLoadError(f"{file.path}: no v.position_embd.weight")
    vision = transformers.Gemma4VisionConfig(
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        patch_size=patch,
        pooling_kernel_size=int(file.metadata.get("clip.vision.projector.scale_factor", 3)),
        position_embedding_size=int(table.shape[1]),  # [2, positions, hidden]
        rms_norm_eps=float(file.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        use_clipped_linears=any(name.endswith(".input_max") for name in file.tensors),
        standardize="v.std_bias" in file.tensors,
    )
    ids = file.token_ids(tokenizer, GEMMA4_TOKENS, "Gemma 4")
    config = transformers.Gemma4Config(
        text_config={"hidden_size": text.hidden_size},
        vision_config=vision.to_dict(),
        audio_config=None,
        image_token_id=ids[0],
        boi_token_id=ids[1],
        eoi_token_id=ids[2],
    )
    processor = Gemma4ImageProcessorPil(
        patch_size=patch,
        pooling_kernel_size=vision.pooling_kernel_size,
        image_mean=list(key("image_mean")),
        image_std=list(key("image_std")),
    )
    images = Gemma4Images(config, processor, GEMMA4_TOKENS, dtype)

    def value(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("_min", "_max")):
            return tensor.reshape(())  # a clamp, stored as one value
        if name == "patch_embedder.input_proj.weight":  # stored as a convolution's kernel
            return tensor.permute(0, 2, 3, 1).reshape(hidden, -1)
        return tensor

    def theirs(prefix: str, name: str) -> str:
        return f"model.{prefix}{name}"

    file.load(images, vision.num_hidden_layers, theirs, value, dtype, _gemma4_name)
    return images


_READERS: dict[str, Callable[..., ImageEncoder]] = {
    "gemma3": _gemma3,
    "pixtral": _pixtral,
    "gemma4v": _gemma4,
    "qwen3vl_merger": read_qwen3vl,
    "qwen2.5vl_merger": read_qwen25vl,
}
