"""What a multimodal checkpoint's images become: the placeholder tokens an image takes in a
prompt and the rows the model reads at them, made by the family's vision tower and
projector (model/image_encoders.py says which). The language model runs them as given input rows
(core/request.py PromptEmbeds; engine/images.py puts prompts together)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image

from iterserve.model.errors import ModelLoadError
from iterserve.model.safetensors_file import stored_tensors

_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True)
class EncodedImage:
    """One image as the language model takes it: the text that stands for it in the prompt,
    as the family's processor writes it (special tokens), and a row for each image token
    in it, in order (its other tokens, a row's break or the image's end, are read as
    tokens)."""

    text: str
    # [image tokens in `text`, hidden], or [tokens, hidden x (1 + layers)] where the family
    # adds rows to the stream after its first layers too (Qwen3-VL's DeepStack; each row's
    # input row first: model/llama.py `_given_parts`).
    rows: torch.Tensor
    # (rows, columns) of its tokens where they turn by grid positions (M-RoPE: Qwen3-VL's,
    # Qwen2.5-VL's; core/request.py PromptEmbeds.grids); None: by their positions.
    grid: tuple[int, int] | None = None


class ImageEncoder(Protocol):
    """A family's images: `marker`, the text its chat template writes where an image goes;
    `image_token_id`, the placeholder the rows are read at; `bidirectional`, whether an
    image's tokens attend to each other both ways (Gemma 3's) rather than causally."""

    marker: str
    image_token_id: int
    bidirectional: bool

    def encode(self, image: Image.Image) -> EncodedImage: ...

    def placeholder(self, image: Image.Image) -> str:
        """`encode(image).text`, without the tower: what a prompt's tokens are counted by."""
        ...

    def cap_rows(self, most: int) -> int:
        """Make an image at most `most` rows (the tower's outputs, not the layout's other
        tokens) where the family can; the most an image now takes."""
        ...


class TowerAndProjector:
    """What the families' encoders share: a vision tower and a projector, each kept by a
    checkpoint under its own prefix."""

    tower: torch.nn.Module
    projector: torch.nn.Module

    @property
    def parts(self) -> dict[str, torch.nn.Module]:
        """The modules, by where a checkpoint keeps their tensors (read_tower_weights)."""
        return {"vision_tower.": self.tower, "multi_modal_projector.": self.projector}


def built_in(cls: type[Any], config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers tower built straight in `dtype`, for inference: built in fp32 and then
    cast, a Qwen2.5-VL 3B's (0.67 B parameters) held 2.7 GB at once for nothing."""
    return cls._from_config(config, dtype=dtype).eval()


def read_tower_weights(
    directory: Path, modules: Mapping[str, torch.nn.Module], dtype: torch.dtype
) -> None:
    """Load each module's weights from the checkpoint's tensors under its prefix
    (`{"vision_tower.": tower}`; transformers 5's own saves put them under `model.` too),
    each read into the module's own storage in turn (no second copy of a tower beside it);
    ModelLoadError when they do not fit."""
    targets = {prefix: module.state_dict() for prefix, module in modules.items()}
    unread = {prefix: set(target) for prefix, target in targets.items()}
    unexpected: dict[str, list[str]] = {prefix: [] for prefix in modules}
    for path in sorted(directory.glob("*.safetensors")):
        for name, stored in stored_tensors(path).items():
            for prefix, module in modules.items():
                under = next((u for u in (prefix, "model." + prefix) if name.startswith(u)), None)
                if under is None:
                    continue
                key = _module_key(module, name.removeprefix(under))
                into = targets[prefix].get(key)
                if into is None or tuple(into.shape) != stored.shape:
                    unexpected[prefix].append(key)
                    continue
                with torch.no_grad():
                    into.copy_(stored.read().to(dtype))
                unread[prefix].discard(key)
    for prefix, module in modules.items():
        if unread[prefix] or unexpected[prefix]:
            raise ModelLoadError(
                f"{directory}: the tensors under {prefix} do not fit the model's "
                f"{type(module).__name__} (missing {sorted(unread[prefix])[:3]}, unexpected or "
                f"mis-shaped {unexpected[prefix][:3]})"
            )


def _module_key(module: torch.nn.Module, key: str) -> str:
    """A checkpoint's name for one of `module`'s tensors as the module names it: released
    files keep SigLIP's under `vision_model.`, which transformers 5's module drops."""
    inner = getattr(module, "base_model_prefix", "") + "."
    return key.removeprefix(inner) if inner != "." and key.startswith(inner) else key


def image_tokens(tokenizer: Any, ids: list[int], directory: Path) -> tuple[str, ...]:
    """The model's image tokens (by their ids in its config) as its tokenizer names them;
    ModelLoadError where the tokenizer does not hold them."""
    tokens = tokenizer.convert_ids_to_tokens(ids)
    if any(token is None for token in tokens) or tokenizer.convert_tokens_to_ids(tokens) != ids:
        raise ModelLoadError(
            f"{directory}: the tokenizer does not hold the model's image tokens {ids}"
        )
    return tuple(tokens)


def family_config(config_class: type[Any], raw: Mapping[str, Any]) -> Any:
    """A multimodal checkpoint's whole config.json as transformers' config of its class."""
    return config_class(**{k: v for k, v in raw.items() if k != "model_type"})


def has_image_processor(directory: Path) -> bool:
    """Whether the checkpoint says how its images are prepared: preprocessor_config.json,
    or a processor_config.json holding it (transformers 5 saves it there)."""
    return any((directory / name).exists() for name in _PROCESSOR_FILES)
