"""The mixture-of-experts families (model/moe.py: Mixtral, Qwen3-MoE, OLMoE; Qwen2-MoE with its
shared expert, model/shared_expert.py) against transformers
on tiny random checkpoints, fp32: the logits of steps whose tokens go to several experts,
greedy tokens through the engine (chunked prefill, prefix-cache hits, preemption, tensor
parallelism), and the same model as a GGUF the way llama.cpp's converter writes each."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file
from test_fast_paths import _assert_as_close_as_bf16, _teacher_force

from conftest import BUNDLED_GGUF, _save_tiny, bundled_dir
from family_checks import assert_batch_invariant
from iterserve import LLM, SamplingParams, kernels
from iterserve.config import ConfigError
from iterserve.model import moe
from iterserve.model.gguf_loader import GGUFTensorInfo, gguf_model_config, read_gguf_header
from iterserve.model.linear import Backend
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import ModelLoadError, hf_model_config, load_model
from iterserve.model.lora_model import LoRAModel
from iterserve.model.moe import route
from moe_checks import (
    assert_fused_layers_keep_the_torch_logits,
    assert_mixed_steps_match_transformers,
)
from paged_runner import PagedRunner
from tiny_checkpoints import model_config_of, tiny_hf_model
from tiny_gguf import add_shape, llama_cpp_permute
from transformers_reference import PROMPTS, reference

EXPERTS, TOP_K = 4, 2
COMMON = dict(
    num_experts_per_tok=TOP_K,
    weight_std=0.15,  # every weight drawn afresh: routing varies from token to token
    tie_word_embeddings=False,
)
# Each family's config spelling of 4 experts of width 96. Qwen3-MoE renormalises the top-k
# weights as every released model does (and llama.cpp always does for its GGUF files).
SHAPES: dict[str, dict[str, object]] = {
    "mixtral": dict(num_local_experts=EXPERTS, intermediate_size=96, **COMMON),
    "qwen3_moe": dict(num_experts=EXPERTS, moe_intermediate_size=96, norm_topk_prob=True, **COMMON),
    # OLMoE: q and k normed whole, its top-k weights not renormalised (as OLMoE-1B-7B's); its
    # norms' widths follow hidden / heads, so heads of 32 are 2 of them (and 1 kv head).
    "olmoe": dict(
        num_experts=EXPERTS,
        intermediate_size=96,
        norm_topk_prob=False,
        num_attention_heads=2,
        num_key_value_heads=1,
        **COMMON,
    ),
    # Qwen2-MoE: q/k/v biases, the top-k weights not renormalised (as Qwen1.5-MoE-A2.7B's),
    # and a shared expert of 64 whose output a sigmoid gate scales.
    "qwen2_moe": dict(
        num_experts=EXPERTS,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,
        **COMMON,
    ),
}
# How each family's checkpoint names a layer's router and experts (model.layers.N.<prefix>.
# gate, <prefix>.experts.E.<projection>), and its GGUF architecture.
NAMES = {
    "mixtral": ("block_sparse_moe", {"gate": "w1", "down": "w2", "up": "w3"}, "llama"),
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "down": "down_proj", "up": "up_proj"}, "qwen3moe"),
    "olmoe": ("mlp", {"gate": "gate_proj", "down": "down_proj", "up": "up_proj"}, "olmoe"),
    "qwen2_moe": ("mlp", {"gate": "gate_proj", "down": "down_proj", "up": "up_proj"}, "qwen2moe"),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=list(SHAPES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def moe_dir(family: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return _save_tiny(
        family, tmp_path_factory.mktemp(f"tiny-{family}"), tokenizer_dir, **SHAPES[family]
    )


@pytest.fixture(scope="module")
def moe_kernel_dir(
    family: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    """moe_dir with heads of 32, which the C++ attention and fused layers take."""
    return _save_tiny(
        family,
        tmp_path_factory.mktemp(f"tiny-{family}-heads-32"),
        tokenizer_dir,
        head_dim=32,
        **SHAPES[family],
    )


@pytest.fixture(scope="module")
def moe_reference(moe_dir: Path) -> list[list[int]]:
    tokens = reference(moe_dir, PROMPTS, GREEDY.max_tokens)
    assert all(len(set(t)) > 3 for t in tokens), "degenerate text would prove little"
    return tokens


def _tiny_moe(
    family: str, out: Path, **overrides: object
) -> tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]]:
    """A 128-token-vocabulary model of `family` and its weights as its checkpoint names them
    (experts.E.w1/w2/w3 or gate_proj/up_proj/down_proj: transformers' in-memory names differ)."""
    shape = {"head_dim": 32, **SHAPES[family], **overrides}
    hf = tiny_hf_model(family, vocab_size=128, attn_implementation="eager", **shape)
    hf.save_pretrained(out)
    return hf, load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def tiny_moe(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]]:
    return _tiny_moe(family, tmp_path_factory.mktemp(f"tiny-{family}-128"))


