"""The shaped-GGUF writer benchmarks/big_models.py makes its real-size files with
(iterserve.bench.shaped_gguf): its tiny preset must be a file iterserve's loader reads with
the preset's shape and the bundled tokenizer, written one tensor at a time."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from iterserve import kernels
from iterserve.bench.bandwidth import decode_bytes_per_token, kv_bytes_per_step
from iterserve.bench.shaped_gguf import (
    PRESETS,
    WEIGHT_STD,
    q4_k_m_types,
    tensor_specs,
    write_shaped_gguf,
)
from iterserve.bench.tokenizer import load_tokenizer
from iterserve.model.gguf_loader import load_gguf, read_gguf_header
from iterserve.model.llama import LlamaForCausalLM


def test_the_tiny_preset_loads_with_its_shape_and_the_bundled_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[int] = []
    write_tensor_data = GGUFWriter.write_tensor_data

    def spy(self: GGUFWriter, tensor: np.ndarray, *args: Any, **kwargs: Any) -> None:
        written.append(tensor.nbytes)
        write_tensor_data(self, tensor, *args, **kwargs)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("add_tensor keeps every tensor until the end: the whole model")

    monkeypatch.setattr(GGUFWriter, "write_tensor_data", spy)
    monkeypatch.setattr(GGUFWriter, "add_tensor", refuse)
    path = write_shaped_gguf(tmp_path / "tiny.F16.gguf", "tiny", seed=0)

    shape = PRESETS["tiny"]
    specs = tensor_specs(shape, 49152)
    metadata, tensors = read_gguf_header(path)
    # Written tensor by tensor, each as it was made.
    assert written == [spec.nbytes for spec in specs]
    assert list(tensors) == [spec.name for spec in specs]
    assert "output.weight" not in tensors  # tied
    assert tensors["token_embd.weight"].qtype == GGMLQuantizationType.F16
    assert tensors["blk.0.attn_norm.weight"].qtype == GGMLQuantizationType.F32
    assert metadata["general.file_type"] == 1  # llama.cpp's MOSTLY_F16
    assert decode_bytes_per_token(path) == sum(spec.nbytes for spec in specs)

    loaded = load_gguf(path, torch.float32)
    config = loaded.config
    assert config.architecture == "llama"
    assert (config.hidden_size, config.intermediate_size) == (shape.hidden, shape.intermediate)
    assert config.num_hidden_layers == shape.layers
    assert (config.num_attention_heads, config.num_key_value_heads) == (shape.heads, shape.kv_heads)
    assert config.head_dim == shape.head_dim
    assert config.max_position_embeddings == shape.context
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    up = loaded.weights["model.layers.0.mlp.up_proj.weight"]
    assert abs(up.std().item() - WEIGHT_STD) < 0.002
    assert torch.equal(loaded.weights["model.norm.weight"], torch.ones(shape.hidden))

    bundled = load_tokenizer(None)
    text = "Hello, world! <|im_start|>user\nWhat is 2 + 2?<|im_end|>"
    assert loaded.tokenizer.encode(text) == bundled.encode(text)
    assert loaded.chat_template == bundled.chat_template


def test_qwen2_and_phi3_bodies_carry_their_own_tensors(tmp_path: Path) -> None:
    """Qwen2's q/k/v biases and Phi-3's fused q/k/v and gate/up tensors, as llama.cpp's
    converter names them, read back by iterserve's loader into its classes' weights."""
    qwen2 = dataclasses.replace(PRESETS["tiny"], arch="qwen2", qkv_bias=True)
    loaded = load_gguf(write_shaped_gguf(tmp_path / "qwen2.gguf", qwen2), torch.float32)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    hd = qwen2.head_dim
    for name, rows in (
        ("q", qwen2.heads * hd),
        ("k", qwen2.kv_heads * hd),
        ("v", qwen2.kv_heads * hd),
    ):
        bias = loaded.weights[f"model.layers.1.self_attn.{name}_proj.bias"]
        assert bias.shape == (rows,) and 0 < bias.abs().max() < 10 * WEIGHT_STD

    phi3 = dataclasses.replace(
        PRESETS["tiny"], arch="phi3", fused_projections=True, sliding_window=64, head_dim=32
    )
    path = write_shaped_gguf(tmp_path / "phi3.gguf", phi3)
    metadata, tensors = read_gguf_header(path)
    # llama.cpp looks up tokens the bundled vocabulary has not for a model named Phi-3
    assert "phi" not in metadata["general.name"].lower()
    assert "blk.0.attn_q.weight" not in tensors and "blk.0.ffn_gate.weight" not in tensors
    loaded = load_gguf(path, torch.float32)
    config = loaded.config
    assert config.architecture == "phi3" and config.sliding_window == 64
    q, kv = phi3.heads * phi3.head_dim, phi3.kv_heads * phi3.head_dim
    layer = "model.layers.0"
    assert loaded.weights[f"{layer}.self_attn.qkv_proj.weight"].shape == (q + 2 * kv, phi3.hidden)
    gate_up = loaded.weights[f"{layer}.mlp.gate_up_proj.weight"]
    assert gate_up.shape == (2 * phi3.intermediate, phi3.hidden)


def test_a_reranker_body_is_llama_cpps_qwen3_reranker(tmp_path: Path) -> None:
    """cls.output (the rows of "yes" and "no"), pooling type rank and the rerank template, as
    llama.cpp's converter writes a Qwen3-Reranker: iterserve scores with the rows' difference
    in that template."""
    from iterserve.engine.llm import LLM

    shape = dataclasses.replace(PRESETS["tiny"], arch="qwen3", qk_norm=True, reranker=True)
    path = write_shaped_gguf(tmp_path / "reranker.gguf", shape)
    metadata, tensors = read_gguf_header(path)
    assert tensors["cls.output.weight"].shape == (2, shape.hidden)
    assert "{document}" in metadata["tokenizer.chat_template.rerank"]
    llm = LLM(str(path), dtype="float32", compile=False, num_kv_blocks=64)
    assert llm.engine.pooling.score and not llm.engine.pooling.generate
    (out,) = llm.score("q", "d", use_tqdm=False)
    from gguf import GGUFReader

    (cls,) = (t for t in GGUFReader(path).tensors if t.name == "cls.output.weight")
    yes, no = torch.from_numpy(cls.data.astype("float32"))  # rows as the file stores them
    assert torch.equal(llm.engine.executor.model.score_head, (yes - no).reshape(1, -1))
    assert 0 < out.score < 1


def test_a_decode_step_reads_each_layers_k_and_v_up_to_its_window(tmp_path: Path) -> None:
    """big_models.py's bytes a batch-1 step reads: the weights and, per layer, 16-bit K and
    V rows of every token in context, or of its sliding window's (Gemma 2: even layers)."""
    tiny = PRESETS["tiny"]  # 2 layers, 2 kv heads of 16 dims: 128 bytes of K and V a token
    row = 2 * tiny.kv_heads * tiny.head_dim * 2
    assert row == 128
    # With Llama 3's rope, whose frequencies are a tensor of the file (rope_freqs.weight).
    llama3 = dataclasses.replace(tiny, llama3_rope=(32.0, 1.0, 4.0, 8192))
    llama = write_shaped_gguf(tmp_path / "llama.gguf", llama3)
    assert "rope_freqs.weight" in read_gguf_header(llama)[1]
    assert kv_bytes_per_step(llama, 100) == 2 * 128 * 100
    assert kv_bytes_per_step(llama, 100, itemsize=1) == 128 * 100
    gemma2 = dataclasses.replace(
        tiny, arch="gemma2", sliding_window=16, attn_softcap=50.0, final_softcap=30.0
    )
    path = write_shaped_gguf(tmp_path / "gemma2.gguf", gemma2)
    assert kv_bytes_per_step(path, 100) == 128 * (16 + 100)
    assert kv_bytes_per_step(path, 10) == 128 * (10 + 10)


