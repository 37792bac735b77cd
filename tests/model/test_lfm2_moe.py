"""LFM2-MoE (LFM2-8B-A1B's family) against transformers on a tiny random checkpoint: LFM2's
conv and attention layers, a leading dense MLP, then experts routed by sigmoid scores with a
selection bias (model/moe.py `route`); from the HF directory and from the GGUF llama.cpp's
converter writes; the experts in one C++ call and the layers in one against the torch
reference. (Its engine runs, through chunks, preemption and n-gram speculation, are in
test_model_families.py with the other families'.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from iterserve import kernels
from iterserve.model.config import ModelConfig
from iterserve.model.gguf_loader import read_gguf_config
from iterserve.model.linear import Backend
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import hf_model_config, load_model
from iterserve.model.moe import Routing, route
from moe_checks import (
    assert_fused_layers_keep_the_torch_logits,
    assert_mixed_steps_match_transformers,
)
from tiny_checkpoints import save_checkpoint
from tiny_families import SMALL_VOCAB, family_checkpoint, lfm2_moe_model

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason="the C++ kernels do not run here"
)


@pytest.fixture(scope="module")
def hf() -> transformers.PreTrainedModel:
    return lfm2_moe_model(vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="module")
def hf_dir(
    hf: transformers.PreTrainedModel, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    return save_checkpoint(hf, tmp_path_factory.mktemp("lfm2-moe"), tokenizer_dir)


def _model(path: Path, dtype: torch.dtype, backend: Backend = "torch") -> LlamaForCausalLM:
    loaded = load_model(path, torch.float32)
    model = LlamaForCausalLM(loaded.config, dtype, torch.device("cpu"))
    model.load(loaded.weights, backend, loaded.quantized or None)
    return model


def test_the_router_picks_by_score_and_bias_and_weighs_by_score(
    hf: transformers.PreTrainedModel,
) -> None:
    """`route` against transformers' own router on the same logits: the same experts and
    weights; and the bias matters (without it other experts win on some rows)."""
    block = hf.model.layers[1].feed_forward
    hidden = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits, want_weights, want_experts = block.gate(hidden, block.expert_bias)
    routing = Routing(top_k=2, renormalize=True, sigmoid=True)
    weights, experts = route(logits, routing, block.expert_bias)
    torch.testing.assert_close(experts, want_experts, rtol=0, atol=0)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    unbiased = route(logits, routing)[1]
    assert (unbiased.sort(1).values != experts.sort(1).values).any(1).sum() >= 4
    scaled = route(
        logits, Routing(top_k=2, renormalize=True, sigmoid=True, scale=2.5), block.expert_bias
    )
    torch.testing.assert_close(scaled[0], 2.5 * weights)


def test_the_released_config_reads_as_lfm2_8b_a1b() -> None:
    """LFM2-8B-A1B's config.json (as remembered: 24 layers, 6 of them attention; 32 experts of
    1792, 4 a token, past 2 dense layers of 7168)."""
    attention = (2, 6, 10, 14, 18, 21)
    raw = {
        "architectures": ["Lfm2MoeForCausalLM"],
        "model_type": "lfm2_moe",
        "vocab_size": 65536,
        "hidden_size": 2048,
        "intermediate_size": 7168,
        "moe_intermediate_size": 1792,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_dense_layers": 2,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "routed_scaling_factor": 1.0,
        "conv_L_cache": 3,
        "conv_bias": False,
        "norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 128000,
        "layer_types": ["full_attention" if i in attention else "conv" for i in range(24)],
    }
    config = hf_model_config(raw)
    assert (config.architecture, config.num_local_experts, config.num_experts_per_tok) == (
        "lfm2_moe",
        32,
        4,
    )
    assert (config.intermediate_size, config.dense_intermediate_size) == (1792, 7168)
    assert [config.layer_has_experts(i) for i in range(4)] == [False, False, True, True]
    assert [config.layer_mlp_width(i) for i in (1, 2)] == [7168, 1792]
    assert (config.router_scoring, config.expert_selection_bias) == ("sigmoid", True)
    assert config.tie_word_embeddings and config.conv_history == 2
    assert [i for i in range(24) if not config.layer_is_conv(i)] == list(attention)
    with pytest.raises(Exception, match="conv_bias"):
        hf_model_config({**raw, "conv_bias": True})


def test_steps_match_transformers_logits(hf: transformers.PreTrainedModel, hf_dir: Path) -> None:
    """fp32, torch: a mixed prefill step, a chunk beside a decode, decodes alone and together:
    the logits of transformers' forward over each whole sequence."""
    assert_mixed_steps_match_transformers(_model(hf_dir, torch.float32), hf, SMALL_VOCAB)


