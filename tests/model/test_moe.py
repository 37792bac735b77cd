"""Mixtral (model/moe.py) against transformers on tiny random checkpoints, fp32: the logits
of steps whose tokens go to several experts, greedy tokens through the engine (chunked
prefill, prefix-cache hits, preemption, tensor parallelism), and the same model as a GGUF."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file
from test_fast_paths import _assert_as_close_as_bf16, _teacher_force

from conftest import BUNDLED_GGUF, _save_tiny, bundled_dir
from iterserve import LLM, SamplingParams, kernels
from iterserve.model import moe
from iterserve.model.gguf_loader import read_gguf_header
from iterserve.model.linear import Backend
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import ModelLoadError, hf_model_config, load_model
from paged_runner import PagedRunner
from tiny_checkpoints import model_config_of, tiny_hf_model
from tiny_gguf import add_shape, llama_cpp_permute
from transformers_reference import PROMPTS, reference

EXPERTS, TOP_K = 4, 2
SHAPE = dict(
    num_local_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    intermediate_size=96,
    weight_std=0.15,  # every weight drawn afresh: routing varies from token to token
    tie_word_embeddings=False,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return _save_tiny("mixtral", tmp_path_factory.mktemp("tiny-mixtral"), tokenizer_dir, **SHAPE)


@pytest.fixture(scope="module")
def mixtral_reference(mixtral_dir: Path) -> list[list[int]]:
    tokens = reference(mixtral_dir, PROMPTS, GREEDY.max_tokens)
    assert all(len(set(t)) > 3 for t in tokens), "degenerate text would prove little"
    return tokens


@pytest.fixture(scope="module")
def tiny_mixtral(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]]:
    """A 128-token-vocabulary Mixtral and its weights as its checkpoint names them
    (experts.E.w1/w2/w3: transformers' in-memory names differ)."""
    hf = tiny_hf_model("mixtral", vocab_size=128, head_dim=32, attn_implementation="eager", **SHAPE)
    out = tmp_path_factory.mktemp("tiny-mixtral-128")
    hf.save_pretrained(out)
    return hf, load_file(out / "model.safetensors")


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

    def recording(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(logits, top_k)
        calls.append(experts)
        return weights, experts

    route = moe.route
    monkeypatch.setattr(moe, "route", recording)
    yield calls


def test_steps_routed_to_several_experts_match_transformers_logits(
    tiny_mixtral: tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]],
    routed: list[torch.Tensor],
) -> None:
    hf = tiny_mixtral[0]
    runner = PagedRunner(_ours(tiny_mixtral, torch.float32), block_size=4, seed=1)
    rng = random.Random(0)
    seqs = {f"s{i}": [rng.randrange(128) for _ in range(n)] for i, n in enumerate([21, 12, 14])}
    for name, tokens in seqs.items():
        runner.add(name, tokens)
    got: dict[str, list[torch.Tensor]] = {name: [] for name in seqs}
    # A mixed prefill step, a chunked one beside a decode, then decodes alone and together.
    for plan in (
        [("s0", 12), ("s1", 9)],
        [("s0", 9), ("s2", 5), ("s1", 1)],
        [("s2", 9), ("s1", 1)],
        [("s1", 1)],
    ):
        for name, logits in runner.step(plan).items():
            got[name].append(logits)
    with torch.inference_mode():
        for name, tokens in seqs.items():
            expected = hf(torch.tensor([tokens])).logits[0]
            torch.testing.assert_close(torch.cat(got[name]), expected, atol=1e-4, rtol=0)
    assert routed[0].shape == (21, TOP_K)
    assert len(routed[0].unique()) == EXPERTS, "the first step's tokens should use every expert"


def test_a_lone_decode_token_matches_transformers(
    tiny_mixtral: tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]],
) -> None:
    """One token: only its k experts run."""
    hf = tiny_mixtral[0]
    runner = PagedRunner(_ours(tiny_mixtral, torch.float32), block_size=4)
    tokens = [5, 17, 99, 3, 64, 2]
    runner.add("s", tokens)
    rows = [runner.step([("s", 1)])["s"] for _ in tokens]
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.cat(rows), expected, atol=1e-4, rtol=0)


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels do not run here")
def test_kernels_path_matches_the_torch_reference_in_bf16(
    tiny_mixtral: tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]],
    routed: list[torch.Tensor],
) -> None:
    """The experts on iterserve's tiled kernels (and attention on the paged op) against the
    same bf16 weights through plain torch: the fast path computes the same function. In bf16
    two router logits can tie or nearly so, and then a rounding upstream flips a token's
    experts (transformers' own bf16 path flips them too): such rows are left out, and must
    be rare."""
    logits = {}
    for backend in ("torch", "tiled"):
        ours = _ours(tiny_mixtral, torch.bfloat16, backend)
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