# A mixture-of-experts body made small: 4 experts of 256, 2 a token, beside (or before) a
# dense MLP of 512.
_SMALL_MOE = dict(
    hidden=256,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=64,
    experts=4,
    experts_used=2,
    intermediate=256,
    dense_intermediate=512,
)


def _assert_a_step_reads_2_of_4_experts(path: Path, tensors: dict) -> None:
    """A decode step reads every tensor but half the expert stacks (`_SMALL_MOE`'s top 2 of
    4)."""
    experts = sum(info.nbytes for name, info in tensors.items() if "_exps." in name)
    assert decode_bytes_per_token(path) == sum(i.nbytes for i in tensors.values()) - experts // 2


def test_a_qwen3_moe_body_loads_as_its_experts(tmp_path: Path) -> None:
    """A mixture-of-experts body (Qwen3-30B-A3B's layout, made small), written as random
    Q4_K_M blocks the way big_models.py --random-blocks writes it: the loader reads it as
    Qwen3-MoE with the experts in their blocks, and a decode step reads only the routed share
    of the expert stacks (8 of 128 in the real model; 2 of 4 here)."""
    shape = dataclasses.replace(PRESETS["qwen3-30b-a3b"], **_SMALL_MOE)
    path = write_shaped_gguf(tmp_path / "moe.gguf", shape, blocks=q4_k_m_types)
    metadata, tensors = read_gguf_header(path)
    assert metadata["qwen3moe.feed_forward_length"] == 512
    assert metadata["qwen3moe.expert_feed_forward_length"] == 256
    assert tensors["blk.0.ffn_gate_exps.weight"].shape == (4, 256, 256)
    assert tensors["blk.0.ffn_gate_inp.weight"].qtype == GGMLQuantizationType.F32
    # llama-quantize's Q4_K_M: ffn_down_exps is an ffn_down, Q6_K in the last eighth of layers
    assert tensors["blk.0.ffn_down_exps.weight"].qtype == GGMLQuantizationType.Q4_K
    assert tensors["blk.1.ffn_down_exps.weight"].qtype == GGMLQuantizationType.Q6_K
    assert "blk.0.ffn_down.weight" not in tensors
    _assert_a_step_reads_2_of_4_experts(path, tensors)

    loaded = load_gguf(path, torch.bfloat16)
    config = loaded.config
    assert config.architecture == "qwen3_moe" and config.norm_topk_prob
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    assert config.intermediate_size == 256
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert loaded.quantized[name].format.name == "Q6_K"