def test_its_gguf_is_the_same_model(
    hf: transformers.PreTrainedModel, hf_dir: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """The F32 GGUF llama.cpp's converter writes (lfm2moe: leading_dense_block_count,
    expert_gating_func sigmoid, exp_probs_b): the same config and weights as the HF
    directory, bit for bit."""
    path = family_checkpoint("f32", hf, tmp_path, tokenizer_dir)
    from_gguf, from_hf = load_model(path, torch.float32), load_model(hf_dir, torch.float32)
    config: ModelConfig = read_gguf_config(path)
    for field in (
        "architecture",
        "intermediate_size",
        "dense_intermediate_size",
        "leading_dense_layers",
        "num_local_experts",
        "num_experts_per_tok",
        "router_scoring",
        "expert_selection_bias",
        "norm_topk_prob",
        "conv_layers",
        "conv_kernel",
    ):
        assert getattr(config, field) == getattr(from_hf.config, field), field
    assert set(from_gguf.weights) == set(from_hf.weights)
    for name, tensor in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[name], tensor, rtol=0, atol=0, msg=name)


@needs_kernels
@pytest.mark.parametrize("kind", ["hf", "q8_0"])
def test_the_experts_in_one_call_are_the_block_op_by_op(
    hf: transformers.PreTrainedModel,
    hf_dir: Path,
    tmp_path: Path,
    tokenizer_dir: Path,
    kind: str,
    kernel_isa: str,
) -> None:
    """kernels/csrc/moe.cpp's `experts_mlp` with sigmoid scores and a selection bias against
    the same block op by op on the same tiled kernels, on every kernel variant this CPU
    runs (bf16 experts, and Q8_0 blocks from a GGUF): the same routing, outputs one bf16
    rounding apart at most."""
    path = hf_dir if kind == "hf" else family_checkpoint(kind, hf, tmp_path, tokenizer_dir)
    model = _model(path, torch.bfloat16, "tiled")
    generator = torch.Generator().manual_seed(0)
    blocks = [layer.moe for layer in model.layers if layer.moe is not None]
    assert len(blocks) == 2 and model.layers[0].moe is None
    for block in blocks:
        assert block.kernel is not None and block.selection_bias is not None
        for tokens in (1, 3, 40, 90):
            x = torch.randn(tokens, block.hidden, generator=generator).bfloat16()
            residual = torch.randn(tokens, block.hidden, generator=generator).bfloat16()
            got, want = block.run(x, residual), block.run_ops(x, residual)
            torch.testing.assert_close(got, want, atol=0.02, rtol=0.02)
            assert (got != want).float().mean() < 0.01


@needs_kernels
def test_the_fused_layers_keep_the_torch_logits(hf_dir: Path) -> None:
    """A step's layers in one decoder_stack call (conv layers, the dense leading MLP, the
    experts with their sigmoid routing) against the same bf16 weights op by op through torch,
    over a prefill, a chunk and decodes: rows within bf16's reach, the greedy token kept
    where the top two stand clear apart."""
    assert_fused_layers_keep_the_torch_logits(
        lambda fast: _model(hf_dir, torch.bfloat16, "tiled" if fast else "torch")
    )


def test_the_selection_bias_stays_fp32_in_a_bf16_model(
    hf: transformers.PreTrainedModel, hf_dir: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """The biases pick among sigmoid scores a bf16 rounding apart: kept at the checkpoint's
    fp32, as transformers and llama.cpp keep them, from the HF directory and the GGUF."""
    want = hf.model.layers[1].feed_forward.expert_bias
    assert not torch.equal(want.bfloat16().float(), want)
    for path in (hf_dir, family_checkpoint("f32", hf, tmp_path, tokenizer_dir)):
        loaded = load_model(path, torch.bfloat16)
        model = LlamaForCausalLM(loaded.config, torch.bfloat16, torch.device("cpu"))
        model.load(loaded.weights, "torch")
        assert model.layers[1].moe is not None
        got = model.layers[1].moe.selection_bias
        assert got is not None and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)
