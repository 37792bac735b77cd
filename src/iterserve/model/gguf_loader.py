"""A GGUF model (llama.cpp's format: one file, or parts of one, model/gguf_parts.py) -> weights
in HF names, config and tokenizer."""

from __future__ import annotations

import functools
import logging
import mmap
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf.quants import dequantize

from iterserve.model.block_formats import BLOCK_FORMATS
from iterserve.model.config import GRANITE_FAMILIES, ModelConfig, rope_every_layer_but
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_blocks import GGUFBlocks, expert_slices, read_bytes
from iterserve.model.gguf_parts import first_part_name, model_stem, part_paths
from iterserve.model.lazy_weights import LazyWeights
from iterserve.model.loaded import LoadedModel
from iterserve.model.moe import EXPERT_NAMES, GGUF_ROUTER, gguf_expert_names
from iterserve.model.rope import UnsupportedRope, rotary_dims, served_rope
from iterserve.model.tokenizer import tokenizer_from_gguf
from iterserve.sampling_defaults import SamplingDefaults

logger = logging.getLogger("iterserve.gguf")

# Float types: nothing to keep quantized.
_FLOAT_TYPES = {"F32", "F16", "BF16"}

# GGUF architectures we can run, and the ModelConfig architecture each becomes. llama.cpp stores
# Mistral as "llama".
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral3": "ministral3",  # Ministral 3's text model (its vision tower: a separate mmproj)
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    # Qwen3-VL's language model: Qwen3's layers, its M-RoPE plain RoPE for text (all three
    # position components the token's); rope.dimension_sections splits a head's frequencies
    # between an image's grid positions (ModelConfig.mrope_section). Its deepstack layers
    # (the tower's rows added after the first layers) are the projector's to say.
    "qwen3vl": "qwen3",
    # Qwen2-VL's and Qwen2.5-VL's language model: Qwen2's layers, their M-RoPE's frequencies
    # a run each between an image's grid positions (rope.dimension_sections).
    "qwen2vl": "qwen2",
    "qwen3moe": "qwen3_moe",
    "qwen2moe": "qwen2_moe",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "granite": "granite",
    "granitemoe": "granitemoe",
    "olmoe": "olmoe",
    "olmo2": "olmo2",
    "exaone4": "exaone4",
    "lfm2": "lfm2",
    "lfm2moe": "lfm2_moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma4": "gemma4",  # its language model (the vision and audio towers: an mmproj)
    "gpt-oss": "gpt_oss",
}
# Tensors that are rope parameters, not weights: Llama 3's per-frequency divisors and Phi-3's
# longrope factors (read into ModelConfig.rope_scaling).
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# {arch}.rope.scaling.type values read (llama.cpp's names), and the YaRN keys whose non-default
# values would change the rotation in ways rope.py does not model.
_GGUF_ROPE_SCALING = ("none", "linear", "yarn")
# Architectures whose attention.sliding_window is read (Gemma's per layer, see _gemma_fields;
# OLMo 3's, written as olmo2, see _olmo3_fields; EXAONE 4.0's, _exaone4_fields).
_WINDOWED = ("phi3", "gemma2", "gemma3", "gemma4", "gpt-oss", "olmo2", "exaone4")
_YARN_UNMODELLED = ("yarn_ext_factor", "attn_factor")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "cls.output": "score",  # a reranker's classifier (model/score_head.py)
    "token_embd_norm": "model.norm",  # LFM2's final norm (HF's embedding_norm)
    # Gemma 4's per-layer embeddings (model/per_layer_inputs.py)
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Qwen2-MoE's shared expert and its gate (model/shared_expert.py)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# GGUF architectures whose layers all have experts, and the family each names ("llama" with
# an expert count is Mixtral, as llama.cpp stores it).
_MOE_FAMILIES = {
    "llama": "mixtral",
    "qwen3moe": "qwen3_moe",
    "qwen2moe": "qwen2_moe",
    "gpt-oss": "gpt_oss",
    "granitemoe": "granitemoe",
    "olmoe": "olmoe",
    "lfm2moe": "lfm2_moe",
    "gemma4": "gemma4",  # 26B-A4B: experts beside each layer's dense MLP
}
# Of those, the architectures whose files may also have no experts (a dense model).
_EXPERTS_OPTIONAL = ("llama", "gemma4")
# GGUF architectures of LFM2's hybrid layers: conv layers have no kv heads (head_count_kv 0).
_LFM2_ARCHITECTURES = ("lfm2", "lfm2moe")
# llama.cpp's expert_gating_func values (its llama_expert_gating_func_type) read for LFM2-MoE.
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
# gpt-oss: llama.cpp's ATTN_POST_NORM holds HF's post_attention_layernorm, the norm before
# the MLP (its files have no ffn_norm); its sinks are `attn_sinks.weight`, HF's
# `self_attn.sinks`.
_GPT_OSS_BLOCK_NAMES = {"post_attention_norm": "post_attention_layernorm"}
# llama.cpp's gpt-oss SwiGLU constants (its build_moe_ffn), which GGUF has no key for.
_GPT_OSS_SWIGLU_CLAMP = (1.702, 7.0)
# Gemma's sandwich norms (gguf-py's ATTN_POST_NORM, FFN_PRE_NORM, FFN_POST_NORM): its ffn_norm
# is HF's pre_feedforward_layernorm, and HF's post_attention_layernorm is the attention output's.
_GEMMA_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # Gemma 4 26B-A4B's norms of its experts' input and of its two MLPs' outputs
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    # Gemma 4's per-layer input gate, projection and norm
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
# Gemma 4's layer scalar: llama.cpp's blk.N.layer_output_scale.weight, HF's buffer
# model.layers.N.layer_scalar (no .weight).
_LAYER_SCALE = "layer_output_scale"
# llama.cpp's Gemma layouts: every n-th layer attends fully (its set_swa_pattern), and the
# sliding layers of Gemma 3 rotate with a plain base of 10000 unless the file says otherwise.
_GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
_GPT_OSS_WINDOW_PATTERN = 2
_OLMO3_WINDOW_PATTERN = 4  # llama.cpp's olmo2 with a window (OLMo 3): every 4th layer full
_EXAONE4_WINDOW_PATTERN = 4  # its config class's "LLLG": every 4th layer full
# gpt-oss's chat format (Harmony) ends an answer with <|return|> and a tool call with
# <|call|>; its GGUFs name one of them as eos.
_HARMONY_END_TOKENS = ("<|return|>", "<|call|>")
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# The layer counts of the 27B models, whose attention scale is 1/sqrt(hidden / heads) instead
# of 1/sqrt(head_dim): GGUF has no key for HF's query_pre_attn_scalar, and llama.cpp picks
# the scale by model size exactly so.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scale)")
# LFM2's conv layers (model/short_conv.py): blk.N.shortconv.{in_proj,conv,out_proj}.weight.
_SHORTCONV_TENSOR = re.compile(r"blk\.(\d+)\.shortconv\.(in_proj|conv|out_proj)\.weight")
# "SmolLM2-135M-Instruct.Q4_1", "Llama-3.1-8B-Instruct-Q4_K_M": the served name drops the quant.
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|BF16|FP?16|FP?32)$", re.IGNORECASE)

