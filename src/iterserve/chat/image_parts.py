"""A conversation's images: its messages' image content parts taken out and decoded, each
left as the `{"type": "image"}` part a chat template writes its model's image marker for
(Hugging Face's convention, which Mistral's, Gemma's and Qwen's templates read).

OpenAI's `{"type": "image_url", "image_url": {"url": "data:..."}}` (the offline chat
also takes vLLM's `{"type": "image_pil", "image_pil": image}`); the server turns Ollama's
`images` into such parts first. Images come in the order the template meets them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image

from iterserve.engine.images import image_from_url
from iterserve.sampling_params import InvalidRequestError

IMAGE_PART = {"type": "image"}
_IMAGE_TYPES = ("image_url", "image_pil")


def take_images(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[Mapping[str, Any]], list[Image.Image]]:
    """The messages with each image part as IMAGE_PART, and the images, decoded
    (InvalidRequestError naming the part for one that is not an image)."""
    images: list[Image.Image] = []
    taken: list[Mapping[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            taken.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if _is_image(part):
                images.append(_image_of(part, f"messages.{i}.content.{j}.{part['type']}"))
                parts.append(IMAGE_PART)
            else:
                parts.append(part)
        taken.append({**message, "content": parts})
    return taken, images


def _is_image(part: object) -> bool:
    return isinstance(part, Mapping) and part.get("type") in _IMAGE_TYPES


def _image_of(part: Mapping[str, Any], field: str) -> Image.Image:
    value = part.get(part["type"])
    if isinstance(value, Image.Image):
        return value
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str):
        raise InvalidRequestError(f"{field}: give the image as {{'url': 'data:...'}}", field)
    return image_from_url(url, field)


def first_image_field(messages: Sequence[Any]) -> str | None:
    """Where the first image part of the server's messages (chat/messages.py) is; None
    where there is none."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type in _IMAGE_TYPES:
                return f"messages.{i}.content.{j}.{part.type}"
    return None
