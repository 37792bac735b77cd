"""gpt-oss (model/family.py: attention sinks, biased and clamped experts, a window on every
other layer, YaRN) against transformers on a tiny random checkpoint, fp32, through the
loader's unstacking of its expert tensors; and the C++ attention with sinks and the tiled
experts against eager."""

from __future__ import annotations

import dataclasses
import json
import random
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from test_fast_paths import _assert_as_close_as_bf16

from iterserve import kernels
from iterserve.model import moe
from iterserve.model.gguf_loader import gguf_model_config, read_gguf_header
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loaded import LoadedModel
from iterserve.model.loader import load_model
from paged_runner import PagedRunner
from tiny_checkpoints import hf_token_by_token, save_checkpoint
from tiny_families import ORIGINAL, VOCAB, family_checkpoint, gguf_metadata, gpt_oss_model
from tiny_gguf import write_gguf
from transformers_reference import assert_same_greedy

# Chunks over cached prefixes and decodes, past the first layer's window (16) and YaRN's
# original context (64).
PLANS = ([("s0", 30), ("s1", 12)], [("s1", 1), ("s0", 45)], [("s1", 1), ("s0", 15)])


@pytest.fixture(scope="module")
def hf() -> transformers.PreTrainedModel:
    return gpt_oss_model()