_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_U32, _U64 = _SCALARS[GGUFValueType.UINT32], _SCALARS[GGUFValueType.UINT64]


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major, as numpy and torch see it (GGUF stores it reversed)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in its file
    nbytes: int
    path: Path  # the file holding it: a split model's part


def load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    metadata, tensors = read_gguf_header(path)
    config = _config(metadata, tensors)
    weights, quantized = _load_weights(
        path, tensors, config, metadata["general.architecture"], dtype
    )
    tokenizer = tokenizer_from_gguf(metadata, path)
    loaded = LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        chat_template=metadata.get("tokenizer.chat_template"),
        name=_QUANT_SUFFIX.sub("", model_stem(path)),
        quantized=quantized,
        rerank_template=metadata.get("tokenizer.chat_template.rerank"),
        sampling_defaults=SamplingDefaults.from_gguf(metadata),
        file_format="gguf",
        file_type=_file_type(metadata.get("general.file_type")),
        projector_file=path if holds_ollama_tower(metadata) else None,
    )
    _one_score_row(loaded, metadata)
    return loaded


def _file_type(value: Any) -> str:
    """general.file_type as llama.cpp names it ("Q4_K_M", "F16"); "" where absent or unknown."""
    try:
        name = LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return ""
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _one_score_row(loaded: LoadedModel, metadata: dict[str, Any]) -> None:
    """llama.cpp's Qwen3-Reranker GGUF: `cls.output` holds the LM head's rows of "yes" and
    "no", whose softmax it takes; the score head is their difference (model/score_head.py)."""
    weights = loaded.weights
    if "score.weight" not in weights or weights.shape("score.weight")[0] != 2:
        return
    labels = metadata.get(f"{metadata['general.architecture']}.classifier.output_labels")
    if list(labels or []) != ["yes", "no"]:
        raise ModelLoadError(
            f"a GGUF classifier of two labels {labels} is not a yes/no reranker; iterserve "
            "scores with one row"
        )
    rows = weights["score.weight"]
    weights.add("score.weight", (1, rows.shape[1]), lambda: (rows[0] - rows[1]).reshape(1, -1))
    loaded.score_source = "the GGUF's cls.output rows of 'yes' and 'no'"
    loaded.classifier_labels = ["yes"]


def read_gguf_config(path: Path) -> ModelConfig:
    """A GGUF's model config alone, from its header (and rope tensors): no weights read."""
    return _config(*read_gguf_header(path))


def _config(metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo]) -> ModelConfig:
    return gguf_model_config(metadata, tensors, _read_rope_tensors(tensors))


def read_gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """A GGUF model's metadata and every tensor's place, without reading tensor data: the
    file's own, or, for the first part of a split model, the first part's metadata and the
    tensors of all its parts (each found in its own file, checked as llama.cpp checks them)."""
    metadata, tensors = _read_file_header(path)
    count = int(metadata.get("split.count", 1))
    if count <= 1:
        return metadata, tensors
    number = int(metadata.get("split.no", 0)) + 1
    if number != 1:
        raise ModelLoadError(
            f"{path.name} is part {number} of {count} of a split GGUF: load the model by its "
            f"first part, {first_part_name(path, number, count)}"
        )
    for number, part in enumerate(part_paths(path, count)[1:], start=2):
        if not part.is_file():
            raise ModelLoadError(
                f"{path.name} is part 1 of {count}: part {number}, {part}, is missing"
            )
        part_metadata, part_tensors = _read_file_header(part)
        found = (int(part_metadata.get("split.no", -1)) + 1, part_metadata.get("split.count"))
        if found != (number, count):
            raise ModelLoadError(
                f"{part} says it is part {found[0]} of {found[1]}, where {path.name} makes it "
                f"part {number} of {count}"
            )
        if repeated := tensors.keys() & part_tensors.keys():
            raise ModelLoadError(f"{part} repeats tensors of earlier parts: {sorted(repeated)[:3]}")
        tensors.update(part_tensors)
    expected = metadata.get("split.tensors.count")
    if expected is not None and expected != len(tensors):
        raise ModelLoadError(
            f"{path.name}'s {count} parts hold {len(tensors)} tensors where it says {expected}"
        )
    return metadata, tensors