def _ours(
    tiny: tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]],
    dtype: torch.dtype,
    backend: Backend = "torch",
) -> LlamaForCausalLM:
    model = LlamaForCausalLM(model_config_of(tiny[0]), dtype, torch.device("cpu"))
    model.load(tiny[1], backend)
    return model


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[torch.Tensor]]:
    """Every layer call's chosen experts [T, k], as the MoE block routed them."""
    calls: list[torch.Tensor] = []

    def recording(
        logits: torch.Tensor, routing: moe.Routing, selection_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(logits, routing, selection_bias)
        calls.append(experts)
        return weights, experts

    route = moe.route
    monkeypatch.setattr(moe, "route", recording)
    yield calls


def test_steps_routed_to_several_experts_match_transformers_logits(
    tiny_moe: tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]],
    routed: list[torch.Tensor],
) -> None:
    assert_mixed_steps_match_transformers(_ours(tiny_moe, torch.float32), tiny_moe[0], 128)
    assert routed[0].shape == (21, TOP_K)
    assert len(routed[0].unique()) == EXPERTS, "the first step's tokens should use every expert"


def test_a_lone_decode_token_matches_transformers(
    tiny_moe: tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]],
) -> None:
    """One token: only its k experts run."""
    hf = tiny_moe[0]
    runner = PagedRunner(_ours(tiny_moe, torch.float32), block_size=4)
    tokens = [5, 17, 99, 3, 64, 2]
    runner.add("s", tokens)
    rows = [runner.step([("s", 1)])["s"] for _ in tokens]
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.cat(rows), expected, atol=1e-4, rtol=0)


def test_qwen3_moe_without_renormalised_weights_matches_transformers(
    tmp_path: Path, routed: list[torch.Tensor]
) -> None:
    """norm_topk_prob=False (Qwen3MoeConfig's default): a token's k weights are the softmax's
    own probabilities, summing to less than one; renormalising them would miss by far more
    than the tolerance."""
    tiny = _tiny_moe("qwen3_moe", tmp_path, norm_topk_prob=False)
    assert tiny[0].config.norm_topk_prob is False
    ours = _ours(tiny, torch.float32)
    assert all(layer.moe.routing.renormalize is False for layer in ours.layers)
    runner = PagedRunner(ours, block_size=4)
    tokens = [5, 17, 99, 3, 64, 2, 88, 41, 7, 120]
    runner.add("s", tokens)
    rows = [runner.step([("s", 6)])["s"], runner.step([("s", 4)])["s"]]
    with torch.inference_mode():
        expected = tiny[0](torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.cat(rows), expected, atol=1e-4, rtol=0)
    assert len(routed[0].unique()) > TOP_K


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels do not run here")
def test_kernels_path_matches_the_torch_reference_in_bf16(
    tiny_moe: tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]],
    routed: list[torch.Tensor],
) -> None:
    """The experts on iterserve's tiled kernels (and attention on the paged op) against the
    same bf16 weights through plain torch: the fast path computes the same function. In bf16
    two router logits can tie or nearly so, and then a rounding upstream flips a token's
    experts (transformers' own bf16 path flips them too): such rows are left out, and must
    be rare."""
    logits = {}
    for backend in ("torch", "tiled"):
        ours = _ours(tiny_moe, torch.bfloat16, backend)
        # Op by op, so `routed` sees the routing (the tests below: the experts in one call).
        assert ours.fused_layers == (backend == "tiled")
        ours.fused_layers = False
        for layer in ours.layers:
            assert (layer.moe.kernel is not None) == (backend == "tiled")
            layer.moe.kernel = None
        runner = PagedRunner(ours, block_size=4, paged_kernel=backend == "tiled")
        runner.add("a", list(range(3, 40)))
        runner.add("b", list(range(60, 71)))
        prefill = runner.step([("a", 30), ("b", 10)])
        decode = runner.step([("a", 1), ("b", 1)])
        logits[backend] = torch.cat([prefill["a"], prefill["b"], decode["a"], decode["b"]])
    assert ours.describe_linears()["experts"].endswith("tiled-bf16")
    # Per path, per step, one routing per layer: a row is routed alike if every layer agrees.
    torch_path, tiled_path = routed[:4], routed[4:]
    same = torch.ones(42, dtype=torch.bool)
    for step, layer in ((0, 0), (0, 1), (1, 0), (1, 1)):
        rows = slice(0, 40) if step == 0 else slice(40, 42)
        a, b = torch_path[2 * step + layer], tiled_path[2 * step + layer]
        same[rows] &= (a.sort(dim=1).values == b.sort(dim=1).values).all(dim=1)
    assert same.sum() >= 40, f"{int((~same).sum())} of 42 rows routed differently"
    # bf16 roundings in different places (the kernels round each projection's output once,
    # torch's bf16 matmuls too, but attention and the residual adds differ) over logits of
    # magnitude ~1-5.
    torch.testing.assert_close(logits["tiled"][same], logits["torch"][same], atol=0.1, rtol=0.02)


