"""A LoRA adapter's weights, read from a PEFT directory or a llama.cpp LoRA GGUF and checked
against the model before anything is loaded.

An adapter changes a projection W (out x in) by scale * B @ A, with A (r x in) and B (out x r).
Both files store exactly those two matrices per adapted module (a GGUF's `lora_a` is A, its
`lora_b` is B: llama.cpp stores A untransposed); the scale is PEFT's alpha / r, or
alpha / sqrt(r) with rsLoRA. The scale is folded into B here, once.

Names are the HF checkpoint's module paths (`model.layers.3.self_attn.q_proj`), the same the
model's projections are built from (their `WeightPart.name` less `.weight`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_loader import (
    hf_tensor_name,
    permutes_rope_rows,
    read_gguf_header,
    read_gguf_tensor,
    unpermute_rope_rows,
)
from iterserve.model.model_source import find_adapter


class LoRAError(ValueError):
    """An adapter that cannot serve this model (a bad path, another base, a rank over the
    limit): the message says which and why."""


@dataclass(frozen=True)
class LoRAModule:
    """One adapted projection: A (r x in) and B (out x r) with the scale folded into B."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class AdapterWeights:
    """Every module an adapter changes, by HF module path."""

    modules: dict[str, LoRAModule]

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())


# PEFT's tensor names: base_model.model.<module path>.lora_A.weight (or .lora_B.weight).
_PEFT_NAME = re.compile(r"base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight")


def load_adapter(path: str | Path, config: ModelConfig) -> AdapterWeights:
    """The adapter at `path`: a PEFT directory (adapter_config.json and
    adapter_model.safetensors) or a llama.cpp LoRA GGUF file, or either by its repository
    in the local Hugging Face cache (model/model_source.py)."""
    try:
        path = find_adapter(path)
    except ModelLoadError as error:
        raise LoRAError(f"no LoRA adapter at {str(path)!r}: {error}") from None
    if not path.exists():
        raise LoRAError(f"no LoRA adapter at {str(path)!r}: the path does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise LoRAError(
                f"{str(path)!r} is a file but not a GGUF; give a PEFT adapter's directory "
                "or a llama.cpp LoRA .gguf"
            )
        return _load_gguf(path, config)
    return _load_peft(path)


def _load_peft(path: Path) -> AdapterWeights:
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoRAError(f"{str(path)!r} has no adapter_config.json: not a PEFT adapter")
    if not weights_file.is_file():
        raise LoRAError(f"{str(path)!r} has no adapter_model.safetensors (the only weights read)")
    try:
        peft = json.loads(config_file.read_text())
        tensors = load_file(weights_file)
    except (OSError, ValueError) as error:
        raise LoRAError(f"{str(path)!r}: cannot read the adapter ({error})") from None
    kind = peft.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAError(f"{str(path)!r} is a {kind} adapter; only LoRA adapters are served")
    for key, meaning in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if peft.get(key):
            raise LoRAError(f"{str(path)!r}: {meaning} is not supported")
    if peft.get("bias", "none") != "none" or peft.get("modules_to_save"):
        raise LoRAError(
            f"{str(path)!r} trains biases or whole modules (bias, modules_to_save); only the "
            "LoRA matrices of linear projections are served"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _PEFT_NAME.fullmatch(name)
        if match is None:
            raise LoRAError(f"{str(path)!r}: tensor {name!r} is not a LoRA A or B matrix")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    alpha = float(peft.get("lora_alpha", peft.get("r", 8)))
    patterns: Mapping[str, float] = peft.get("alpha_pattern") or {}
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{str(path)!r}: module {module!r} lacks its lora_A or lora_B")
        rank = ab["A"].shape[0]
        a_alpha = next((float(v) for k, v in patterns.items() if module.endswith(k)), alpha)
        scale = a_alpha / (math.sqrt(rank) if peft.get("use_rslora") else rank)
        modules[module] = _module(ab["A"], ab["B"], scale, f"{path}: {module}")
    if not modules:
        raise LoRAError(f"{str(path)!r} holds no LoRA matrices")
    return AdapterWeights(modules)


def _load_gguf(path: Path, config: ModelConfig) -> AdapterWeights:
    """llama.cpp's LoRA GGUF (convert_lora_to_gguf.py): general.type "adapter", adapter.type
    "lora", adapter.lora.alpha, and per module `<base tensor>.lora_a` / `.lora_b`; scale
    alpha / r (alpha 0: scale 1, as llama.cpp reads it). The "llama" converter permuted the
    rows of q and k for its rope, B's rows with them: put back as the model's loader does."""
    try:
        metadata, tensors = read_gguf_header(path)
    except (OSError, ValueError, ModelLoadError) as error:
        raise LoRAError(f"{str(path)!r}: cannot read the GGUF ({error})") from None
    if metadata.get("general.type") != "adapter" or metadata.get("adapter.type") != "lora":
        raise LoRAError(f"{str(path)!r} is not a LoRA adapter GGUF (general.type 'adapter')")
    arch = str(metadata.get("general.architecture", "llama"))
    alpha = float(metadata.get("adapter.lora.alpha", 0.0))
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, info in tensors.items():
        stem, _, which = name.rpartition(".lora_")
        if which not in ("a", "b"):
            raise LoRAError(f"{str(path)!r}: tensor {name!r} is not a lora_a or lora_b")
        try:
            module = hf_tensor_name(stem, arch).removesuffix(".weight")
        except ModelLoadError:
            raise LoRAError(
                f"{str(path)!r}: tensor {name!r} adapts no projection of this model"
            ) from None
        tensor = read_gguf_tensor(info).float()
        short = module.rsplit(".", 1)[-1]
        if which == "b" and permutes_rope_rows(arch) and short in heads:
            tensor = unpermute_rope_rows(tensor, heads[short])
        pairs.setdefault(module, {})[which] = tensor
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"a", "b"}:
            raise LoRAError(f"{str(path)!r}: module {module!r} lacks its lora_a or lora_b")
        rank = ab["a"].shape[0]
        modules[module] = _module(ab["a"], ab["b"], alpha / rank if alpha else 1.0, module)
    if not modules:
        raise LoRAError(f"{str(path)!r} holds no LoRA matrices")
    return AdapterWeights(modules)


def _module(a: torch.Tensor, b: torch.Tensor, scale: float, where: str) -> LoRAModule:
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise LoRAError(f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not pair up")
    return LoRAModule(a.float().contiguous(), (b.float() * scale).contiguous())


def check_adapter(
    adapter: AdapterWeights, shapes: Mapping[str, tuple[int, int]], max_rank: int, where: str
) -> None:
    """Refuse an adapter this model cannot run: a module it does not have (`shapes`: each
    adaptable module's (out, in)), a shape of another base, or a rank over `max_rank`."""
    if adapter.rank > max_rank:
        raise LoRAError(
            f"{where} has rank {adapter.rank}, over --max-lora-rank {max_rank}; restart with "
            f"--max-lora-rank {adapter.rank} or more"
        )
    for module, weights in adapter.modules.items():
        shape = shapes.get(module)
        if shape is None:
            raise LoRAError(
                f"{where} adapts {module!r}, which this model has no projection of (an "
                "adapter for another base model, or of embeddings / the LM head, which are "
                "not served)"
            )
        got = (weights.b.shape[0], weights.a.shape[1])
        if got != shape:
            raise LoRAError(
                f"{where} changes {module!r} as a {got[0]}x{got[1]} projection but this "
                f"model's is {shape[0]}x{shape[1]}: an adapter for another base model"
            )