@pytest.mark.parametrize("size", [49152 + 64, 32064])
def test_real_vocab_files_have_the_models_rows_and_head(tmp_path: Path, size: int) -> None:
    """`real_vocab`: the bundled vocabulary grown by filler tokens (Llama 3's 128k, Gemma's
    262k) or cut (Phi-3's 32k, Mistral's), and an output.weight where the model's head is its
    own; the file loads with those rows, and its tokenizer reads text whole."""
    shape = dataclasses.replace(PRESETS["tiny"], vocab=size, tied=False)
    path = write_shaped_gguf(tmp_path / "rv.gguf", shape, real_vocab=True)
    metadata, tensors = read_gguf_header(path)
    assert len(metadata["tokenizer.ggml.tokens"]) == size
    assert len(metadata["tokenizer.ggml.token_type"]) == size
    assert tuple(tensors["output.weight"].shape) == (size, shape.hidden)
    assert decode_bytes_per_token(path) == sum(
        spec.nbytes
        for spec in tensor_specs(shape, size, head=True)
        if spec.name != "token_embd.weight"
    )

    loaded = load_gguf(path, torch.float32)
    assert loaded.config.vocab_size == size and not loaded.config.tie_word_embeddings
    text = "Hello, world! <|im_start|>user\nWhat is 2 + 2? Ünïcödé ok<|im_end|>"
    ids = loaded.tokenizer.encode(text)
    assert max(ids) < min(size, 49152)  # fillers are never made from text
    assert loaded.tokenizer.decode(ids) == text
    if size > 49152:
        assert ids == load_tokenizer(None).encode(text)
    else:  # cut: no merge makes or joins a dropped token, so none is missed
        merges = metadata["tokenizer.ggml.merges"]
        kept = set(metadata["tokenizer.ggml.tokens"])
        assert 0 < len(merges) < 48900
        assert all(m.replace(" ", "") in kept for m in merges)


def test_presets_vocabularies_are_their_models() -> None:
    """The published vocabulary sizes, and which heads are tied, as real_vocab files use them."""
    vocab = {name: (shape.vocab, shape.tied) for name, shape in PRESETS.items()}
    assert vocab["llama-1b"] == (128256, True) and vocab["llama-8b"] == (128256, False)
    assert vocab["gemma3-4b"] == (262208, True) and vocab["qwen3-8b"] == (151936, False)
    assert all(v is not None for name, (v, _) in vocab.items() if name != "tiny")
    # Whole kernel tiles of 16 rows, but OLMo 3's 100,278 (its head's last tile padded).
    assert vocab["olmo3-7b"] == (100278, False)
    assert all(v % 16 == 0 for n, (v, _) in vocab.items() if v is not None and n != "olmo3-7b")