@pytest.mark.parametrize("qtype", [None, "Q4_0", "Q8_0"])
def test_the_experts_in_one_call_are_the_block_op_by_op(
    tmp_path: Path, family: str, moe_dir: Path, qtype: str | None, kernel_isa: str
) -> None:
    """kernels/csrc/moe.cpp's `experts_mlp` (routing, grouping, every expert, the weighted
    scatter in one call; its one-token road, its few-rows road with experts shared between
    the threads, its many-rows road) against the same block run op by op on the same tiled
    kernels, on every kernel variant this CPU runs: the same routing, and outputs one bf16
    rounding apart at most (its SwiGLU is the fused layer's, not torch's)."""
    if qtype is None:
        loaded = load_model(moe_dir, torch.bfloat16)
    else:
        path = tmp_path / f"tiny-{family}.{qtype}.gguf"
        _write_moe_gguf(path, family, moe_dir, GGMLQuantizationType[qtype])
        loaded = load_model(path, torch.bfloat16)
    model = LlamaForCausalLM(loaded.config, torch.bfloat16, torch.device("cpu"))
    model.load(loaded.weights, "tiled", loaded.quantized or None)
    generator = torch.Generator().manual_seed(0)
    for layer in model.layers:
        block = layer.moe
        assert block.kernel is not None
        for tokens in (1, 3, 40, 90):  # 90 x 2 pairs: past the loop that scatters a few
            x = torch.randn(tokens, block.hidden, generator=generator).bfloat16()
            residual = torch.randn(tokens, block.hidden, generator=generator).bfloat16()
            got, want = block.run(x, residual), block.run_ops(x, residual)
            torch.testing.assert_close(got, want, atol=0.02, rtol=0.02)
            assert (got != want).float().mean() < 0.01
            if tokens == 90:
                routing = block.routing
                experts = route(F.linear(x, block.router_weight), routing, block.selection_bias)[1]
                assert len(experts.unique()) == EXPERTS
        # No residual (a tensor-parallel rank past the first): the outputs alone.
        torch.testing.assert_close(block.run(x, None), block.run_ops(x, None), atol=0.02, rtol=0.02)


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels do not run here")
def test_the_fused_layers_take_the_experts(
    tiny_moe: tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]],
) -> None:
    """A step's layers in one decoder_stack call, each layer's experts in one experts_mlp
    call inside it (no compiled graph), against the same bf16 weights op by op through
    torch: the greedy tokens where the top two logits stand clear apart, and the logits
    within bf16's reach, over a prefill, a chunk and decodes (Qwen2-MoE's shared expert and its
    gate inside the layer op too). (The experts op by op on the same kernels are as far from
    torch: 1 row in ~70 of these flips its argmax, both families.)"""
    assert_fused_layers_keep_the_torch_logits(
        lambda fast: _ours(tiny_moe, torch.bfloat16, "tiled" if fast else "torch")
    )


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels do not run here")
def test_lora_slots_run_a_model_of_experts_layer_by_layer(
    family: str, tiny_moe: tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]]
) -> None:
    """LoRA slots (on the attention projections: an expert has none) take the layers off the
    fused op, whose slots need a dense MLP; with no adapter in a slot the logits are the
    fused model's, but where a token's router is at a near-tie: the fused op's norms and
    rope round otherwise than the layers' (the test above), and such a token may take
    other experts in one than in the other. (Row 25 of this prompt: its top-k margin is
    7.6e-5 in Qwen3-MoE's first layer and 0.0069 in Mixtral's second, in fp32 torch; it
    went the reference's way in both until 2026-12-02 and the fused op's way since.) Such
    rows must be rare. Qwen2-MoE's shared expert adds a third rounded MLP output to each row:
    its rows lie up to ~0.14 apart (0.03-0.1 typically, as Qwen3-MoE's)."""
    rows = []
    for slots in (False, True):
        ours = _ours(tiny_moe, torch.bfloat16, "tiled")
        assert ours.fused_layers
        if slots:
            LoRAModel(ours, max_loras=2, max_rank=8)
            assert not ours.fused_layers and ours.lora is not None
        runner = PagedRunner(ours, block_size=4, paged_kernel=True)
        runner.add("a", list(range(3, 40)))
        rows.append(torch.cat([runner.step([("a", 30)])["a"], runner.step([("a", 1)])["a"]]))
    fused, slotted = rows[0].float(), rows[1].float()
    atol = 0.15 if family == "qwen2_moe" else 0.1
    close = (slotted - fused).abs().amax(-1) < atol + 0.02 * fused.abs().amax(-1)
    assert int((~close).sum()) <= 1, f"{int((~close).sum())} of {len(fused)} rows apart"
    torch.testing.assert_close(slotted[close], fused[close], atol=atol, rtol=0.02)


