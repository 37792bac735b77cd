"""Tiny GGUF files written with the `gguf` package's writer from a transformers model, the way
llama.cpp's convert_hf_to_gguf.py lays them out (transcribed independently of our loader)."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
)
from gguf.quants import quantize
from transformers import PreTrainedModel, PreTrainedTokenizerFast

# HF module name in a layer -> GGUF tensor name in a block.
_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: fused gate and up as one ffn_up
    "mlp.down_proj": "ffn_down",
}
# Gemma's sandwich norms (gguf-py's ATTN_POST_NORM, FFN_PRE_NORM, FFN_POST_NORM).
_GEMMA_BLOCK = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    # Gemma 4's per-layer input (gguf-py's PER_LAYER_INP_GATE, PER_LAYER_PROJ,
    # PER_LAYER_POST_NORM) and layer scalar (LAYER_OUT_SCALE)
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
    "layer_scalar": "layer_output_scale",
    # Gemma 4 26B-A4B's router (its weight, its input's scale), experts (gate and up in one
    # stack, the per-expert scale as the down stack's), and the norms of its two MLPs, as
    # _gemma4_state names them (gguf-py's FFN_GATE_INP, FFN_GATE_UP_EXP, FFN_DOWN_EXP,
    # FFN_PRE_NORM_2, FFN_POST_NORM_1, FFN_POST_NORM_2)
    "router.proj": "ffn_gate_inp",
    "router": "ffn_gate_inp",
    "experts.gate_up": "ffn_gate_up_exps",
    "experts.down": "ffn_down_exps",
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
}
# Gemma 4's tensors under the names _GEMMA_BLOCK reads, as llama.cpp's converter renames them.
_GEMMA4_RENAMES = {
    "router.per_expert_scale": "experts.down.scale",
    "experts.gate_up_proj": "experts.gate_up.weight",
    "experts.down_proj": "experts.down.weight",
}
# gpt-oss: the sinks, the norm before the MLP (ATTN_POST_NORM), the router and the expert
# stacks as _gpt_oss_state names them.
_GPT_OSS_BLOCK = {
    "self_attn.sinks": "attn_sinks",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
    "mlp.experts.gate": "ffn_gate_exps",
    "mlp.experts.up": "ffn_up_exps",
    "mlp.experts.down": "ffn_down_exps",
}
# OLMo 2: the norms on the attention's and the MLP's outputs (gguf-py's ATTN_POST_NORM,
# FFN_POST_NORM); it has none on their inputs.
_OLMO2_BLOCK = {
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# Granite MoE: the router and the expert stacks as _granite_moe_state names them.
_GRANITE_MOE_BLOCK = {
    "block_sparse_moe.router": "ffn_gate_inp",
    "block_sparse_moe.experts.gate": "ffn_gate_exps",
    "block_sparse_moe.experts.up": "ffn_up_exps",
    "block_sparse_moe.experts.down": "ffn_down_exps",
}
# LFM2: its own names for Llama's parts, and its conv layers' (gguf-py's SHORTCONV_*).
_LFM2_BLOCK = {
    "operator_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm",
    "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down",
    "conv.conv": "shortconv.conv",
    "conv.in_proj": "shortconv.in_proj",
    "conv.out_proj": "shortconv.out_proj",
}
# LFM2-MoE: its router, selection bias and expert stacks as _lfm2_moe_state names them.
_LFM2_MOE_BLOCK = {
    "feed_forward.gate": "ffn_gate_inp",
    "feed_forward.exp_probs_b": "exp_probs_b",
    "feed_forward.experts.gate": "ffn_gate_exps",
    "feed_forward.experts.up": "ffn_up_exps",
    "feed_forward.experts.down": "ffn_down_exps",
}
_TOP = {
    "model.embed_tokens": "token_embd",
    "model.embedding_norm": "token_embd_norm",  # LFM2's final norm
    "model.norm": "output_norm",
    "lm_head": "output",
    "score": "cls.output",  # a reranker's classifier (CLS_OUT)
    # Gemma 4's per-layer embeddings
    "model.embed_tokens_per_layer": "per_layer_token_embd",
    "model.per_layer_model_projection": "per_layer_model_proj",
    "model.per_layer_projection_norm": "per_layer_proj_norm",
}


def _gemma4_name(name: str) -> str:
    for theirs, ours in _GEMMA4_RENAMES.items():
        if name.endswith(theirs):
            return name.removesuffix(theirs) + ours
    return name


def _gpt_oss_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's tensors as llama.cpp's converter splits them: each expert stack's gate and
    up de-interleaved and every stack [experts, outputs, inputs], a stack per projection and
    per bias; the sinks given a `.weight`."""
    out = {}
    for name, tensor in state.items():
        stem, _, last = name.rpartition(".")
        if last == "sinks":
            out[f"{name}.weight"] = tensor
        elif last in ("gate_up_proj", "gate_up_proj_bias"):
            bias = last.endswith("_bias")
            for projection, columns in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                part = tensor[..., columns]
                out[f"{stem}.{projection}.{'bias' if bias else 'weight'}"] = (
                    part if bias else part.transpose(-1, -2)
                )
        elif last == "down_proj":
            out[f"{stem}.down.weight"] = tensor.transpose(-1, -2)
        elif last == "down_proj_bias":
            out[f"{stem}.down.bias"] = tensor
        else:
            out[name] = tensor
    return out


