"""A vision projector file as llama.cpp writes one (`mmproj-*.gguf`): its metadata and
tensors, read by transformers' names (the gguf package's map, the converter's own), into a
family's tower and projector (model/gguf_images.py says which families)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import gguf
import torch

from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_loader import GGUFTensorInfo, read_gguf_tensor


class ReadsParts(Protocol):
    """An image encoder whose modules a checkpoint keeps under prefixes (model/images.py)."""

    @property
    def parts(self) -> dict[str, torch.nn.Module]: ...


class ProjectorFile:
    """A projector file's metadata and tensors, read by transformers' names: `name_of` gives
    the file's name for a checkpoint's tensor (llama.cpp's converter's map by default)."""

    def __init__(
        self,
        path: Path,
        metadata: dict[str, Any],
        tensors: dict[str, GGUFTensorInfo],
        name_of: Callable[[str, Any], str | None] | None = None,
    ) -> None:
        self.path, self.metadata, self.tensors = path, metadata, tensors
        self.name_of = name_of or llama_cpp_name

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
        images: ReadsParts,
        layers: int,
        theirs: Callable[[str, str], str],
        value: Callable[[str, torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
        name_of: Callable[[str, Any], str | None] | None = None,
    ) -> None:
        """Each part's tensors from the file: `theirs(prefix, name)` is the name the released
        checkpoint gives the module's tensor `name`; `value(name, tensor)` undoes what the
        converter did to it; `name_of`: the family's own naming, over the file's.

        Each tensor is read into the module's own in turn, never a second copy of the tower
        beside it (a Qwen2.5-VL 3B's is 1.3 GB in bf16: its load's peak RSS was 1.3 GiB
        over the held before, benchmarks/image_prompt.py --family qwen25vl)."""
        name_of = name_of or self.name_of
        names = mmproj_names(layers)
        for prefix, module in images.parts.items():
            for name, into in module.state_dict().items():  # the module's own storage
                hf = theirs(prefix, name)
                found = name_of(hf, names)
                if found is None or found not in self.tensors:
                    raise ModelLoadError(f"{self.path}: no tensor for {hf} ({found or 'unmapped'})")
                read = value(name, read_gguf_tensor(self.tensors[found]).float())
                if read.shape != into.shape:
                    raise ModelLoadError(
                        f"{self.path}: {found} is {list(read.shape)}, the tower's {hf} "
                        f"{list(into.shape)}"
                    )
                with torch.no_grad():
                    into.copy_(read.to(dtype))


@functools.lru_cache(maxsize=4)
def mmproj_names(layers: int) -> gguf.TensorNameMap:
    """The converter's map of a tower of `layers` blocks (it numbers the projector's
    linear_N as blocks too: it must reach 2)."""
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(layers, 3))


def llama_cpp_name(hf: str, names: Any) -> str | None:
    """A checkpoint's tensor's name in llama.cpp's file: its converter's map (which names
    Gemma 3's projector parameter as a module's weight)."""
    hf = hf.replace("_projection_weight", "_projection.weight")
    return names.get_name(hf, try_suffixes=(".weight", ".bias"))
