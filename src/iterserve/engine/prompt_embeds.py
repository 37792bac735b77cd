"""Prompts given as the model's input rows rather than text or tokens: vLLM's prompt_embeds.

A caller that has the rows a prompt's tokens would be embedded into (transformers'
`model.get_input_embeddings()(ids)`), or rows of its own making (a soft prompt, another
encoder's output projected to the hidden size), gives them as a [tokens, hidden] tensor:
offline as `{"prompt_embeds": tensor}`, over the API as /v1/completions' `prompt_embeds`,
base64 of the tensor as `torch.save` writes it. The engine runs them where the layers would
read the token embeddings (model/llama.py `_layers`), behind placeholder token ids, and
names their blocks in the prefix cache by the rows' content (core/request.py PromptEmbeds).

The rows are what transformers' `inputs_embeds` takes for the same model: Gemma's come
scaled (its embedding module scales its own output), Granite's are scaled here as its forward
scales them (ModelConfig.given_rows_scale). What the rows cannot give is refused by name:
prompt logprobs and echo (no tokens to score or print), per-layer inputs looked up by token id
(Gemma 4 E2B/E4B), an embedding or scoring request, and tensor parallelism (config.py).
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass

import torch

from iterserve.core.request import PromptEmbeds
from iterserve.sampling_params import InvalidRequestError

FIELD = "prompt_embeds"


@dataclass(frozen=True, eq=False)
class EmbedsPrompt:
    """vLLM's EmbedsPrompt: a prompt as input rows, [tokens, hidden] (or [1, tokens,
    hidden])."""

    prompt_embeds: torch.Tensor

    @property
    def num_rows(self) -> int:
        """The prompt's length in positions."""
        return int(self.prompt_embeds.shape[-2]) if self.prompt_embeds.dim() >= 2 else 0


def decode_prompt_embeds(text: str, field: str = FIELD) -> torch.Tensor:
    """A tensor sent as base64 of `torch.save`'s bytes; read with torch.load's weights_only,
    which unpickles tensors and plain containers only. InvalidRequestError naming `field`."""
    try:
        data = base64.b64decode(text, validate=True)
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # any bytes may come: whatever cannot be read is the client's
        raise InvalidRequestError(
            f"{field}: not base64 of a tensor saved by torch.save ({error})", field
        ) from None
    if not isinstance(value, torch.Tensor):
        raise InvalidRequestError(f"{field}: holds a {type(value).__name__}, not a tensor", field)
    return value


def checked_rows(
    rows: torch.Tensor, hidden_size: int, dtype: torch.dtype, field: str = FIELD
) -> torch.Tensor:
    """The rows as the layers take them: [tokens, hidden] in the model's dtype, contiguous,
    on the CPU; InvalidRequestError naming `field` for a shape, type or value they cannot
    be."""
    if rows.dim() == 3 and rows.size(0) == 1:
        rows = rows[0]
    if rows.dim() != 2 or rows.size(1) != hidden_size:
        raise InvalidRequestError(
            f"{field} must be [tokens, {hidden_size}] (the model's hidden size), got "
            f"{list(rows.shape)}",
            field,
        )
    if rows.size(0) == 0:
        raise InvalidRequestError(f"{field} holds no rows", field)
    if not rows.is_floating_point():
        raise InvalidRequestError(f"{field} must be floating point, got {rows.dtype}", field)
    rows = rows.detach().to("cpu", dtype).contiguous()
    if not bool(torch.isfinite(rows).all()):
        raise InvalidRequestError(f"{field} holds values that are not finite", field)
    return rows


def prompt_embeds(rows: torch.Tensor) -> PromptEmbeds:
    """The request's handle on checked rows: the rows, and their content's name."""
    digest = hashlib.sha256(str((rows.dtype, tuple(rows.shape))).encode())
    digest.update(rows.view(torch.uint8).numpy().tobytes())
    return PromptEmbeds(rows, digest.digest())