# The experts are one opaque op in the compiled graph whatever the family: Qwen2-MoE's
# layer (with its shared expert beside them, the most parts) stands for all of them.
@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
def test_compiled_engine_greedy_through_chunks_preemption_and_prefix_hits(
    moe_dir: Path, moe_reference: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """The compiled step (the experts one opaque op in the graph) on every kind of step; the
    start-up log says where the wait goes."""
    caplog.set_level(logging.INFO, logger="iterserve.model")
    llm = LLM(
        str(moe_dir),
        dtype="float32",
        compile=True,
        max_num_batched_tokens=7,  # every prompt chunked, decodes mixed in
        max_num_seqs=7,
        num_kv_blocks=20,  # prompts fit, outputs do not: preemption
        block_size=4,
    )
    assert llm.engine.model_plan.step == "compiled"
    assert "the layer stack compiles at warm-up (torch.compile)" in caplog.text
    for _ in range(2):  # the second pass starts from prefix-cache hits
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == moe_reference
    stats = llm.engine.scheduler.kv_cache_stats()
    assert llm.engine.scheduler.num_preemptions > 0
    assert stats.prefix_hits > 0 and stats.num_used_blocks == 0


@pytest.mark.slow
def test_tensor_parallel_greedy_is_transformers(
    family: str, moe_dir: Path, moe_reference: list[list[int]]
) -> None:
    """TP=2: each rank holds half of every expert's width; one all-reduce per MoE layer.
    OLMoE's q/k norms span every head, which a rank holds half of, and Qwen2-MoE's shared
    expert is not sliced: refused by name."""
    if family in ("olmoe", "qwen2_moe"):
        with pytest.raises(ConfigError, match=f"{family} runs on one rank only"):
            LLM(str(moe_dir), dtype="float32", tensor_parallel_size=2)
        return
    with LLM(
        str(moe_dir),
        dtype="float32",
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    ) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == moe_reference


def _write_moe_gguf(
    path: Path, family: str, model_dir: Path, experts_qtype: GGMLQuantizationType | None = None
) -> None:
    """The checkpoint as llama.cpp's converter writes the family: Mixtral as arch "llama"
    with its q/k rows permuted, Qwen3-MoE as "qwen3moe" with its q/k norms and expert width,
    OLMoE as "olmoe" with its q/k norms (over all heads); each layer's experts stacked [experts, rows, cols] per projection. F32 throughout, or the
    expert stacks in `experts_qtype`."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    weights = load_file(model_dir / "model.safetensors")
    metadata, _ = read_gguf_header(bundled_dir() / BUNDLED_GGUF)  # its tokenizer, as is
    moe, parts, arch = NAMES[family]
    writer = GGUFWriter(path, arch)
    add_shape(writer, config)
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if family in ("qwen3_moe", "qwen2_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)

    def add(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, np.ascontiguousarray(tensor.float().numpy()))

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    add("output.weight", weights["lm_head.weight"])
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for part in "qkvo":
            tensor = weights[f"{p}self_attn.{part}_proj.weight"]
            if part in heads and arch == "llama":
                tensor = torch.from_numpy(llama_cpp_permute(tensor.numpy(), heads[part]))
            add(f"blk.{i}.attn_{'output' if part == 'o' else part}.weight", tensor)
            if (bias := weights.get(f"{p}self_attn.{part}_proj.bias")) is not None:  # Qwen2
                add(f"blk.{i}.attn_{part}.bias", bias)
        if family == "qwen2_moe":  # its shared expert, and the gate's row as a vector
            for gguf_part, hf_part in parts.items():
                add(
                    f"blk.{i}.ffn_{gguf_part}_shexp.weight",
                    weights[f"{p}mlp.shared_expert.{hf_part}.weight"],
                )
            add(
                f"blk.{i}.ffn_gate_inp_shexp.weight",
                weights[f"{p}mlp.shared_expert_gate.weight"][0],
            )
        if family in ("qwen3_moe", "olmoe"):
            add(f"blk.{i}.attn_q_norm.weight", weights[f"{p}self_attn.q_norm.weight"])
            add(f"blk.{i}.attn_k_norm.weight", weights[f"{p}self_attn.k_norm.weight"])
        add(f"blk.{i}.attn_norm.weight", weights[f"{p}input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", weights[f"{p}post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate_inp.weight", weights[f"{p}{moe}.gate.weight"])
        for gguf_part, hf_part in parts.items():
            experts = [
                weights[f"{p}{moe}.experts.{e}.{hf_part}.weight"] for e in range(num_experts)
            ]
            stack = torch.stack(experts).float().numpy()
            name = f"blk.{i}.ffn_{gguf_part}_exps.weight"
            if experts_qtype is None:
                writer.add_tensor(name, np.ascontiguousarray(stack))
            else:
                writer.add_tensor(name, quantize(stack, experts_qtype), raw_dtype=experts_qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_loads_the_same_weights_and_tokens(
    tmp_path: Path, family: str, moe_dir: Path, moe_reference: list[list[int]]
) -> None:
    path = tmp_path / f"tiny-{family}.F32.gguf"
    _write_moe_gguf(path, family, moe_dir)
    from_gguf = load_model(path, torch.float32)
    from_hf = load_model(moe_dir, torch.float32)
    assert from_gguf.config.architecture == family
    assert (from_gguf.config.num_local_experts, from_gguf.config.num_experts_per_tok) == (
        EXPERTS,
        TOP_K,
    )
    assert set(from_gguf.weights) == set(from_hf.weights)
    for name, tensor in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[name], tensor, rtol=0, atol=0, msg=name)
    llm = LLM(str(path), dtype="float32", compile=False)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == moe_reference


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels do not run here")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_experts_from_a_quantized_gguf_run_in_their_blocks(
    tmp_path: Path, family: str, moe_dir: Path, qtype: str
) -> None:
    """Each expert of a quantized GGUF stack is kept in its own blocks (gate and up one
    projection of two parts) and runs on the block kernels (int8 activations): as close to
    fp32 over the dequantized weights as int8 activations allow (~3x bf16's error)."""
    path = tmp_path / f"tiny-{family}.{qtype}.gguf"
    _write_moe_gguf(path, family, moe_dir, GGMLQuantizationType[qtype])
    loaded = load_model(path, torch.float32)
    experts = {n for n in loaded.weights if ".experts." in n}
    assert len(experts) == 2 * EXPERTS * 3 and experts <= set(loaded.quantized)
    assert {loaded.quantized[n].format.name for n in experts} == {qtype}

    def run(dtype: torch.dtype, backend: Backend, quantized: bool) -> list[torch.Tensor]:
        model = LlamaForCausalLM(loaded.config, dtype, torch.device("cpu"))
        model.load(loaded.weights, backend, loaded.quantized if quantized else None)
        if quantized:
            assert model.describe_linears()["experts"].endswith(f"tiled-{qtype}")
        runner = PagedRunner(model, block_size=8, num_blocks=64, paged_kernel=False)
        return _teacher_force(runner, tokens)

    rng = random.Random(8)
    tokens = [[rng.randrange(loaded.config.vocab_size) for _ in range(n)] for n in (48, 40, 44)]
    reference = run(torch.float32, "torch", False)
    bf16 = run(torch.bfloat16, "torch", False)
    fast = run(torch.bfloat16, "tiled", True)
    _assert_as_close_as_bf16(reference, fast, bf16, error_factor=3.5, miss_share=0.03)


@pytest.mark.parametrize(
    "architecture",
    ["GraniteMoeSharedForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"],
)
def test_other_moe_families_are_refused_by_name(architecture: str) -> None:
    raw = {"architectures": [architecture], "hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(ModelLoadError, match=f"{architecture} is not supported.*Mixtral.*Qwen3"):
        hf_model_config(raw)


def test_granite_moe_with_a_shared_expert_gguf_is_refused() -> None:
    """llama.cpp writes GraniteMoeSharedForCausalLM as granitemoe with ffn_*_shexp tensors:
    refused by name rather than run without its shared expert."""
    arch = "granitemoe"
    metadata: dict[str, object] = {
        "general.architecture": arch,
        **{f"{arch}.{k}": v for k, v in (("context_length", 256), ("embedding_length", 64))},
        f"{arch}.block_count": 1,
        f"{arch}.feed_forward_length": 32,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.expert_count": 4,
        f"{arch}.expert_used_count": 2,
    }
    tensors = {
        name: GGUFTensorInfo(name, shape, GGMLQuantizationType.F32, 0, 0, Path("x.gguf"))
        for name, shape in (
            ("token_embd.weight", (128, 64)),
            ("blk.0.ffn_gate_exps.weight", (4, 32, 64)),
            ("blk.0.ffn_up_shexp.weight", (32, 64)),
        )
    }
    with pytest.raises(ModelLoadError, match="shared expert.*GraniteMoeShared"):
        gguf_model_config(metadata, tensors)


@pytest.mark.parametrize("dense", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
def test_qwen3_moe_with_dense_layers_is_refused(tmp_path: Path, dense: dict) -> None:
    """Dense MLPs between the sparse ones (no released Qwen3-MoE has them): refused, not run
    as experts; the expert width is moe_intermediate_size, not the dense intermediate_size."""
    _tiny_moe("qwen3_moe", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = hf_model_config(raw)
    assert (config.intermediate_size, config.num_local_experts, config.norm_topk_prob) == (
        96,
        EXPERTS,
        True,
    )
    with pytest.raises(ModelLoadError, match="mlp_only_layers"):
        hf_model_config({**raw, **dense})


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels do not run here")
def test_batch_invariant_logprobs_whatever_shares_the_steps(moe_kernel_dir: Path) -> None:
    """--batch-invariant on a mixture of experts: a seeded request alone (its experts on the
    one-token road at every decode), then among others of other lengths (its prompt chunked
    beside theirs, steps of more than 128 (token, expert) pairs, its decodes in batches of
    every size as the others finish: the few-rows and many-rows roads): the same tokens and
    logprobs to the last bit."""
    assert_batch_invariant(moe_kernel_dir, 500)