def test_an_lfm2_body_loads_its_conv_layers(tmp_path: Path) -> None:
    """LFM2's conv layers as llama.cpp's converter writes them (no kv heads, shortconv.*
    tensors, token_embd_norm as the final norm), read back as the preset's layers; a decode
    step reads a conv layer's two predecessors' rows, an attention layer's whole context."""
    shape = dataclasses.replace(
        PRESETS["tiny"], arch="lfm2", qk_norm=True, attention_layers=(1,), layers=3
    )
    path = write_shaped_gguf(tmp_path / "lfm2.gguf", shape)
    loaded = load_gguf(path, torch.float32)
    config = loaded.config
    assert config.architecture == "lfm2" and config.conv_layers == (True, False, True)
    assert config.conv_kernel == 3 and config.num_key_value_heads == shape.kv_heads
    conv = loaded.weights["model.layers.0.conv.conv.weight"]
    assert conv.shape == (shape.hidden, 1, 3) and 0 < conv.abs().max() < 10 * WEIGHT_STD
    assert loaded.weights["model.layers.2.conv.in_proj.weight"].shape == (
        3 * shape.hidden,
        shape.hidden,
    )
    assert torch.equal(loaded.weights["model.norm.weight"], torch.ones(shape.hidden))
    attention = 2 * shape.kv_heads * shape.head_dim * 2
    assert kv_bytes_per_step(path, 100) == attention * 100 + 2 * (shape.hidden * 2 * 2)


def test_an_lfm2_moe_body_loads_its_dense_and_expert_layers(tmp_path: Path) -> None:
    """LFM2-MoE as llama.cpp's converter writes it: a leading dense layer as wide as
    feed_forward_length, then experts routed by sigmoid scores with a selection bias
    (exp_probs_b); a decode step reads a token's share of the experts."""
    shape = dataclasses.replace(
        PRESETS["tiny"],
        arch="lfm2moe",
        qk_norm=True,
        attention_layers=(1,),
        layers=3,
        intermediate=32,
        dense_intermediate=128,
        experts=4,
        experts_used=2,
        leading_dense=1,
        sigmoid_router=True,
    )
    path = write_shaped_gguf(tmp_path / "lfm2moe.gguf", shape)
    loaded = load_gguf(path, torch.float32)
    config = loaded.config
    assert (config.architecture, config.conv_layers) == ("lfm2_moe", (True, False, True))
    assert (config.intermediate_size, config.dense_intermediate_size) == (32, 128)
    assert (config.router_scoring, config.expert_selection_bias) == ("sigmoid", True)
    assert [config.layer_has_experts(i) for i in range(3)] == [False, True, True]
    weights = loaded.weights
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (128, shape.hidden)
    assert weights["model.layers.2.mlp.experts.3.down_proj.weight"].shape == (shape.hidden, 32)
    assert weights["model.layers.1.mlp.expert_bias"].shape == (4,)
    specs = tensor_specs(shape, 49152)
    experts = sum(spec.nbytes for spec in specs if "_exps." in spec.name)
    whole = sum(spec.nbytes for spec in specs)
    assert decode_bytes_per_token(path) == whole - experts // 2


def test_a_ministral3_body_reads_its_yarn_and_temperature(tmp_path: Path) -> None:
    """Ministral 3 as llama.cpp's converter writes it (mistral3: YaRN with its
    yarn_log_multiplier, attention.temperature_scale over the original context)."""
    shape = dataclasses.replace(
        PRESETS["tiny"], arch="mistral3", yarn=(16.0, 128), attn_temperature=0.1
    )
    config = load_gguf(write_shaped_gguf(tmp_path / "mistral3.gguf", shape), torch.float32).config
    assert config.architecture == "ministral3" and config.query_temperature == (0.1, 128)
    assert config.rope_scaling is not None and config.rope_scaling["mscale_all_dim"] == 1.0
    assert PRESETS["ministral3-3b"].attn_temperature == 0.1


