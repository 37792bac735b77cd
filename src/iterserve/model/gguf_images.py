"""A vision projector file as llama.cpp writes one (`mmproj-*.gguf`, `--mmproj`): the tower
and projector of the model beside it, made into the family's image encoder
(model/images.py). Gemma 3's (`clip.projector_type` gemma3) and Mistral 3's (pixtral: Ministral
3, Mistral Small 3.1/3.2) are read.

The file's tensors carry llama.cpp's names (`v.blk.N.attn_q`, `mm.input_projection`), which
the gguf package's own map (the converter's) gives for each of transformers' names; the
image's preparation comes from the file's metadata (`clip.vision.image_size`, its mean and
deviation), and the image tokens from the model's tokenizer. What the converter changed is
undone: Gemma's projector norm is stored as 1 + w (the one Gemma's RMS norm adds at run
time), and Pixtral's q/k rows are permuted for llama.cpp's rope as a Llama's are."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import torch
import transformers
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.gemma3_images import Gemma3Images
from iterserve.model.gguf_loader import (
    GGUFTensorInfo,
    read_gguf_header,
    read_gguf_tensor,
    unpermute_rope_rows,
)
from iterserve.model.images import ImageEncoder, TowerAndProjector
from iterserve.model.pixtral_images import PIXTRAL_TOKENS, PixtralImages

_GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# llama.cpp's default: 64 x 64 patches pooled 4 x 4, 256 rows (Gemma 3 4B-27B).
_GEMMA3_POOL = 4


def load_mmproj(path: Path, text: ModelConfig, tokenizer: Any, dtype: torch.dtype) -> ImageEncoder:
    metadata, tensors = read_gguf_header(path)
    if metadata.get("general.architecture") != "clip":
        raise ModelLoadError(
            f"{path} is not a vision projector (its architecture is "
            f"{metadata.get('general.architecture')!r}, not clip)"
        )
    kind = metadata.get("clip.projector_type")
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
    return _READERS[kind](_ProjectorFile(path, metadata, tensors), text, tokenizer, dtype)


class _ProjectorFile:
    """A projector file's metadata and tensors, read by transformers' names."""

    def __init__(
        self, path: Path, metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo]
    ) -> None:
        self.path, self.metadata, self.tensors = path, metadata, tensors

    def key(self, name: str) -> Any:
        """`clip.vision.{name}`, which must be there."""
        if (value := self.metadata.get(f"clip.vision.{name}")) is None:
            raise ModelLoadError(f"{self.path}: clip.vision.{name} is missing")
        return value

    def token_ids(self, tokenizer: Any, tokens: tuple[str, ...], family: str) -> list[int]:
        """The ids of the family's image tokens in the model's tokenizer."""
        ids = tokenizer.convert_tokens_to_ids(list(tokens))
        if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids):
            raise ModelLoadError(
                f"{self.path}: the model's tokenizer has no {', '.join(tokens)}: is the model "
                f"beside it a {family}?"
            )
        return ids

    def load(
        self,
        images: TowerAndProjector,
        layers: int,
        theirs: Callable[[str, str], str],
        value: Callable[[str, torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
    ) -> None:
        """Each part's tensors from the file: `theirs(prefix, name)` is the name transformers'
        checkpoint gives the module's tensor `name`, as the converter read it; `value(name,
        tensor)` undoes what the converter did to it."""
        # The map numbers the projector's linear_N as blocks: it must reach 2.
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(layers, 3))
        for prefix, module in images.parts.items():
            state = {}
            for name in module.state_dict():
                hf = theirs(prefix, name)
                found = names.get_name(hf, try_suffixes=(".weight", ".bias"))
                if found is None or found not in self.tensors:
                    raise ModelLoadError(f"{self.path}: no tensor for {hf} ({found or 'unmapped'})")
                state[name] = value(name, read_gguf_tensor(self.tensors[found]).float()).to(dtype)
            module.load_state_dict(state, strict=True)


def _gemma3(
    file: _ProjectorFile, text: ModelConfig, tokenizer: Any, dtype: torch.dtype
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
        # SigLIP's under vision_model., the projector's parameter named as a module's weight.
        under = f"{prefix}vision_model." if prefix == "vision_tower." else prefix
        return (under + name).replace("_projection_weight", "_projection.weight")

    def value(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor - 1 if name.endswith("soft_emb_norm.weight") else tensor  # 1 + w stored

    file.load(images, vision.num_hidden_layers, theirs, value, dtype)
    return images


def _pixtral(
    file: _ProjectorFile, text: ModelConfig, tokenizer: Any, dtype: torch.dtype
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


_READERS: dict[str, Callable[..., ImageEncoder]] = {"gemma3": _gemma3, "pixtral": _pixtral}