def _read_file_header(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """One file's metadata and tensor table, without reading tensor data.

    gguf.GGUFReader does the same but wraps every string of the vocabulary in its own numpy
    memmap view, which takes ~5 s on the bundled file; struct over an mmap takes ~0.1 s (measured once).
    """
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic at its start)")
        reader = _Cursor(buf, 4)
        version = reader.scalar(GGUFValueType.UINT32)
        if version not in (2, 3):  # v1 has 32-bit counts; a big-endian file reads as a huge number
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
        try:
            tensor_count = reader.scalar(GGUFValueType.UINT64)
            kv_count = reader.scalar(GGUFValueType.UINT64)
            metadata = {reader.string(): reader.value() for _ in range(kv_count)}
            table = [reader.tensor_entry() for _ in range(tensor_count)]
        except (struct.error, ValueError) as error:  # past the end, or an unknown type code
            raise ModelLoadError(f"{path} is truncated or corrupt: {error}") from error
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in table:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block_size * type_size
        tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + offset, nbytes, path)
    return metadata, tensors


class _Cursor:
    """Sequential little-endian reads over the header part of a GGUF buffer."""

    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def scalar(self, value_type: int) -> Any:
        fmt = _SCALARS[value_type]
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        if value_type == GGUFValueType.FLOAT32:
            # The shortest decimal that is this float32: the 1e-05 the converter was given,
            # not 9.999999747378752e-06.
            value = float(str(np.float32(value)))
        return value

    def string(self) -> str:
        (length,) = _U64.unpack_from(self.buf, self.pos)
        start = self.pos + _U64.size
        self.pos = start + length
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, value_type: int | None = None) -> Any:
        if value_type is None:
            value_type = self.scalar(GGUFValueType.UINT32)
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            item_type = self.scalar(GGUFValueType.UINT32)
            count = self.scalar(GGUFValueType.UINT64)
            if item_type in _SCALARS:  # numbers in bulk: a vocabulary has ~10^5 of them
                fmt = _SCALARS[item_type].format
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos += struct.calcsize(f"<{count}{fmt[1]}")
                return values
            return [self.value(item_type) for _ in range(count)]
        return self.scalar(value_type)

    def tensor_entry(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self.string()
        n_dims = self.scalar(GGUFValueType.UINT32)
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
        self.pos += 8 * n_dims
        qtype = GGMLQuantizationType(self.scalar(GGUFValueType.UINT32))
        offset = self.scalar(GGUFValueType.UINT64)
        return name, tuple(reversed(dims)), qtype, offset


def _read_rope_tensors(tensors: dict[str, GGUFTensorInfo]) -> dict[str, list[float]]:
    found = {}
    for name in _ROPE_TENSORS:
        if (info := tensors.get(name)) is not None:
            if info.qtype != GGMLQuantizationType.F32:
                raise ModelLoadError(f"GGUF tensor {name} is {info.qtype.name}, not F32")
            found[name] = read_bytes(info.path, info.offset, info.nbytes).view(np.float32).tolist()
    return found


def _gguf_rope(
    metadata: dict[str, Any], arch: str, rope_tensors: dict[str, list[float]], context: int
) -> dict[str, Any]:
    """The file's RoPE scaling in HF terms (model/rope.py), from metadata and rope tensors."""
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in _GGUF_ROPE_SCALING:
        raise ModelLoadError(
            f"GGUF rope scaling {scaling_type!r} is not supported; supported: "
            f"{', '.join(_GGUF_ROPE_SCALING)}, Llama 3's rope_freqs and Phi-3's rope factors"
        )
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in rope_tensors:  # Phi-3 longrope
        rope: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": rope_tensors["rope_factors_long.weight"],
            "short_factor": rope_tensors["rope_factors_short.weight"],
            "original_max_position_embeddings": original or context,
        }
        # llama.cpp's converter stores the attention factor it computed (the same formula).
        if (attn_factor := metadata.get(f"{arch}.rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = float(attn_factor)
        return rope
    if "rope_freqs.weight" in rope_tensors:  # Llama 3.1+: the divisors llama.cpp applies
        if scaling_type != "none":
            raise ModelLoadError(f"GGUF rope_freqs together with rope scaling {scaling_type!r}")
        return {"rope_type": "freq_factors", "freq_factors": rope_tensors["rope_freqs.weight"]}
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling_type == "yarn":
        unmodelled = [
            k
            for k in _YARN_UNMODELLED
            if metadata.get(f"{arch}.rope.scaling.{k}") not in (None, 1.0)
        ]
        if unmodelled:
            raise ModelLoadError(f"GGUF YaRN settings {', '.join(unmodelled)} are not supported")
        rope = {"rope_type": "yarn", "factor": float(factor)}
        rope["original_max_position_embeddings"] = original or context
        if arch == "gpt-oss":
            # Trained with YaRN's ramp ends unrounded (transformers' truncate=False); llama.cpp
            # rounds them for every model.
            rope["truncate"] = False
        for beta in ("beta_fast", "beta_slow"):
            if (value := metadata.get(f"{arch}.rope.scaling.yarn_{beta}")) is not None:
                rope[beta] = float(value)
        # What llama.cpp's converter copies from the config's attention_factor (OLMo 3's:
        # YaRN's own 1 + 0.1 ln(factor)). llama.cpp 0.3.36 recomputes that from the factor
        # whatever the file says; the model was trained with the config's value.
        if (attention := metadata.get(f"{arch}.rope.scaling.yarn_attn_factor")) is not None:
            rope["attention_factor"] = float(attention)
        # Ministral 3's mscale_all_dim, which llama.cpp reads with an mscale of 1 (its
        # attention factor then mscale(1) / mscale(mscale_all_dim): 1 for Ministral 3's 1).
        if log_multiplier := metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier"):
            rope["mscale"], rope["mscale_all_dim"] = 1.0, float(log_multiplier)
        return rope
    return {}


def _gguf_served_rope(
    metadata: dict[str, Any],
    arch: str,
    tensors: dict[str, GGUFTensorInfo],
    rope_tensors: dict[str, list[float]] | None,
    context: int,
) -> tuple[dict[str, Any] | None, int]:
    """(the scaling iterserve applies, max positions served) from the file's rope metadata
    and tensors."""
    rope_tensors = rope_tensors or {}
    if missing := [n for n in _ROPE_TENSORS if n in tensors and n not in rope_tensors]:
        raise ModelLoadError(f"GGUF rope tensors {', '.join(missing)} were not read")
    try:
        return served_rope(_gguf_rope(metadata, arch, rope_tensors, context), context)
    except UnsupportedRope as error:
        raise ModelLoadError(f"{error}") from error


def _refuse_unsupported(
    metadata: dict[str, Any],
    tensors: dict[str, GGUFTensorInfo],
    arch: str,
    head_dim: int,
    experts: int,
) -> None:
    """ModelLoadError naming what a file of a supported architecture holds that iterserve
    does not run."""
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    rope_dims = metadata.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim and arch != "phi3":
        raise ModelLoadError(
            f"GGUF {arch!r} with rope over {rope_dims} of {head_dim} head dimensions (partial "
            "rotary) is not supported; only phi3 (Phi-4-mini) is"
        )
    if experts and arch not in _MOE_FAMILIES:
        raise ModelLoadError(
            f"GGUF {arch!r} with experts is not supported; only Mixtral, Qwen2-MoE, Qwen3-MoE, "
            "gpt-oss, Granite MoE, OLMoE, LFM2-MoE and Gemma 4 are"
        )
    if arch in _MOE_FAMILIES and arch not in _EXPERTS_OPTIONAL and not experts:
        raise ModelLoadError(f"GGUF {arch!r} file without {arch}.expert_count")
    if arch != "qwen2moe" and "blk.0.ffn_up_shexp.weight" in tensors:
        raise ModelLoadError(
            f"GGUF {arch!r} with a shared expert (ffn_*_shexp: Granite MoE's "
            "GraniteMoeSharedForCausalLM) is not supported; Qwen2-MoE's is"
        )
    first = int(metadata.get(f"{arch}.leading_dense_block_count", 0))  # LFM2-MoE's: dense
    stacks = (f"blk.{first}.ffn_gate_{s}exps.weight" for s in ("", "up_"))
    if experts and not any(name in tensors for name in stacks):
        raise ModelLoadError(
            "GGUF Mixtral files with one tensor per expert (blk.N.ffn_gate.E.weight, an old "
            "llama.cpp layout) are not supported; convert again to get ffn_*_exps tensors"
        )


def gguf_model_config(
    metadata: dict[str, Any],
    tensors: dict[str, GGUFTensorInfo],
    rope_tensors: dict[str, list[float]] | None = None,
) -> ModelConfig:
    """`rope_tensors`: the file's rope tensors (_ROPE_TENSORS) by name, read as float32."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", _FAMILY_DEFAULTS.get(arch, {}).get(name, default))
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{name}")
        return value

    context = key("context_length")
    rope_scaling, max_positions = _gguf_served_rope(metadata, arch, tensors, rope_tensors, context)
    hidden = key("embedding_length")
    heads = key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    experts = metadata.get(f"{arch}.expert_count", 0)
    gemma4 = _gemma4_fields(metadata, tensors, key("block_count")) if arch == "gemma4" else {}
    _refuse_unsupported(metadata, tensors, arch, head_dim, experts)
    rotary_dim = None
    if not gemma4:  # Gemma 4's: each kind of layer's whole heads (checked there)
        rotary_dim = _gguf_rotary_dim(metadata.get(f"{arch}.rope.dimension_count"), head_dim)
    eos_ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if arch == "gpt-oss":  # both of Harmony's ends of a turn, as llama.cpp finds them: by text
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        eos_ids += [i for i, token in enumerate(tokens) if token in _HARMONY_END_TOKENS]
    if gemma4:
        kv_heads, attends = gemma4.pop("num_key_value_heads"), None
        head_dim = gemma4.pop("head_dim")
    else:
        kv_heads, attends = _kv_heads(metadata, arch, key("attention.head_count_kv", heads))
    lfm2 = _lfm2_fields(metadata, arch, attends) if arch in _LFM2_ARCHITECTURES else {}
    if arch == "lfm2moe":
        lfm2 |= _lfm2_moe_fields(metadata, tensors)
    gemma: dict[str, Any] = {}
    if arch in _GEMMA_WINDOW_PATTERN:
        gemma = _gemma_fields(metadata, arch, key("block_count"), hidden // heads)
    window = metadata.get(f"{arch}.attention.sliding_window") if arch in _WINDOWED else None
    olmo3 = arch == "olmo2" and bool(window)
    family = _MOE_FAMILIES[arch] if experts else SUPPORTED_GGUF_ARCHITECTURES[arch]
    return ModelConfig(
        architecture="olmo3" if olmo3 else family,
        # The embedding's rows, not the token list: the weights must agree with the config, and
        # some files pad the embedding past the tokenizer's vocabulary.
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        # Qwen3-MoE's feed_forward_length is a dense MLP's width, which no layer has
        # (LFM2-MoE's leading dense layers' only).
        intermediate_size=gemma4.pop("intermediate_size", None)
        or key(
            "expert_feed_forward_length"
            if arch in ("qwen3moe", "qwen2moe", "gpt-oss", "lfm2moe")
            else "feed_forward_length"
        ),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        # SmolLM3: llama.cpp leaves RoPE out of every fourth layer (a fixed step, no key);
        # EXAONE 4.0's (_exaone4_fields) come with its windows.
        **(
            {"rope_layers": rope_every_layer_but(4, key("block_count"))}
            if arch == "smollm3"
            else {}
        ),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=_rope_base(metadata, arch),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        rope_scaling=rope_scaling,
        sliding_window=window,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        **(_granite_fields(metadata, arch) if arch in GRANITE_FAMILIES else {}),
        **(_gpt_oss_fields(metadata, key("block_count")) if arch == "gpt-oss" else {}),
        **(_olmo3_fields(metadata, key("block_count")) if olmo3 else {}),
        **(_exaone4_fields(metadata, key("block_count")) if arch == "exaone4" and window else {}),
        **_query_temperature(metadata, arch),
        **_mrope_fields(metadata, arch),
        num_local_experts=experts,
        num_experts_per_tok=key("expert_used_count") if experts else 0,
        # llama.cpp renormalises the top-k weights of every MoE family here but OLMoE's and
        # Qwen2-MoE's.
        norm_topk_prob=arch not in ("olmoe", "qwen2moe"),
        # Qwen2-MoE's shared expert: as wide as a dense MLP unless said (llama.cpp's n_ff_shexp).
        shared_expert_intermediate_size=(
            key("expert_shared_feed_forward_length", metadata.get(f"{arch}.feed_forward_length"))
            if arch == "qwen2moe"
            else 0
        ),
        **gemma,
        **gemma4,
        **lfm2,
    )


def _mrope_fields(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """Qwen-VL's M-RoPE: rope.dimension_sections (time, height, width, and a fourth
    llama.cpp keeps at 0); Qwen3-VL's frequencies take turns (llama.cpp's IMROPE),
    Qwen2-VL's and Qwen2.5-VL's a run each (MROPE)."""
    sections = metadata.get(f"{arch}.rope.dimension_sections")
    if arch not in ("qwen3vl", "qwen2vl") or not sections:
        return {}
    if len(sections) < 3 or any(sections[3:]):
        raise ModelLoadError(f"GGUF rope.dimension_sections {sections}: three are read")
    return {
        "mrope_section": tuple(int(n) for n in sections[:3]),
        "mrope_interleaved": arch == "qwen3vl",
    }


def _kv_heads(
    metadata: dict[str, Any], arch: str, counts: int | list[int]
) -> tuple[int, tuple[bool, ...] | None]:
    """head_count_kv: one number, or a count a layer as llama.cpp's converter writes hybrid
    models (LFM2: 0 on its conv layers; Granite 4.0 without Mamba layers: all alike, the file
    then a plain granite). The layers' one count, and which layers attend (None: all)."""
    if not isinstance(counts, list):
        return counts, None
    layers = metadata.get(f"{arch}.block_count")
    attends = tuple(c > 0 for c in counts)
    if (
        len(counts) != layers
        or len({c for c in counts if c}) != 1
        or (arch not in _LFM2_ARCHITECTURES and not all(attends))
    ):
        raise ModelLoadError(
            f"GGUF {arch}.attention.head_count_kv {counts}: layers of different kv heads, or "
            f"without attention, are not supported for {layers} {arch} layers"
        )
    return max(counts), attends


