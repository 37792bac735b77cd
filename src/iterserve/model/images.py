"""What a multimodal checkpoint's images become: the placeholder tokens an image takes in a
prompt and the rows the model reads at them, made by the family's vision tower and
projector (model/image_encoders.py says which). The language model runs them as given input rows
(core/request.py PromptEmbeds; engine/images.py puts prompts together)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image


@dataclass(frozen=True)
class EncodedImage:
    """One image as the language model takes it: the tokens it takes in the prompt, and a
    row for each of them that is the image token, in order (the others, a row's break or
    the image's end, are read as tokens)."""

    token_ids: tuple[int, ...]
    rows: torch.Tensor  # [number of image tokens among token_ids, hidden]


class ImageEncoder(Protocol):
    """A family's images: `marker`, the text its chat template writes where an image goes;
    `image_token_id`, the placeholder the rows are read at."""

    marker: str
    image_token_id: int

    def encode(self, image: Image.Image) -> EncodedImage: ...
