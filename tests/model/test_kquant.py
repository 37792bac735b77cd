"""K-quant (Q4_K, Q5_K, Q6_K) and 5-bit (Q5_0, Q5_1) blocks: unpacked exactly as the `gguf`
package's reference dequantizer reads them, the qk kernel against dequantize-then-matmul, and
the qk-int8 kernel against the dequantized weights times the int8-rounded activations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from test_fast_paths import _assert_as_close_as_bf16, _model, _run, _tokens
from test_loader import tiny_tokenizer  # noqa: F401 (a fixture)
from transformers import PreTrainedTokenizerFast

from iterserve import kernels
from iterserve.model.kquant import BLOCK_SIZES, KQuantWeight, from_gguf_kquant
from iterserve.model.quant import quantize_activations
from tiny_checkpoints import tiny_hf_model
from tiny_gguf import write_gguf

QK_INT8 = 5  # csrc/linear.cpp Format::kQKInt8

# Byte offsets of each type's fp16 fields within a block (the rest is random bits).
_FP16_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2)}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """[n, k] weights' worth of random GGUF blocks, with fp16 scales in [-scale, scale]."""
    nbytes, size = BLOCK_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * k // size, nbytes), dtype=np.uint8)
    for at in _FP16_AT[qtype]:
        values = rng.uniform(-scale, scale, raw.shape[0]).astype(np.float16)
        raw[:, at : at + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES))
def test_blocks_unpack_bit_exactly_like_the_gguf_reference(qtype: str) -> None:
    n, k = 16, 512
    raw = random_blocks(qtype, n, k)
    expected = dequantize(raw, GGMLQuantizationType[qtype])
    weight = from_gguf_kquant(raw, qtype, (n, k))
    np.testing.assert_array_equal(weight.dequantize().numpy(), expected)
    # Row selection and fusing keep every element where it was.
    order = torch.randperm(n)
    fused = KQuantWeight.cat([weight.rows(order), weight])
    np.testing.assert_array_equal(
        fused.dequantize().numpy(), np.concatenate([expected[order], expected])
    )