def _lfm2_fields(
    metadata: dict[str, Any], arch: str, attends: tuple[bool, ...] | None
) -> dict[str, Any]:
    """LFM2's conv layers, as llama.cpp's converter marks them (no kv heads: head_count_kv a
    list with 0 for each), and their width in tokens (shortconv.l_cache)."""
    if metadata.get(f"{arch}.attention.sliding_window"):
        # llama.cpp 0.3.36 windows every attention layer of such a file; transformers'
        # Lfm2Config has no window to check it against.
        raise ModelLoadError(f"GGUF {arch} with attention.sliding_window is not supported")
    layers = metadata[f"{arch}.block_count"]
    attends = attends or (True,) * layers
    kernel = metadata.get(f"{arch}.shortconv.l_cache")
    if kernel is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.shortconv.l_cache")
    return {"conv_layers": tuple(not a for a in attends), "conv_kernel": int(kernel)}


def _lfm2_moe_fields(
    metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo]
) -> dict[str, Any]:
    """LFM2-MoE as llama.cpp reads it: leading dense layers (leading_dense_block_count) as
    wide as feed_forward_length, a router by expert_gating_func (its converter writes
    sigmoid), the top-k weights always renormalised, a selection bias where the first layer
    of experts has one (exp_probs_b)."""
    dense = int(metadata.get("lfm2moe.leading_dense_block_count", 0))
    gating = metadata.get("lfm2moe.expert_gating_func")
    if gating not in _GATING_FUNCS:
        raise ModelLoadError(
            f"GGUF lfm2moe.expert_gating_func {gating!r} is not supported; supported: "
            + ", ".join(f"{code} ({name})" for code, name in _GATING_FUNCS.items())
        )
    return {
        "leading_dense_layers": dense,
        "dense_intermediate_size": int(metadata.get("lfm2moe.feed_forward_length", 0)),
        "router_scoring": _GATING_FUNCS[gating],
        "expert_selection_bias": f"blk.{dense}.exp_probs_b.bias" in tensors,
    }