def _granite_moe_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Granite MoE's tensors as llama.cpp's converter splits them: each layer's gate_up stack
    [experts, 2 x width, hidden] into its gate rows and its up rows, a stack each."""
    out = {}
    for name, tensor in state.items():
        stem, _, last = name.rpartition(".")
        if last == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            out[f"{stem}.gate.weight"], out[f"{stem}.up.weight"] = gate, up
        elif last == "down_proj" and stem.endswith("experts"):
            out[f"{stem}.down.weight"] = tensor
        else:
            out[name] = tensor
    return out


def _lfm2_moe_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LFM2-MoE's tensors as llama.cpp's converter writes them: each layer's gate_up stack
    [experts, 2 x width, hidden] (w1's rows, then w3's) as a gate stack and an up stack, and
    its expert_bias as exp_probs_b.bias."""
    out = {}
    for name, tensor in state.items():
        stem, _, last = name.rpartition(".")
        if last == "gate_up_proj":
            out[f"{stem}.gate.weight"], out[f"{stem}.up.weight"] = tensor.chunk(2, dim=1)
        elif last == "down_proj" and stem.endswith("experts"):
            out[f"{stem}.down.weight"] = tensor
        elif last == "expert_bias":
            out[f"{stem}.exp_probs_b.bias"] = tensor
        else:
            out[name] = tensor
    return out


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama's Q/K rows."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def lfm2_mlp_width(config: Any) -> int:
    """The width transformers' Lfm2MLP gives its projections (block_auto_adjust_ff_dim), as
    llama.cpp's converter writes it."""
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            width = config.block_multiple_of * -(-width // config.block_multiple_of)
    return width


def add_shape(writer: GGUFWriter, config: Any, rope_freq_base: float | None = None) -> None:
    """The hyperparameters every Llama-like GGUF carries, from a transformers config."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    if config.model_type == "gemma4_text":
        _add_gemma4_shape(writer, config)
        return
    lfm2 = config.model_type in ("lfm2", "lfm2_moe")
    # LFM2: the MLP's width as its config class makes it, no kv heads on the conv layers
    # (llama.cpp's converter's way of marking them) and their width in tokens.
    width = lfm2_mlp_width(config) if config.model_type == "lfm2" else config.intermediate_size
    writer.add_feed_forward_length(width)
    writer.add_head_count(config.num_attention_heads)
    kv_heads = config.num_key_value_heads
    if lfm2:
        kv_heads = [0 if t == "conv" else kv_heads for t in config.layer_types]
        writer.add_shortconv_l_cache(config.conv_L_cache)
    writer.add_head_count_kv(kv_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # llama.cpp's n_rot: the dimensions turned (Phi-4-mini's partial rotary: 96 of 128).
    partial = config.rope_parameters.get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(head_dim * partial))
    writer.add_layer_norm_rms_eps(config.norm_eps if lfm2 else config.rms_norm_eps)
    writer.add_rope_freq_base(rope_freq_base or config.rope_parameters["rope_theta"])
    if config.model_type == "lfm2_moe":  # as llama.cpp's converter: always sigmoid
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_leading_dense_block_count(config.num_dense_layers)
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)


def _add_gemma4_shape(writer: GGUFWriter, config: Any) -> None:
    """Gemma 4's hyperparameters as llama.cpp's converter writes them: the full layers' head
    size as key_length (and the rope's), the windowed ones' as *_swa, kv heads and MLP widths
    a layer, the full layers' base as freq_base (their proportional share: a rope_freqs
    tensor, written by the caller)."""
    layers = config.num_hidden_layers
    sliding = [t == "sliding_attention" for t in config.layer_types]
    full = config.per_layer_config[sliding.index(False)]
    local = config.per_layer_config[sliding.index(True)]
    shared = config.num_kv_shared_layers
    width = config.intermediate_size
    double = config.use_double_wide_mlp
    widths = [width * (2 if double and i >= layers - shared else 1) for i in range(layers)]
    writer.add_feed_forward_length(widths)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(
        [local.num_key_value_heads if s else full.num_key_value_heads for s in sliding]
    )
    writer.add_key_length(full.head_dim)
    writer.add_value_length(full.head_dim)
    writer.add_key_length_swa(local.head_dim)
    writer.add_value_length_swa(local.head_dim)
    writer.add_rope_dimension_count(full.head_dim)
    writer.add_rope_dimension_count_swa(local.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.enable_moe_block:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.top_k_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def gemma4_rope_freqs(config: Any) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for Gemma 4's full layers: 1 for the frequencies
    its proportional RoPE turns, 1e30 (none) for the rest."""
    rope = config.rope_parameters["full_attention"]
    half = config.per_layer_config[config.layer_types.index("full_attention")].head_dim // 2
    turning = int(rope["partial_rotary_factor"] * half)
    return np.array([1.0] * turning + [1e30] * (half - turning), dtype=np.float32)


# GGUF types the gguf package quantizes (real blocks of real weights); the others get random
# blocks with finite fp16 fields (the offsets of those fields in each type's block struct).
_QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"}
_HALF_FIELDS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ2_XXS": (0,),
}