@pytest.fixture(scope="module")
def checkpoint(
    hf: transformers.PreTrainedModel, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    return save_checkpoint(hf, tmp_path_factory.mktemp("gpt-oss"), tokenizer_dir)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(3)
    return {f"s{i}": [rng.randrange(VOCAB) for _ in range(n)] for i, n in enumerate((90, 20))}


def _steps(model: LlamaForCausalLM, paged_kernel: bool = False) -> list[dict[str, torch.Tensor]]:
    """Each step's logits of every row, by sequence, for the two _prompts through PLANS."""
    runner = PagedRunner(model, block_size=8, num_blocks=64, paged_kernel=paged_kernel)
    for seq, tokens in _prompts().items():
        runner.add(seq, tokens)
    return [{seq: rows.float() for seq, rows in runner.step(plan).items()} for plan in PLANS]


def _run(model: LlamaForCausalLM, paged_kernel: bool = False) -> dict[str, torch.Tensor]:
    """Every row's logits, by sequence."""
    steps = _steps(model, paged_kernel)
    return {seq: torch.cat([step[seq] for step in steps]) for seq in steps[0]}


@pytest.mark.parametrize("kind", ["hf", "f32"])
def test_checkpoint_matches_transformers_through_chunks_and_decodes(
    hf: transformers.PreTrainedModel,
    checkpoint: Path,
    kind: str,
    tmp_path: Path,
    tokenizer_dir: Path,
) -> None:
    """An HF directory (the loader unstacks its experts) and a GGUF file as llama.cpp's
    converter writes one (GGUF has no SwiGLU limit: llama.cpp's 7 is the model's own)."""
    if kind != "hf":
        hf = gpt_oss_model(swiglu_limit=7.0)
        checkpoint = family_checkpoint(kind, hf, tmp_path, tokenizer_dir)
    loaded = load_model(checkpoint, torch.float32)
    config = loaded.config
    assert config.architecture == "gpt_oss" and config.attention_bias
    assert config.sliding_window_layers == (True, False)
    assert config.swiglu_clamp == (1.702, hf.config.swiglu_limit)
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    ours = LlamaForCausalLM(config, torch.float32, torch.device("cpu"))
    ours.load_weights(loaded.weights)
    got = _run(ours)
    prompts = _prompts()
    for seq, logits in got.items():
        tokens = prompts[seq][: len(logits)]
        want = hf_token_by_token(hf, tokens, prompt=min(len(tokens), ORIGINAL))
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
    if kind != "hf":
        return
    # Each of gpt-oss's own parts moves these logits: the comparison would see one dropped.
    for layer in ours.layers:
        layer.sinks.fill_(float("-inf"))  # exp(-inf): no share of any softmax
    assert (_run(ours)["s0"] - got["s0"]).abs().max() > 0.05
    ours.load_weights(loaded.weights)
    for layer in ours.layers:
        layer.moe.swiglu_clamp = (1.702, float("inf"))
    assert (_run(ours)["s0"] - got["s0"]).abs().max() > 0.05


# e2m1's values, as OpenAI's checkpoints index them (transformers' integrations/mxfp4.py).
FP4_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _openai_mxfp4(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert stack [experts, inputs, outputs] as OpenAI's checkpoints keep it: each
    weight the nearest e2m1 value over its block's power-of-two scale; blocks [experts,
    outputs, inputs / 32, 16] (input 2i in byte i's low nibble), E8M0 scales [experts,
    outputs, inputs / 32]."""
    groups = stack.float().transpose(1, 2).unflatten(2, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6))
    codes = ((groups / torch.exp2(exponent)).unsqueeze(-1) - FP4_VALUES).abs().argmin(-1)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent[..., 0] + 127).to(torch.uint8).contiguous()


@pytest.fixture(scope="module")
def openai_mxfp4_checkpoint(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model as OpenAI ships gpt-oss: an HF directory whose experts are MXFP4 blocks
    and scales (config.json's quantization_config says so), the rest as it was."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("gpt-oss-openai-mxfp4")
    for item in checkpoint.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            (out / item.name).write_bytes(item.read_bytes())
    weights = load_file(checkpoint / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = _openai_mxfp4(weights.pop(name))
    save_file(weights, out / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_openai_mxfp4_checkpoints_match_transformers(
    hf: transformers.PreTrainedModel, openai_mxfp4_checkpoint: Path
) -> None:
    """OpenAI's MXFP4 experts are read as GGUF MXFP4 blocks (no bf16 copy is made: the
    model runs from them): their values are transformers' dequantization of the same file
    exactly, and the logits transformers'."""
    loaded = load_model(openai_mxfp4_checkpoint, torch.float32)
    experts = hf.config.num_hidden_layers * hf.config.num_local_experts * 3
    assert len(loaded.quantized) == experts
    assert {blocks.format.name for blocks in loaded.quantized.values()} == {"MXFP4"}
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        openai_mxfp4_checkpoint,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
    )
    theirs = reference.model.layers[1].mlp.experts
    for expert in range(hf.config.num_local_experts):
        gate_up = theirs.gate_up_proj[expert].detach()
        prefix = f"model.layers.1.mlp.experts.{expert}"
        assert torch.equal(loaded.weights[f"{prefix}.gate_proj.weight"], gate_up[:, 0::2].T)
        assert torch.equal(loaded.weights[f"{prefix}.up_proj.weight"], gate_up[:, 1::2].T)
        down = theirs.down_proj[expert].detach().T
        assert torch.equal(loaded.weights[f"{prefix}.down_proj.weight"], down)
    assert not torch.equal(gate_up, hf.model.layers[1].mlp.experts.gate_up_proj[expert])
    ours = LlamaForCausalLM(loaded.config, torch.float32, torch.device("cpu"))
    ours.load_weights(loaded.weights)
    prompts = _prompts()
    for seq, logits in _run(ours).items():
        tokens = prompts[seq][: len(logits)]
        want = hf_token_by_token(reference, tokens, prompt=min(len(tokens), ORIGINAL))
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(
    hf: transformers.PreTrainedModel, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    """The model as a GGUF whose experts are MXFP4 (as gpt-oss's GGUFs keep them), the rest
    F32."""
    experts = [
        f"model.layers.{i}.mlp.experts.{projection}.weight"
        for i in range(hf.config.num_hidden_layers)
        for projection in ("gate", "up", "down")
    ]
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "tiny.mxfp4.gguf"
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    metadata, _ = gguf_metadata(hf)
    write_gguf(
        path,
        "gpt-oss",
        hf,
        tokenizer,
        rope_freq_base=hf.config.rope_parameters["rope_theta"],
        metadata=metadata,
        qtypes=dict.fromkeys(experts, "MXFP4"),
    )
    return path


@pytest.mark.skipif(
    not kernels.available(), reason=f"C++ kernels unavailable: {kernels.why_unavailable()}"
)
@pytest.mark.usefixtures("kernel_isa")
def test_fast_paths_keep_the_eager_greedy_tokens(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16: the C++ paged attention with sinks and the experts on the tiled kernels (with
    their biases, op by op) against eager attention and plain torch projections. Two router
    logits may tie in bf16 (this model's do, exactly, on one row), and then a rounding
    upstream flips a token's experts: rows routed differently are left out, and must be
    rare."""
    routed: list[torch.Tensor] = []

    def recording(
        logits: torch.Tensor, routing: moe.Routing, selection_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(logits, routing, selection_bias)
        routed.append(experts.sort(dim=1).values)
        return weights, experts

    route = moe.route
    monkeypatch.setattr(moe, "route", recording)
    config = load_model(checkpoint, torch.float32).config
    rows, routings = {}, {}
    for fast in (False, True):
        model = LlamaForCausalLM(config, torch.bfloat16, torch.device("cpu"))
        model.load(load_model(checkpoint, torch.float32).weights, "tiled" if fast else "torch")
        # Op by op on the tiled kernels, so `routed` sees it (the layers and experts in one
        # call: the tests below).
        assert model.fused_layers == fast
        model.fused_layers = False
        for layer in model.layers:
            assert (layer.moe.kernel is not None) == fast
            layer.moe.kernel = None
        routed.clear()
        # Rows in each step's flat order (decodes first, as PagedRunner lays them out), and
        # each step's routing a layer at a time.
        steps = _steps(model, paged_kernel=fast)
        rows[fast] = torch.cat(
            [
                step[seq]
                for plan, step in zip(PLANS, steps, strict=True)
                for seq, k in sorted(plan, key=lambda item: item[1] != 1)
            ]
        )
        routings[fast] = list(routed)
    layers = config.num_hidden_layers
    same = torch.cat(
        [
            torch.stack(
                [
                    (routings[False][s * layers + i] == routings[True][s * layers + i]).all(1)
                    for i in range(layers)
                ]
            ).all(0)
            for s in range(len(PLANS))
        ]
    )
    assert int(same.sum()) >= 0.95 * len(same), f"{int((~same).sum())} rows routed differently"
    assert_same_greedy([rows[False][same]], [rows[True][same]])


def _three_roads(
    loaded: LoadedModel,
) -> tuple[dict[str, list[torch.Tensor]], dict[str, LlamaForCausalLM]]:
    """Every row's logits (by sequence, through PLANS) and the model, of three roads over
    the same weights: fp32 torch ("reference"), bf16 torch ("bf16"), and bf16 on the tiled
    kernels with the paged attention op, the file's blocks kept ("fast")."""
    rows, models = {}, {}
    for name, dtype, backend in (
        ("reference", torch.float32, "torch"),
        ("bf16", torch.bfloat16, "torch"),
        ("fast", torch.bfloat16, "tiled"),
    ):
        model = LlamaForCausalLM(loaded.config, dtype, torch.device("cpu"))
        model.load(loaded.weights, backend, loaded.quantized)
        rows[name] = list(_run(model, paged_kernel=backend == "tiled").values())
        models[name] = model
    return rows, models


@pytest.mark.skipif(
    not kernels.available(), reason=f"C++ kernels unavailable: {kernels.why_unavailable()}"
)
@pytest.mark.usefixtures("kernel_isa")
def test_the_fused_layers_take_gpt_oss(checkpoint: Path) -> None:
    """A step's layers in one decoder_stack call (attention sinks, biased and clamped
    experts in one experts_mlp call each, no compiled graph), through chunks over cached
    prefixes and decodes, against fp32 by the yardstick of plain bf16 there (the stack
    rounds its norms and rope where torch's ops do not, as a compiled graph does)."""
    rows, models = _three_roads(load_model(checkpoint, torch.float32))
    assert [m.fused_layers for m in models.values()] == [False, False, True]
    model = models["fast"]
    _assert_as_close_as_bf16(rows["reference"], rows["fast"], rows["bf16"], error_factor=2.0)
    # Without the sinks the stack computes another function: they reach the op.
    for layer in model.layers:
        layer.sinks.fill_(-30.0)
    model._stack = None
    without = torch.cat(list(_run(model, paged_kernel=True).values()))
    assert (without - torch.cat(rows["fast"])).abs().max() > 0.05


@pytest.mark.skipif(
    not kernels.available(), reason=f"C++ kernels unavailable: {kernels.why_unavailable()}"
)
def test_the_experts_in_one_call_are_the_block_op_by_op(checkpoint: Path, kernel_isa: str) -> None:
    """kernels/csrc/moe.cpp's `experts_mlp` with gpt-oss's biases (router, gate+up, down) and
    clamped SwiGLU, on its one-token, few-rows and many-rows roads, against the same block op
    by op on the same tiled kernels: the same routing, outputs a bf16 rounding apart."""
    loaded = load_model(checkpoint, torch.bfloat16)
    model = LlamaForCausalLM(loaded.config, torch.bfloat16, torch.device("cpu"))
    model.load(loaded.weights, "tiled")
    generator = torch.Generator().manual_seed(0)
    for layer in model.layers:
        block = layer.moe
        assert block.kernel is not None and block.kernel.swiglu == (1.702, 1.0)
        for tokens in (1, 3, 40, 90):
            x = torch.randn(tokens, block.hidden, generator=generator).bfloat16()
            residual = torch.randn(tokens, block.hidden, generator=generator).bfloat16()
            got, want = block.run(x, residual), block.run_ops(x, residual)
            torch.testing.assert_close(got, want, atol=0.02, rtol=0.02)
            assert (got != want).float().mean() < 0.02
        # Without the biases and the clamp the op is another function: they are applied.
        block.kernel = dataclasses.replace(block.kernel, router_bias=None, swiglu=(0.0, 0.0))
        assert (block.run(x, residual) - want).abs().max() > 0.1


@pytest.mark.skipif(
    not kernels.available(), reason=f"C++ kernels unavailable: {kernels.why_unavailable()}"
)
@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("kind", ["gguf", "openai"])
def test_mxfp4_experts_run_from_their_blocks(kind: str, request: pytest.FixtureRequest) -> None:
    """MXFP4 experts (a GGUF's, and OpenAI's HF checkpoint's) on the tiled kernels, in their
    own blocks against activations rounded to 8 bits a block of 32 (and in the experts op),
    against the same file's weights (dequantized by the gguf package) in fp32, by the
    yardstick of plain bf16 there."""
    fixture = "mxfp4_checkpoint" if kind == "gguf" else "openai_mxfp4_checkpoint"
    rows, models = _three_roads(load_model(request.getfixturevalue(fixture), torch.float32))
    fast = models["fast"]
    assert fast.describe_linears()["experts"] == "4 experts, top-2, tiled-MXFP4"
    assert all(layer.moe.kernel is not None for layer in fast.layers)
    _assert_as_close_as_bf16(
        rows["reference"], rows["fast"], rows["bf16"], error_factor=2.5, miss_share=0.03
    )


def test_both_harmony_ends_of_a_turn_stop_a_gguf(mxfp4_checkpoint: Path) -> None:
    """A gpt-oss GGUF names one end as eos; <|return|> (an answer's) and <|call|> (a tool
    call's) both stop, found by their text as llama.cpp finds them."""
    metadata, tensors = read_gguf_header(mxfp4_checkpoint)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    tokens[5], tokens[7] = "<|return|>", "<|call|>"
    config = gguf_model_config({**metadata, "tokenizer.ggml.tokens": tokens}, tensors)
    assert config.eos_token_ids == (2, 5, 7)


def test_a_gguf_rewritten_in_openai_layout_keeps_its_blocks(
    mxfp4_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/openai_layout.py's OpenAI-layout copy of a gpt-oss GGUF reads back (through
    model/safetensors_mxfp4.py) as the GGUF's own MXFP4 blocks, byte for byte."""
    script = Path(__file__).parents[2] / "benchmarks" / "openai_layout.py"
    monkeypatch.setattr("sys.argv", [str(script), str(mxfp4_checkpoint), "--out", str(tmp_path)])
    runpy.run_path(str(script), run_name="__main__")
    gguf, openai = load_model(mxfp4_checkpoint), load_model(tmp_path)
    assert openai.quantized.keys() == {n for n in gguf.quantized if ".mlp.experts." in n}
    for name, blocks in openai.quantized.items():
        np.testing.assert_array_equal(blocks.read(), gguf.quantized[name].read())
        np.testing.assert_array_equal(blocks.read(3, 9), gguf.quantized[name].read(3, 9))
    for name in ("model.layers.1.mlp.experts.2.up_proj.bias", "model.layers.0.self_attn.sinks"):
        torch.testing.assert_close(openai.weights[name], gguf.weights[name].bfloat16())