def _query_temperature(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """Llama 4's attention temperature as llama.cpp reads it (Ministral 3's
    attention.temperature_scale, over YaRN's original context)."""
    beta = metadata.get(f"{arch}.attention.temperature_scale")
    if not beta:
        return {}
    length = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if not length:
        raise ModelLoadError(
            f"GGUF {arch}.attention.temperature_scale needs "
            f"{arch}.rope.scaling.original_context_length"
        )
    return {"query_temperature": (float(beta), int(length))}


def _gpt_oss_fields(metadata: dict[str, Any], layers: int) -> dict[str, Any]:
    return {
        "sliding_window_layers": _sliding_layers(
            metadata, "gpt-oss", layers, _GPT_OSS_WINDOW_PATTERN
        ),
        "swiglu_clamp": _GPT_OSS_SWIGLU_CLAMP,
    }


def _olmo3_fields(metadata: dict[str, Any], layers: int) -> dict[str, Any]:
    """OLMo 3, as llama.cpp writes and reads it (an olmo2 file with a window): windowed layers
    by the file's pattern, else three in four; those rotate by plain RoPE on the model's base
    (or rope.freq_base_swa), the full ones with the file's scaling."""
    base = metadata.get("olmo2.rope.freq_base_swa", metadata.get("olmo2.rope.freq_base", 10000.0))
    return {
        "sliding_window_layers": _sliding_layers(metadata, "olmo2", layers, _OLMO3_WINDOW_PATTERN),
        "local_rope_theta": float(base),
    }


def _exaone4_fields(metadata: dict[str, Any], layers: int) -> dict[str, Any]:
    """EXAONE 4.0 with a window: the windowed layers by the file's pattern, else three in
    four, and only they rotate, as transformers runs it. (llama.cpp 0.3.36 windows a file only
    at the 32B's 64 layers, and rotates every layer of one without a window.)"""
    sliding = _sliding_layers(metadata, "exaone4", layers, _EXAONE4_WINDOW_PATTERN)
    return {"sliding_window_layers": sliding, "rope_layers": sliding}


def _granite_fields(metadata: dict[str, Any], arch: str) -> dict[str, float]:
    """Granite's multipliers, under the names llama.cpp's converter gives them."""
    keys = {
        "embedding_multiplier": "embedding_scale",
        "residual_multiplier": "residual_scale",
        "attention_multiplier": "attention.scale",
        "logits_scaling": "logit_scale",
    }
    return {field: float(metadata.get(f"{arch}.{key}", 1.0)) for field, key in keys.items()}


def _gguf_rotary_dim(rope_dims: int | None, head_dim: int) -> int | None:
    """ModelConfig.rotary_dim from rope.dimension_count (llama.cpp's n_rot)."""
    if rope_dims is None:
        return None
    try:
        return rotary_dims(head_dim, int(rope_dims))
    except UnsupportedRope as error:
        raise ModelLoadError(f"GGUF rope.dimension_count {rope_dims}: {error}") from error


def _gemma_fields(
    metadata: dict[str, Any], arch: str, layers: int, hidden_per_head: int
) -> dict[str, Any]:
    """The ModelConfig fields only Gemma sets (loader._gemma_fields reads the same from an HF
    config), as llama.cpp reads them from a GGUF file."""
    sliding = _sliding_layers(metadata, arch, layers, _GEMMA_WINDOW_PATTERN[arch])
    local_base = metadata.get(
        f"{arch}.rope.freq_base_swa",
        metadata.get(f"{arch}.rope.local.freq_base", _GEMMA3_LOCAL_ROPE_BASE),  # Ollama's name
    )
    return {
        "sliding_window_layers": sliding,
        "attn_logit_softcapping": metadata.get(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": metadata.get(f"{arch}.final_logit_softcapping"),
        "query_pre_attn_scalar": hidden_per_head if layers == _GEMMA_27B_LAYERS[arch] else None,
        "local_rope_theta": float(local_base) if arch == "gemma3" else None,
    }


def _gemma4_fields(
    metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo], layers: int
) -> dict[str, Any]:
    """Gemma 4 as llama.cpp's converter writes it: the full layers' head size in key_length
    and the windowed ones' in key_length_swa (RoPE over each whole; the full layers'
    "proportional" share by the rope_freqs tensor), kv heads and MLP widths a layer, the shared
    layers' count, the per-layer embeddings' width; keys as values where a full layer has no
    attn_v. The windowed layers' head size, kv heads and MLP width come back as
    head_dim, num_key_value_heads and intermediate_size."""
    full_head_dim = int(metadata["gemma4.attention.key_length"])
    head_dim = int(metadata.get("gemma4.attention.key_length_swa", full_head_dim))
    for rope_key, dim in (("dimension_count", full_head_dim), ("dimension_count_swa", head_dim)):
        if int(metadata.get(f"gemma4.rope.{rope_key}", dim)) != dim:
            raise ModelLoadError(f"GGUF gemma4 with rope over part of its heads ({rope_key})")
    sliding = _sliding_layers(metadata, "gemma4", layers, 6)
    shared = int(metadata.get("gemma4.attention.shared_kv_layers", 0))

    def per_layer(name: str) -> list[int]:
        value = metadata[f"gemma4.{name}"]
        return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers

    kv = per_layer("attention.head_count_kv")
    kinds = [{kv[i] for i in range(layers) if sliding[i] == s} for s in (True, False)]
    widths = per_layer("feed_forward_length")
    double = widths[-1] == 2 * widths[0] and shared > 0
    expected = [widths[0] * (2 if double and i >= layers - shared else 1) for i in range(layers)]
    if any(len(k) > 1 for k in kinds) or widths != expected:
        raise ModelLoadError(
            f"GGUF gemma4 with kv heads {kv} and MLP widths {widths} a layer: each kind of "
            "layer's alike (and the shared layers' MLPs twice as wide) is supported"
        )
    full = [i for i in range(layers - shared) if not sliding[i]]
    kv_heads = min(kinds[0] or kinds[1])
    full_kv_heads = min(kinds[1]) if kinds[1] else kv_heads
    per_layer_size = int(metadata.get("gemma4.embedding_length_per_layer_input", 0))
    table = tensors.get("per_layer_token_embd.weight")
    experts = {}
    if metadata.get("gemma4.expert_count"):  # 26B-A4B: the experts beside the dense MLP
        experts = {
            "intermediate_size": int(metadata["gemma4.expert_feed_forward_length"]),
            "dense_intermediate_size": widths[0],
            "experts_beside_dense": True,
        }
    return {
        "head_dim": head_dim,
        "num_key_value_heads": kv_heads,
        "intermediate_size": widths[0],
        "sliding_window_layers": sliding,
        "final_logit_softcapping": metadata.get("gemma4.final_logit_softcapping"),
        "query_pre_attn_scalar": 1.0,  # unscaled scores, as llama.cpp's f_attention_scale
        "local_rope_theta": float(metadata.get("gemma4.rope.freq_base_swa", 10000.0)),
        "full_head_dim": full_head_dim,
        "full_kv_heads": None if full_kv_heads == kv_heads else full_kv_heads,
        "full_keys_as_values": bool(full) and f"blk.{full[0]}.attn_v.weight" not in tensors,
        "kv_shared_layers": shared,
        "shared_layers_double_mlp": double,
        "per_layer_input_size": per_layer_size,
        "per_layer_vocab_size": table.shape[0] if per_layer_size and table else 0,
        "per_layer_pad_id": int(metadata.get("tokenizer.ggml.padding_token_id", 0)),
        **experts,
    }


def _sliding_layers(
    metadata: dict[str, Any], arch: str, layers: int, default: int
) -> tuple[bool, ...]:
    """Which layers attend through the window, as llama.cpp's load_swa_pattern reads them:
    one flag per layer, or every n-th layer full (n = 0: none), n `default` if unsaid."""
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer, true: sliding
        sliding = tuple(bool(p) for p in pattern)
    else:  # llama.cpp's set_swa_pattern(n)
        n = default if pattern is None else int(pattern)
        sliding = tuple(n == 0 or i % n < n - 1 for i in range(layers))
    if len(sliding) != layers:
        raise ModelLoadError(
            f"GGUF {arch}.attention.sliding_window_pattern has {len(sliding)} entries "
            f"for {layers} layers"
        )
    return sliding


def hf_tensor_name(gguf_name: str, gguf_arch: str = "llama") -> str:
    names = _BLOCK_NAMES
    # OLMo 2 and EXAONE 4.0: the output norms only
    if gguf_arch.startswith("gemma") or gguf_arch in ("olmo2", "exaone4"):
        names = {**_BLOCK_NAMES, **_GEMMA_BLOCK_NAMES}
    elif gguf_arch == "gpt-oss":
        names = {**_BLOCK_NAMES, **_GPT_OSS_BLOCK_NAMES}
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and (block := _block_tensor_name(match[2], match[3], gguf_arch, names)) is not None:
        return f"model.layers.{match[1]}.{block}"
    if match := _SHORTCONV_TENSOR.fullmatch(gguf_name):
        return f"model.layers.{match[1]}.conv.{match[2]}.weight"
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def _block_tensor_name(
    tensor: str, suffix: str, gguf_arch: str, names: dict[str, str]
) -> str | None:
    """The HF name under model.layers.N of a block's GGUF tensor `tensor`.`suffix`, or None."""
    experts = EXPERT_NAMES.get(_MOE_FAMILIES.get(gguf_arch, "mixtral"))
    if tensor == GGUF_ROUTER and experts is not None:
        if suffix == "scale" and experts.router_scale:  # Gemma 4's router's input scale
            return experts.router_scale
        return f"{experts.router.removesuffix('.weight')}.{suffix}"
    if (tensor, suffix) == ("ffn_down_exps", "scale"):  # Gemma 4's scale a weight by expert
        if experts is None or experts.expert_scales is None:
            raise ModelLoadError(f"GGUF {gguf_arch} with scales on its experts is not supported")
        return experts.expert_scales
    if tensor == "exp_probs_b":
        if experts is None or experts.selection_bias is None:
            raise ModelLoadError(f"GGUF {gguf_arch} with an expert selection bias is not supported")
        return experts.selection_bias
    if tensor == "attn_sinks":
        return "self_attn.sinks"
    if tensor == _LAYER_SCALE:
        return "layer_scalar"
    if tensor in names:
        module = names[tensor]
        if gguf_arch == "phi3" and tensor == "ffn_up":  # Phi-3's fused gate and up
            module = "mlp.gate_up_proj"
        return f"{module}.{suffix}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q/K projection rows (weight or bias).

    HF's rotate_half rotates dimension i of a head with dimension i + head_dim/2; llama.cpp's
    rope rotates adjacent pairs (2i, 2i+1). Its converter therefore moves HF row (half s, i) of
    each head to row (i, s): `reshape(heads, 2, head_dim/2).swapaxes(1, 2)`. Reading the stored
    rows as (heads, head_dim/2, 2) and swapping the same axes puts them back.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


# A family's own values for keys a converter may leave out: Ollama's Gemma 3 conversion
# (its multimodal form) writes neither the norm's epsilon nor the RoPE bases, and Ollama
# runs it with Gemma 3's (1e-6; 1e6 for the full layers, 10000 for the windowed ones).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {"attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6},
}


