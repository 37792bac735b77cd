"""A GGUF whose projections are in every block format the kernels keep, read as iterserve
reads any GGUF: the loader keeps each quantized tensor as a reference to its bytes, the model
builds its kernels' tiles from them (q/k rows un-permuted, parts of different formats fused
into one projection, a vocabulary that is not whole tiles), and the network computes what
the same weights dequantized compute in fp32, within what int8 activations cost."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_fast_paths import _assert_as_close_as_bf16, _run, _tokens
from test_loader import tiny_tokenizer  # noqa: F401 (a fixture)
from transformers import PreTrainedTokenizerFast

from iterserve.model.gguf_blocks import GGUFBlocks
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loaded import LoadedModel
from iterserve.model.loader import load_model
from tiny_checkpoints import tiny_hf_model
from tiny_gguf import write_gguf

# Per layer, the GGUF type of each projection: every block format, 256-input rows (hidden 256,
# intermediate 512) so that the K-quants fit.
_TYPES = {
    0: {
        "q": "Q4_K",
        "k": "Q4_K",
        "v": "Q6_K",
        "o": "Q5_K",
        "gate": "IQ4_XS",
        "up": "Q3_K",
        "down": "Q2_K",
    },
    1: {
        "q": "Q4_0",
        "k": "Q5_0",
        "v": "Q8_0",
        "o": "Q4_1",
        "gate": "IQ4_NL",
        "up": "Q5_1",
        "down": "MXFP4",
    },
}
_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
    "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}  # fmt: skip


@pytest.fixture(scope="module")
def every_format(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_tokenizer: PreTrainedTokenizerFast,  # noqa: F811 (test_loader's fixture)
) -> LoadedModel:
    hf = tiny_hf_model(
        "llama",
        vocab_size=300,  # 18.75 tiles: the tied head's last tile is padded
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    qtypes = {
        f"model.layers.{layer}.{_MODULES[part]}.weight": qtype
        for layer, parts in _TYPES.items()
        for part, qtype in parts.items()
    }
    qtypes["model.embed_tokens.weight"] = "Q6_K"
    path = tmp_path_factory.mktemp("gguf") / "every-format.gguf"
    write_gguf(path, "llama", hf, tiny_tokenizer, rope_freq_base=1e4, qtypes=qtypes)
    return load_model(path, dtype=torch.float32)


def _network(
    loaded: LoadedModel, dtype: torch.dtype, backend: str, mode: str = "blocks"
) -> LlamaForCausalLM:
    model = LlamaForCausalLM(loaded.config, dtype, torch.device("cpu"))
    model.load(loaded.weights, backend, loaded.quantized, mode)  # type: ignore[arg-type]
    return model


def test_the_loader_keeps_every_block_format_as_a_reference(every_format: LoadedModel) -> None:
    kept = every_format.quantized
    assert {b.format.name for b in kept.values()} == {
        *_TYPES[0].values(),
        *_TYPES[1].values(),
        "Q6_K",
    }
    assert all(isinstance(b, GGUFBlocks) for b in kept.values())
    # q and k carry llama.cpp's rope permutation, undone as rows of the tiles.
    q = kept["model.layers.0.self_attn.q_proj.weight"]
    assert q.rows is not None and kept["model.layers.0.self_attn.v_proj.weight"].rows is None
    for name, blocks in kept.items():  # the dequantized tensors are the blocks' values
        assert torch.equal(blocks.dequantize(), every_format.weights[name]), name


@pytest.mark.usefixtures("kernel_isa")
def test_every_format_computes_what_its_dequantized_weights_do(every_format: LoadedModel) -> None:
    """The tiled network over the file's blocks against the fp32 torch network over the same
    weights dequantized: int8 activations (8 bits a block of 32) cost ~3x bf16's error."""
    tokens = _tokens(5, lengths=(48, 40, 56))
    tokens = [[t % 300 for t in seq] for seq in tokens]
    reference = _run(_network(every_format, torch.float32, "torch"), tokens, kernel=False)
    bf16 = _run(_network(every_format, torch.bfloat16, "torch"), tokens, kernel=False)
    blocks = _network(every_format, torch.bfloat16, "tiled")
    assert blocks.describe_linears()["qkv"] == "tiled-Q4_K+Q6_K"  # layer 0's: two formats, one op
    assert blocks.describe_linears()["lm_head"] == "tiled-Q6_K"
    assert blocks.fused_layers
    fast = _run(blocks, tokens, kernel=True)
    _assert_as_close_as_bf16(reference, fast, bf16, error_factor=3.5, miss_share=0.03)
    # --weights bf16: the same file made dense, exact to the dequantized weights in bf16.
    dense = _network(every_format, torch.bfloat16, "tiled", mode="bf16")
    assert set(dense.describe_linears().values()) == {"tiled-bf16"}
    _assert_as_close_as_bf16(reference, _run(dense, tokens, kernel=True), bf16, error_factor=1.5)


@pytest.mark.usefixtures("kernel_isa")
def test_the_network_holds_about_the_files_bytes(every_format: LoadedModel) -> None:
    """Tiles are the file's blocks re-laid (a few % more where 6-bit scales become bytes), the
    tied embedding is read from the head's tiles, and nothing else is held."""
    model = _network(every_format, torch.bfloat16, "tiled")
    stored = sum(b.nbytes for b in every_format.quantized.values())
    small = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.embedding is not None and model.embedding.nbytes == 0
    held = model.weight_bytes() - small
    # The head's padding to whole tiles (300 -> 304 rows) and byte scales: under 6% here.
    assert stored <= held <= 1.06 * stored


def test_a_type_without_kernel_is_dequantized_and_named(
    tmp_path: Path,
    tiny_tokenizer: PreTrainedTokenizerFast,  # noqa: F811 (test_loader's fixture)
    caplog: pytest.LogCaptureFixture,
) -> None:
    hf = tiny_hf_model("llama", vocab_size=300, hidden_size=256, intermediate_size=256)
    path = tmp_path / "iq2.gguf"
    write_gguf(
        path, "llama", hf, tiny_tokenizer, qtypes={"model.layers.0.mlp.down_proj.weight": "IQ2_XXS"}
    )
    with caplog.at_level("WARNING", logger="iterserve.gguf"):
        loaded = load_model(path, dtype=torch.float32)
    assert "IQ2_XXS" in caplog.text and "dequantized" in caplog.text
    assert "model.layers.0.mlp.down_proj.weight" not in loaded.quantized
    assert loaded.weights["model.layers.0.mlp.down_proj.weight"].abs().sum() > 0