def test_compiled_engine_greedy_through_chunks_preemption_and_prefix_hits(
    mixtral_dir: Path, mixtral_reference: list[list[int]]
) -> None:
    """The compiled step (the experts one opaque op in the graph) on every kind of step."""
    llm = LLM(
        str(mixtral_dir),
        dtype="float32",
        compile=True,
        max_num_batched_tokens=7,  # every prompt chunked, decodes mixed in
        max_num_seqs=7,
        num_kv_blocks=20,  # prompts fit, outputs do not: preemption
        block_size=4,
    )
    assert llm.engine.model_plan.step == "compiled"
    for _ in range(2):  # the second pass starts from prefix-cache hits
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == mixtral_reference
    stats = llm.engine.scheduler.kv_cache_stats()
    assert llm.engine.scheduler.num_preemptions > 0
    assert stats.prefix_hits > 0 and stats.num_used_blocks == 0


@pytest.mark.slow
def test_tensor_parallel_greedy_is_transformers(
    mixtral_dir: Path, mixtral_reference: list[list[int]]
) -> None:
    """TP=2: each rank holds half of every expert's width; one all-reduce per MoE layer."""
    with LLM(
        str(mixtral_dir),
        dtype="float32",
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    ) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == mixtral_reference


def _write_mixtral_gguf(
    path: Path, model_dir: Path, experts_qtype: GGMLQuantizationType | None = None
) -> None:
    """The checkpoint as llama.cpp's converter writes Mixtral: arch "llama", q/k rows permuted,
    each layer's experts stacked [experts, rows, cols] per projection; F32 throughout, or
    the expert stacks in `experts_qtype`."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    weights = load_file(model_dir / "model.safetensors")
    metadata, _ = read_gguf_header(bundled_dir() / BUNDLED_GGUF)  # its tokenizer, as is
    writer = GGUFWriter(path, "llama")
    add_shape(writer, config)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
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
            if part in heads:
                tensor = torch.from_numpy(llama_cpp_permute(tensor.numpy(), heads[part]))
            add(f"blk.{i}.attn_{'output' if part == 'o' else part}.weight", tensor)
        add(f"blk.{i}.attn_norm.weight", weights[f"{p}input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", weights[f"{p}post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate_inp.weight", weights[f"{p}block_sparse_moe.gate.weight"])
        for gguf_part, hf_part in (("gate", "w1"), ("down", "w2"), ("up", "w3")):
            experts = [
                weights[f"{p}block_sparse_moe.experts.{e}.{hf_part}.weight"]
                for e in range(config.num_local_experts)
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
    tmp_path: Path, mixtral_dir: Path, mixtral_reference: list[list[int]]
) -> None:
    path = tmp_path / "tiny-mixtral.F32.gguf"
    _write_mixtral_gguf(path, mixtral_dir)
    from_gguf = load_model(path, torch.float32)
    from_hf = load_model(mixtral_dir, torch.float32)
    assert from_gguf.config.architecture == "mixtral"
    assert (from_gguf.config.num_local_experts, from_gguf.config.num_experts_per_tok) == (
        EXPERTS,
        TOP_K,
    )
    assert set(from_gguf.weights) == set(from_hf.weights)
    for name, tensor in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[name], tensor, rtol=0, atol=0, msg=name)
    llm = LLM(str(path), dtype="float32", compile=False)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == mixtral_reference


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels do not run here")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_experts_from_a_quantized_gguf_run_in_their_blocks(
    tmp_path: Path, mixtral_dir: Path, qtype: str
) -> None:
    """Each expert of a quantized GGUF stack is kept in its own blocks (gate and up one
    projection of two parts) and runs on the block kernels (int8 activations): as close to
    fp32 over the dequantized weights as int8 activations allow (~3x bf16's error)."""
    path = tmp_path / f"tiny-mixtral.{qtype}.gguf"
    _write_mixtral_gguf(path, mixtral_dir, GGMLQuantizationType[qtype])
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
    "architecture", ["Qwen3MoeForCausalLM", "OlmoeForCausalLM", "DeepseekV3ForCausalLM"]
)
def test_other_moe_families_are_refused_by_name(architecture: str) -> None:
    raw = {"architectures": [architecture], "hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(ModelLoadError, match=f"{architecture} is not supported.*Mixtral"):
        hf_model_config(raw)