@pytest.mark.usefixtures("any_kernel_isa")
@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6])
def test_qk_int8_tiles_match_quantized_activations_times_dequantized_weights(
    qtype: str, rows: int
) -> None:
    n, k = 80, 512
    weight = from_gguf_kquant(random_blocks(qtype, n, k, seed=rows), qtype, (n, k))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[0, 32:64] = 0  # an all-zero block: scale 0
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    tiles, scales = weight.tiles()
    out = kernels.ops().tiled_linear(
        x, tiles, scales, None, residual, QK_INT8 + 256 * weight.zero, None, None, 0, 64
    )
    xq, xs = quantize_activations(x)
    x_rounded = (xq.double().view(rows, k // 32, 32) * xs.double()[..., None]).view(rows, k)
    w = weight.dequantize().double()
    reference = x_rounded @ w.T + residual.double()
    # One rounding to bf16 plus fp32 summation slack against the size of the terms summed.
    scale = (x_rounded.abs() @ w.abs().T).max()
    allowed = reference.abs() * 2.0**-8 + 2e-5 * scale
    assert bool(((out.double() - reference).abs() <= allowed).all())
    # And it is a fair stand-in for the exact product: int8 activations' error, no more.
    exact = x.double() @ w.T + residual.double()
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.usefixtures("kernel_isa")
def test_a_k_quant_model_computes_what_its_dequantized_weights_do() -> None:
    """A tiny model as llama.cpp's Q4_K_M stores one whose rows are too short for K-quants:
    Q5_1 q/k/v and gate/up (quantized from its weights with the gguf package), Q5_0 o, and a
    Q6_K down projection (256 inputs: one super-block; random blocks; the 4-bit form is
    checked by the kernel tests above). Its fast path
    against the fp32 reference over the same dequantized weights, by bf16's yardstick."""
    hf = tiny_hf_model(
        vocab_size=300, weight_std=0.1, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    weights, quantized = {}, {}
    for name, tensor in hf.state_dict().items():
        shape = tuple(tensor.shape)
        if name.endswith("down_proj.weight"):
            raw = random_blocks("Q6_K", *shape, seed=len(weights), scale=3e-4)
            qtype = "Q6_K"
        elif name.endswith("proj.weight"):
            qtype = "Q5_0" if name.endswith("o_proj.weight") else "Q5_1"
            raw = quantize(tensor.numpy().astype(np.float32), GGMLQuantizationType[qtype])
        else:
            weights[name] = tensor
            continue
        quantized[name] = from_gguf_kquant(raw, qtype, shape)  # type: ignore[arg-type]
        weights[name] = quantized[name].dequantize()
    tokens = _tokens(7, lengths=(48, 40, 56))
    reference = _run(_model(hf, torch.float32, weights=weights), tokens, kernel=False)
    bf16 = _run(_model(hf, torch.bfloat16, weights=weights), tokens, kernel=False)
    blocks = _model(hf, torch.bfloat16, "tiled", weights, quantized, wide=False)  # type: ignore[arg-type]
    assert {kind for name, kind in blocks.describe_linears().items() if name != "lm_head"} == {
        "tiled-qk-int8"
    }
    _assert_as_close_as_bf16(reference, _run(blocks, tokens, kernel=True), bf16)


def test_a_gguf_keeps_k_quants_and_says_which_types_it_expands(
    tmp_path: Path,
    tiny_tokenizer: PreTrainedTokenizerFast,  # noqa: F811 (test_loader's fixture)
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Written with the gguf package: layer 0's down projection in Q4_K, layer 1's in Q2_K
    (no kernel). The first stays in its blocks, the second is dequantized with a log line
    naming Q2_K, and both load as the gguf reference dequantizes them."""
    import gguf

    from iterserve.model.loader import load_model

    raw = {"blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q2_K"}
    written: dict[str, np.ndarray] = {}
    add_tensor = gguf.GGUFWriter.add_tensor

    def add_quantized(self, name, tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name not in raw:
            return add_tensor(self, name, tensor, *args, **kwargs)
        qtype = GGMLQuantizationType[raw[name]]
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        rows, k = tensor.shape
        blocks = np.random.default_rng(rows).integers(0, 256, (rows * k // block, nbytes))
        blocks = blocks.astype(np.uint8)
        at = 0 if raw[name] == "Q4_K" else nbytes - 4  # Q2_K: d, dmin at its end
        scales = np.random.default_rng(k).uniform(-1e-3, 1e-3, (len(blocks), 2))
        blocks[:, at : at + 4] = scales.astype(np.float16).view(np.uint8)
        written[name] = blocks.reshape(rows, -1)
        return add_tensor(self, name, written[name], raw_dtype=qtype)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_quantized)
    model = tiny_hf_model("llama", vocab_size=300, intermediate_size=256)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", model, tiny_tokenizer, rope_freq_base=1e5)
    with caplog.at_level("WARNING", logger="iterserve.gguf"):
        loaded = load_model(path, dtype=torch.float32)
    assert "Q2_K" in caplog.text and "dequantized" in caplog.text
    kept = loaded.quantized["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(kept, KQuantWeight) and kept.bits == 4
    assert "model.layers.1.mlp.down_proj.weight" not in loaded.quantized
    for layer, name in enumerate(raw):
        qtype = GGMLQuantizationType[raw[name]]
        expected = torch.from_numpy(dequantize(written[name], qtype))
        assert torch.equal(loaded.weights[f"model.layers.{layer}.mlp.down_proj.weight"], expected)
    assert torch.equal(kept.dequantize(), loaded.weights["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.usefixtures("kernel_isa")
def test_auto_keeps_4_bit_blocks_and_only_the_int8_copy_of_5_and_6_bit_ones() -> None:
    """What `--weights auto` holds per K-quant width (model/linear.py MAX_QUANTIZED_ROWS), as
    the startup log's weights line reports it, and that both forms compute the same layer."""
    from iterserve.model.linear import Linear

    n, k = 32, 256
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=gen).bfloat16()
    for qtype, held in (("Q4_K", ["qk-int8", "i8"]), ("Q5_K", ["i8"]), ("Q6_K", ["i8"])):
        weight = from_gguf_kquant(random_blocks(qtype, n, k), qtype, (n, k))
        dense = weight.dequantize(torch.bfloat16)
        auto = Linear(dense, backend="tiled", quantized=weight, dense_format="i8")
        assert auto.held_formats() == held
        blocks = Linear(dense, backend="tiled", quantized=weight, wide=False)
        assert blocks.held_formats() == ["qk-int8"]
        reference = x.double() @ dense.double().T
        for linear in (auto, blocks):
            error = (linear(x).double() - reference).norm() / reference.norm()
            assert error.item() < 0.02
