"""Prompts with images: text holding the model's image marker where each image goes, the
images, and how they become a request: each marker's image in its placeholder tokens
(model/images.py), the tower's rows given at the image tokens (core/request.py
PromptEmbeds), named in the prefix cache by the images' content.

vLLM's `{"prompt": ..., "multi_modal_data": {"image": ...}}` offline, OpenAI's `image_url`
content parts and Ollama's `images` in the server. An image is encoded once while it stays
among the last few encoded (a chat sends its images again at every turn): by the server on
a worker thread before the engine takes the request (AsyncEngine.add), offline as the
request is added."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from iterserve.core.request import PromptEmbeds
from iterserve.model.images import EncodedImage, ImageEncoder
from iterserve.sampling_params import InvalidRequestError

# Encoded images kept for the prompts that send them again: a chat's next turn.
_KEPT_IMAGES = 8
# Pillow's own bound on an image's pixels, below which it only warns; above it is refused.
_MAX_PIXELS = 64 * 1024 * 1024


@dataclass(frozen=True, eq=False)
class ImagesPrompt:
    """Text with the model's image marker once where each image goes (a chat template
    writes them), and the images. `rendered`: the text holds the model's special tokens
    already (a chat template's output), so none are added in encoding it."""

    text: str
    images: tuple[Image.Image, ...]
    rendered: bool = False
    # Each image's name and encoding, made ahead off the engine's thread (AsyncEngine.add):
    # None, they are made when the prompt is added.
    encoded: tuple[tuple[bytes, EncodedImage], ...] | None = None


@dataclass(frozen=True)
class ImagesInput:
    """An ImagesPrompt as the engine runs it: every token, and the rows given at the image
    tokens."""

    token_ids: list[int]
    embeds: PromptEmbeds


def image_from_bytes(data: bytes, field: str) -> Image.Image:
    """An image file's bytes (PNG, JPEG, WebP, GIF's first frame...) as a decoded image;
    InvalidRequestError naming `field` for bytes that are not one, or too large a one."""
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        raise InvalidRequestError(f"{field}: not an image file ({error})", field) from None
    if image.width * image.height > _MAX_PIXELS:  # before its pixels are decoded
        raise InvalidRequestError(
            f"{field}: an image of {image.width} x {image.height} pixels is over the "
            f"{_MAX_PIXELS} taken",
            field,
        )
    try:
        image.load()
    except (OSError, ValueError) as error:  # a header that reads, data that does not
        raise InvalidRequestError(f"{field}: not an image file ({error})", field) from None
    return image


def image_from_base64(text: str, field: str) -> Image.Image:
    """Ollama's `images`: each base64 of an image file."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{field}: not base64 of an image file", field) from None
    return image_from_bytes(data, field)


def image_from_url(url: str, field: str) -> Image.Image:
    """OpenAI's `image_url.url`: a data URL (`data:image/png;base64,...`). A file or web
    address is refused here: the server reads those into data URLs first, where its flags
    allow (server/image_urls.py)."""
    head, comma, body = url.partition(",")
    if not url.startswith("data:") or not comma:
        where = url.split(":", 1)[0] if ":" in url[:16] else "this"
        raise InvalidRequestError(
            f"{field}: give the image inline as a data URL (data:image/png;base64,...); "
            f"the server fetches no {where} URL",
            field,
        )
    if not head.endswith(";base64"):
        raise InvalidRequestError(f"{field}: a data URL of an image must be base64", field)
    return image_from_base64(body, field)


def _runs(token_ids: list[int], token: int) -> tuple[tuple[int, int], ...]:
    """Where `token` stands in `token_ids`, as (first, count) runs."""
    runs: list[tuple[int, int]] = []
    for position, found in enumerate(token_ids):
        if found != token:
            continue
        if runs and sum(runs[-1]) == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return tuple(runs)


class ImageInputs:
    """A model's images: ImagesPrompts made into ImagesInputs by its encoder."""

    def __init__(self, encoder: ImageEncoder, tokenizer: Any) -> None:
        self.encoder = encoder
        self.tokenizer = tokenizer
        self._kept: OrderedDict[bytes, EncodedImage] = OrderedDict()
        # The server encodes on worker threads, one image at a time (a tower's activations
        # are large, and two encodes on the same cores are no faster than one after another).
        self._lock = threading.Lock()
        # For /metrics: images the tower ran on, and for how long; images found kept.
        self.num_encoded = 0
        self.encode_seconds = 0.0
        self.num_reused = 0

    @property
    def marker(self) -> str:
        return self.encoder.marker

    def prompt(self, prompt: ImagesPrompt, field: str = "prompt") -> ImagesInput:
        pieces = self._pieces(prompt, field)  # checked before any image is encoded
        keys = hashlib.sha256()
        made = prompt.encoded or self.encode(prompt.images)
        for key, _ in made:
            keys.update(key)
        token_ids = self._tokenized(prompt, pieces, [encoded.text for _, encoded in made], field)
        rows = [encoded.rows for _, encoded in made]
        spans = _runs(token_ids, self.encoder.image_token_id)
        given = torch.cat(rows)
        if sum(count for _, count in spans) != len(given):  # the text held image tokens
            token = self.tokenizer.convert_ids_to_tokens(self.encoder.image_token_id)
            raise InvalidRequestError(
                f"{field}: the image token {token!r} stands where no image goes", field
            )
        grids = tuple(encoded.grid for _, encoded in made if encoded.grid is not None)
        if grids and [rows * columns for rows, columns in grids] != [n for _, n in spans]:
            # Two images' tokens run together, so neither's grid can be told apart.
            raise InvalidRequestError(
                f"{field}: each image's tokens must stand apart (the chat template writes "
                f"{self.marker!r} between an image's start and end tokens)",
                field,
            )
        embeds = PromptEmbeds(given, keys.digest(), spans, self.encoder.bidirectional, grids)
        return ImagesInput(token_ids, embeds)

    def token_ids(self, prompt: ImagesPrompt, field: str = "prompt") -> list[int]:
        """The prompt's token ids as `prompt` makes them, each image's laid out by its size
        alone, without the tower: what its tokens are counted by (/tokenize, Anthropic's
        count_tokens, the Responses API's truncation)."""
        pieces = self._pieces(prompt, field)
        placeholders = [self.encoder.placeholder(image) for image in prompt.images]
        return self._tokenized(prompt, pieces, placeholders, field)

    def _pieces(self, prompt: ImagesPrompt, field: str) -> list[str]:
        """The prompt's text around its markers, one marker an image."""
        pieces = prompt.text.split(self.marker)
        if len(pieces) != len(prompt.images) + 1:
            raise InvalidRequestError(
                f"{field}: {len(prompt.images)} images but {len(pieces) - 1} places for one "
                f"({self.marker} in the prompt, which the chat template writes for an image)",
                field,
            )
        return pieces

    def _tokenized(
        self, prompt: ImagesPrompt, pieces: list[str], texts: list[str], field: str
    ) -> list[int]:
        """The text `pieces` with each image's text between them, tokenized whole, as the
        family's processor encodes it (text next to an image may merge with its newlines)."""
        between = (text + piece for text, piece in zip(texts, pieces[1:], strict=True))
        whole = pieces[0] + "".join(between)
        try:
            return self.tokenizer.encode(whole, add_special_tokens=not prompt.rendered)
        except (TypeError, ValueError) as error:  # a lone surrogate, which JSON can carry
            raise InvalidRequestError(f"{field}: not valid Unicode text ({error})", field) from None

    def encode(self, images: Sequence[Image.Image]) -> tuple[tuple[bytes, EncodedImage], ...]:
        """Each image's name (its pixels' content) and its encoding, kept for a while; the
        tower's work, safe on any thread (the tokenizer is not touched)."""
        with self._lock:
            return tuple(self._encoded(image) for image in images)

    def _encoded(self, image: Image.Image) -> tuple[bytes, EncodedImage]:
        key = hashlib.sha256(f"{image.mode} {image.size}".encode())
        key.update(image.tobytes())
        name = key.digest()
        if (found := self._kept.get(name)) is not None:
            self._kept.move_to_end(name)
            self.num_reused += 1
            return name, found
        start = time.perf_counter()
        encoded = self.encoder.encode(image)
        self.num_encoded += 1
        self.encode_seconds += time.perf_counter() - start
        self._kept[name] = encoded
        if len(self._kept) > _KEPT_IMAGES:
            self._kept.popitem(last=False)
        return name, encoded