def _rope_base(metadata: dict[str, Any], arch: str) -> float:
    """The (full layers') RoPE base: rope.freq_base, else the family's own value, else
    llama.cpp's 10000."""
    base = metadata.get(f"{arch}.rope.freq_base")
    if base is None:
        base = _FAMILY_DEFAULTS.get(arch, {}).get("rope.freq_base", 10000.0)
    return float(base)


# A multimodal model's towers and projector in the text model's own file, as Ollama keeps
# them (its gemma3, mistral-small3.1, qwen2.5vl: one GGUF; llama.cpp keeps them apart, in
# an mmproj file): v.* vision, a.* audio, mm.* the projector. Left out of the text model;
# Gemma 3's are read as its images' (model/gguf_images.py).
_TOWER_PREFIXES = ("v.", "a.", "mm.")


def holds_ollama_tower(metadata: dict[str, Any]) -> bool:
    """Whether the file holds a Gemma 3 vision tower as Ollama keeps it (`gemma3.vision.*`
    keys): model/gguf_images.py reads it (named here, so that loading a text model does not
    import the vision modules)."""
    return metadata.get("general.architecture") == "gemma3" and (
        "gemma3.vision.block_count" in metadata
    )


def _load_weights(
    path: Path,
    tensors: dict[str, GGUFTensorInfo],
    config: ModelConfig,
    gguf_arch: str,
    dtype: torch.dtype,
) -> tuple[LazyWeights, dict[str, GGUFBlocks]]:
    """Every tensor, made in `dtype` only if read (model/lazy_weights.py), plus the 2-D ones
    in a block format the kernels run (model/block_formats.py) as references to their bytes,
    rows un-permuted alike: the model builds its tiles from those without ever making the
    dense weights. Other quantized types are only dequantized, and the log says so."""
    rope_heads = _permuted_heads(config, gguf_arch)
    weights = LazyWeights()
    blocks: dict[str, GGUFBlocks] = {}
    expanded: set[str] = set()  # quantized types with no kernel: dequantized to `dtype`

    # A layer's experts are read one after the other, each a slice of its projection's stack:
    # the layer's three stacks are dequantized once each, not once per expert.
    @functools.lru_cache(maxsize=3)
    def stack(name: str) -> torch.Tensor:
        return read_gguf_tensor(tensors[name])

    towers = [name for name in tensors if name.startswith(_TOWER_PREFIXES)]
    if towers:
        logger.info(
            "GGUF: %d tensors of a vision or audio tower (%s, ...) left out: the text model "
            "alone is served",
            len(towers),
            towers[0],
        )
    for info in tensors.values():
        if info.name in _ROPE_TENSORS or info.name.startswith(_TOWER_PREFIXES):
            continue
        qtype = info.qtype.name
        kept = qtype in BLOCK_FORMATS and len(info.shape) in (2, 3)
        if qtype not in BLOCK_FORMATS and qtype not in _FLOAT_TYPES:
            expanded.add(qtype)
        if (
            experts := gguf_expert_names(info.name, info.shape[0], config.architecture)
        ) is not None:
            # Each part its stack's rows (a fused gate+up stack: two parts an expert).
            part_shape = (info.shape[0] * info.shape[1] // len(experts), *info.shape[2:])
            for e, name in enumerate(experts):
                make = functools.partial(_expert, stack, info, e, part_shape, dtype)
                weights.add(name, part_shape, make)
            if kept:
                whole = GGUFBlocks(
                    info.path,
                    info.offset,
                    (info.shape[0] * info.shape[1], info.shape[2]),
                    BLOCK_FORMATS[qtype],
                )
                blocks.update(zip(experts, expert_slices(whole, len(experts)), strict=True))
            continue
        name = hf_tensor_name(info.name, gguf_arch)
        shape = info.shape
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp's is a vector, HF's 1 row
            shape = (1, *info.shape)
        if name.endswith("conv.conv.weight"):  # LFM2's [hidden, kernel]; HF's [hidden, 1, kernel]
            shape = (info.shape[0], 1, info.shape[1])
        # llama.cpp's converter stores Gemma's norms with the 1 of (1 + w) added; HF
        # names carry HF's values (LlamaForCausalLM.load_weights adds the 1 again).
        norm_offset = bool(config.traits.norm_offset and "norm" in name)
        heads = rope_heads.get(name.split(".")[-2])
        make = functools.partial(_tensor, info, dtype, norm_offset, heads, shape)
        native = functools.partial(_tensor, info, None, norm_offset, heads, shape)
        weights.add(name, shape, make, native)
        if kept and len(info.shape) == 2:
            rows = (
                None if heads is None else unpermute_rope_rows(torch.arange(info.shape[0]), heads)
            )
            blocks[name] = GGUFBlocks(
                info.path,
                info.offset,
                info.shape,  # type: ignore[arg-type]
                BLOCK_FORMATS[qtype],
                rows,
            )
    if expanded:
        logger.warning(
            "%s: tensors in %s have no quantized kernel and are dequantized to %s at load "
            "(kept quantized: %s)",
            path.name,
            ", ".join(sorted(expanded)),
            str(dtype).removeprefix("torch."),
            ", ".join(BLOCK_FORMATS),
        )
    return weights, blocks


def permutes_rope_rows(gguf_arch: str) -> bool:
    """Whether llama.cpp's converter permuted q/k rows for its rope: its "llama" converter
    does, and SmolLM3's, Ministral 3's and Granite's (dense and MoE), its subclasses; the
    others (Qwen2's, Phi-3's...) use NEOX rope, i.e. rotate_half, and store HF's order."""
    return gguf_arch in ("llama", "mistral3", "smollm3", "granite", "granitemoe")


def _permuted_heads(config: ModelConfig, gguf_arch: str) -> dict[str, int]:
    """Heads per projection whose rows llama.cpp permuted for its rope."""
    if not permutes_rope_rows(gguf_arch):
        return {}
    return {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}


def read_gguf_tensor(info: GGUFTensorInfo) -> torch.Tensor:
    """A tensor's values: 16-bit floats as they are, every other type as fp32."""
    raw = read_bytes(info.path, info.offset, info.nbytes)
    if info.qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(raw.view(np.float16).reshape(info.shape))
    if info.qtype == GGMLQuantizationType.BF16:
        return torch.from_numpy(raw.view(np.int16).reshape(info.shape)).view(torch.bfloat16)
    if info.qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(raw.view(np.float32).reshape(info.shape))
    try:
        array = dequantize(raw.reshape(*info.shape[:-1], -1), info.qtype).reshape(info.shape)
    except NotImplementedError as error:
        raise ModelLoadError(f"{info.path}: tensor {info.name}: {error}") from error
    return torch.from_numpy(array)


def _tensor(
    info: GGUFTensorInfo,
    dtype: torch.dtype | None,
    norm_offset: bool,
    rope_heads: int | None,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """The tensor in `dtype`, or (None) as stored: fp16 and bf16 stay so, the rest fp32; in
    `shape` (the same values)."""
    tensor = read_gguf_tensor(info).reshape(shape)
    if norm_offset:
        tensor = tensor.float() - 1
    if rope_heads is not None:
        tensor = unpermute_rope_rows(tensor, rope_heads)
    return (tensor if dtype is None else tensor.to(dtype)).contiguous()


def _expert(
    stack: Callable[[str], torch.Tensor],
    info: GGUFTensorInfo,
    part: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Part `part` of an expert stack whose parts are `shape` each."""
    return stack(info.name).reshape(-1, *shape)[part].to(dtype).contiguous()