def gguf_blocks(qtype: str, weight: np.ndarray, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """`weight` ([n, k]) as [n, row bytes] of GGUF type `qtype`: quantized where the gguf
    package can, else random blocks whose fp16 scales are in [scale / 10, scale]."""
    kind = GGMLQuantizationType[qtype]
    if qtype in _QUANTIZABLE:
        return quantize(np.ascontiguousarray(weight, dtype=np.float32), kind)
    block, nbytes = GGML_QUANT_SIZES[kind]
    n, k = weight.shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
    for at in _HALF_FIELDS[qtype]:
        halves = rng.uniform(scale / 10, scale, (n, k // block)).astype(np.float16)
        blocks[..., at : at + 2] = halves.view(np.uint8).reshape(n, k // block, 2)
    return blocks.reshape(n, -1)


def write_gguf(
    path: Path,
    arch: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    *,
    chat_template: str | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    rope_freq_base: float | None = None,
    metadata: Mapping[str, Any] | None = None,
    rope_tensors: Mapping[str, np.ndarray] | None = None,
    qtypes: Mapping[str, str] | None = None,
    named_chat_templates: Mapping[str, str] | None = None,
    sampling: Mapping[str, float | int] | None = None,
    omit: Collection[str] = (),
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> None:
    """`model`'s weights (or `state`, HF-named) as a GGUF of architecture `arch`; 2-D
    projections in `qtype` (norms, embedding and head stay F32), or per HF name in `qtypes`
    (a GGUF type name; `gguf_blocks` makes them). `metadata`: extra keys (without the
    `{arch}.` prefix); `rope_tensors`: e.g. {"rope_freqs": factors}; `named_chat_templates`:
    tokenizer.chat_template.NAME, e.g. llama.cpp's "rerank"; `sampling`: general.sampling.NAME
    keys, e.g. {"top_k": 20, "temp": 0.6}, as gguf's writer types them; `omit`: keys (without
    the prefix) left out, as another converter leaves them out (Ollama's); `extra_tensors`:
    more tensors by their whole names, in their own dtypes (a tower kept beside the text,
    as Ollama keeps one)."""
    config = model.config
    writer = GGUFWriter(path, arch)
    add_shape(writer, config, rope_freq_base)
    for name, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{name}")(value)
    for key, value in (metadata or {}).items():
        full = f"{arch}.{key}"
        if isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, list):
            writer.add_array(full, value)
        else:
            writer.add_uint32(full, value)
    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    # The tokens added past the model's vocabulary (a family's image tokens) after it, as
    # control tokens, as llama.cpp's converter lists them.
    added = {t: i for t, i in tokenizer.get_added_vocab().items() if t not in bpe["vocab"]}
    vocab = {**bpe["vocab"], **added}
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "ids with gaps"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]])
    writer.add_token_types([3 if t.startswith("<|") or t in added else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if named_chat_templates:
        writer.add_chat_template(
            [{"name": n, "template": t} for n, t in named_chat_templates.items()]
        )

    for name, array in (rope_tensors or {}).items():
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(array, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(array))
    if state is None:
        state = dict(model.state_dict())
        if config.tie_word_embeddings:
            state.pop("lm_head.weight")
    block = _BLOCK
    if arch.startswith("gemma"):
        block = {**_BLOCK, **_GEMMA_BLOCK}
        state = {_gemma4_name(name): tensor for name, tensor in state.items()}
    elif arch == "gpt-oss":
        block = {**_BLOCK, **_GPT_OSS_BLOCK}
        state = _gpt_oss_state(state)
    elif arch in ("olmo2", "exaone4"):
        block = {**_BLOCK, **_OLMO2_BLOCK}
    elif arch == "granitemoe":
        block = {**_BLOCK, **_GRANITE_MOE_BLOCK}
        state = _granite_moe_state(state)
    elif arch == "lfm2":
        block = {**_BLOCK, **_LFM2_BLOCK}
    elif arch == "lfm2moe":
        block = {**_BLOCK, **_LFM2_BLOCK, **_LFM2_MOE_BLOCK}
        state = _lfm2_moe_state(state)
    for name, tensor in state.items():
        if name.endswith(".layer_scalar"):  # Gemma 4's buffer, a weight in llama.cpp's files
            name += ".weight"
        stem, suffix = name.rsplit(".", 1)
        layer, _, module = stem.removeprefix("model.layers.").partition(".")
        gguf_name = (
            f"{_TOP[stem]}.{suffix}" if stem in _TOP else f"blk.{layer}.{block[module]}.{suffix}"
        )
        array = tensor.float().numpy()
        if module == "conv.conv":  # the converter squeezes nn.Conv1d's [hidden, 1, kernel]
            array = array.squeeze(1)
        if arch in ("gemma2", "gemma3") and stem.endswith("norm"):
            array = array + 1  # convert_hf_to_gguf.py stores Gemma's (1 + w) norm scales
        permuted = arch in ("llama", "mistral3", "smollm3", "granite", "granitemoe")
        if permuted and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if "q_proj" in module else config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        array = np.ascontiguousarray(array)
        if qtypes and name in qtypes:  # an expert stack's experts as rows of one matrix
            kind = GGMLQuantizationType[qtypes[name]]
            rows = gguf_blocks(qtypes[name], array.reshape(-1, array.shape[-1]), len(gguf_name))
            blocks = rows.reshape(*array.shape[:-1], -1)
            writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
        elif (
            qtype != GGMLQuantizationType.F32
            and module
            and array.ndim == 2
            and "norm" not in module
            and module != "conv.conv"  # 3 columns: no blocks fit
        ):
            writer.add_tensor(gguf_name, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    for key in omit:  # keys another converter does not write (`{arch}.` added)
        writer.kv_data[0].pop(f"{arch}.{key}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def split_gguf(source: Path, directory: Path, parts: int) -> list[Path]:
    """`source` re-written as `parts` files in `directory`, as llama.cpp's `llama-gguf-split`
    cuts a model (the `gguf` package's writer, whose split keys and part names are
    llama.cpp's: NAME-00001-of-0000N.gguf): the metadata in the first, the tensors in order,
    an even count a part. The parts' paths, the first first."""
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    per_part = -(-len(reader.tensors) // parts)
    writer = GGUFWriter(directory / source.name, arch, split_max_tensors=per_part)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own fields; the writer adds the architecture
        array = field.types[0] == GGUFValueType.ARRAY
        writer.add_key_value(
            name, field.contents(), field.types[0], field.types[-1] if array else None
        )
    for tensor in reader.tensors:
        quantized = tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        writer.add_tensor(
            tensor.name,
            np.array(tensor.data),
            raw_dtype=tensor.tensor_type if quantized else None,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    written = sorted(directory.glob(f"{source.stem}-*-of-*.gguf"))
    assert len(written) == parts, f"{len(reader.tensors)} tensors made {len(written)} parts"
    return written