def test_a_gemma4_body_loads_its_layers_shapes_and_per_layer_embeddings(tmp_path: Path) -> None:
    """Gemma 4 as llama.cpp's converter writes it (full layers' heads of their own size,
    K/V read from earlier layers, per-layer embeddings, proportional RoPE as rope_freqs): the
    loader's config, and a decode step reading one row of the per-layer table."""
    shape = dataclasses.replace(
        PRESETS["tiny"],
        arch="gemma4",
        layers=5,
        qk_norm=True,
        sliding_window=32,
        rope_local_theta=10000.0,
        full_every=2,
        full_head_dim=32,
        full_kv_heads=1,
        keys_as_values=True,
        kv_shared=2,
        double_mlp=True,
        per_layer_input=32,
    )
    path = write_shaped_gguf(tmp_path / "gemma4.gguf", shape)
    loaded = load_gguf(path, torch.float32)
    config = loaded.config
    assert config.architecture == "gemma4" and config.per_layer_input_size == 32
    assert [config.layer_head_dim(i) for i in range(5)] == [16, 32, 16, 32, 16]
    assert [config.layer_kv_source(i) for i in range(5)] == [0, 1, 2, 1, 2]
    assert [config.layer_mlp_width(i) for i in range(5)] == [128, 128, 128, 256, 256]
    assert config.full_keys_as_values and config.full_kv_heads == 1
    scales = config.rope_scaling["freq_factors"]  # type: ignore[index]
    assert scales[:4] == [1.0] * 4 and min(scales[4:]) > 1e29
    specs = tensor_specs(shape, 49152)
    table = next(spec for spec in specs if spec.name == "per_layer_token_embd.weight")
    assert decode_bytes_per_token(path) == sum(spec.nbytes for spec in specs) - table.nbytes
    # A token embedding to llama-quantize: Q6_K, where its rows are whole 256-value blocks
    # (E2B's 35 x 256), else Q8_0 (this one's 5 x 32).
    e2b = PRESETS["gemma4-e2b"]
    real_table = next(s for s in tensor_specs(e2b, 262144) if s.name == table.name)
    assert (q4_k_m_types(real_table, e2b), q4_k_m_types(table, shape)) == ("Q6_K", "Q8_0")


def test_a_gemma4_moe_body_loads_its_experts_beside_the_dense_mlp(tmp_path: Path) -> None:
    """Gemma 4 26B-A4B's layout (made small), as random Q4_K_M blocks: gate and up in one
    expert stack, the router's scales, the dense MLP beside the experts; the loader reads
    each expert's gate and up as rows of the one stack, in their blocks, and a decode step
    reads the routed share of the stacks."""
    shape = dataclasses.replace(
        PRESETS["gemma4-26b-a4b"],
        **_SMALL_MOE,
        full_every=2,
        full_head_dim=128,
        full_kv_heads=1,
    )
    path = write_shaped_gguf(tmp_path / "gemma4-moe.gguf", shape, blocks=q4_k_m_types)
    metadata, tensors = read_gguf_header(path)
    assert metadata["gemma4.feed_forward_length"] == [512, 512]
    assert tensors["blk.0.ffn_gate_up_exps.weight"].shape == (4, 512, 256)
    _assert_a_step_reads_2_of_4_experts(path, tensors)

    loaded = load_gguf(path, torch.bfloat16)
    config = loaded.config
    assert config.architecture == "gemma4" and config.experts_beside_dense
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    assert (config.intermediate_size, config.layer_mlp_width(0)) == (256, 512)
    layer = "model.layers.1."
    gate, up = (loaded.quantized[f"{layer}experts.3.{p}_proj.weight"] for p in ("gate", "up"))
    assert gate.shape == up.shape == (256, 256) and gate.format.name == "Q4_K"
    assert up.offset - gate.offset == gate.format.row_bytes(256) * 256
    # The real model's down projections (704, 2112 wide) are not whole 256-value blocks:
    # llama-quantize's fallbacks, Q4_K -> Q5_0 and Q6_K -> Q8_0.
    real = PRESETS["gemma4-26b-a4b"]
    specs = {spec.name: spec for spec in tensor_specs(real, 262144)}
    down = [
        q4_k_m_types(specs[f"blk.{i}.ffn_down{s}.weight"], real) for i, s in ((0, "_exps"), (4, ""))
    ]
    assert down == ["Q8_0", "Q5_0"]
    if kernels.available():  # the experts run from those blocks in one call
        model = LlamaForCausalLM(config, torch.bfloat16, torch.device("cpu"))
        model.load(loaded.weights, "tiled", loaded.quantized)
        assert model.layers[1].moe is not None and model.layers[1].moe.kernel is not None
