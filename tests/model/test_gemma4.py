"""Gemma 4's language model against transformers: per-layer head sizes, keys as values, the
norm of V, proportional RoPE, per-layer embeddings and layers that share earlier layers' K/V,
on tiny random checkpoints written with transformers' own classes."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from family_checks import (
    assert_batch_invariant,
    assert_chunks_and_decodes_match_transformers,
    assert_fast_paths_keep_the_eager_greedy_tokens,
    preempted_ngram_run,
)
from iterserve import kernels
from iterserve.model.attention import allocate_kv_caches
from iterserve.model.errors import ModelLoadError
from iterserve.model.kv_cache_format import kv_bytes_per_token
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import hf_model_config, load_model
from paged_runner import PagedRunner
from tiny_checkpoints import hf_token_by_token, save_checkpoint
from tiny_families import GEMMA4_SHAPES as SHAPES
from tiny_families import SMALL_VOCAB, VOCAB, gemma4_model
from tiny_gguf import gemma4_rope_freqs, write_gguf


@pytest.fixture(scope="module", params=list(SHAPES))
def gemma4(request: pytest.FixtureRequest) -> tuple[str, transformers.PreTrainedModel]:
    return request.param, gemma4_model(request.param)


def test_the_config_reads_the_layers_shapes(
    gemma4: tuple[str, transformers.PreTrainedModel], tmp_path: Path, tokenizer_dir: Path
) -> None:
    name, hf = gemma4
    config = load_model(save_checkpoint(hf, tmp_path, tokenizer_dir), torch.float32).config
    assert config.architecture == "gemma4"
    assert [config.layer_head_dim(i) for i in range(config.num_hidden_layers)][:2] == [32, 64]
    if name == "e2b":
        assert [config.layer_kv_source(i) for i in range(5)] == [0, 1, 2, 2, 1]
        assert [config.layer_mlp_width(i) for i in range(5)] == [192, 192, 192, 384, 384]
        # Layers 3 and 4 hold no K/V of their own: the pool's bytes a token are layers 0-2's.
        assert kv_bytes_per_token(config, torch.bfloat16) == 2 * 2 * (32 + 64 + 32)
        caches = allocate_kv_caches(config, 4, 8, torch.bfloat16, torch.device("cpu"))
        assert caches[3] is caches[2] and caches[4] is caches[1]
    else:
        assert [config.layer_kv_heads(i) for i in range(4)] == [2, 1, 2, 1]
        assert [config.layer_keys_as_values(i) for i in range(4)] == [False, True, False, True]


def test_logits_match_transformers_through_chunks_and_decodes(
    gemma4: tuple[str, transformers.PreTrainedModel], tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Chunked prefill over cached prefixes, past the window, mixed with decodes, in fp32."""
    _, hf = gemma4
    loaded = load_model(save_checkpoint(hf, tmp_path, tokenizer_dir), torch.float32)
    ours = LlamaForCausalLM(loaded.config, torch.float32, torch.device("cpu"))
    ours.load_weights(loaded.weights)
    assert_chunks_and_decodes_match_transformers(ours, hf, VOCAB, prompt=40)


@pytest.mark.parametrize("compiled", [False, True])
def test_engine_greedy_matches_transformers_through_preemption_and_ngram_speculation(
    compiled: bool, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """E2B's parts in the engine: a pool too small for every output (preemption, prompts
    recomputed), prompt-lookup drafts verified several rows a step, the layer stack eager and
    compiled: transformers' tokens one at a time."""
    hf = gemma4_model("e2b", vocab_size=SMALL_VOCAB, vocab_size_per_layer_input=SMALL_VOCAB)
    directory = save_checkpoint(hf, tmp_path / "hf", tokenizer_dir)
    llm, got, expected = preempted_ngram_run(hf, directory, 6, SMALL_VOCAB, compiled)
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")
def test_a_sequence_decodes_the_same_bits_alone_and_in_a_crowd(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """--batch-invariant, which E2B takes now its layers are the C++ op's: a seeded sequence's
    tokens and logprobs alone and among others of every length, chunked, to the last bit."""
    hf = gemma4_model("e2b", vocab_size=SMALL_VOCAB, vocab_size_per_layer_input=SMALL_VOCAB)
    assert_batch_invariant(save_checkpoint(hf, tmp_path / "hf", tokenizer_dir), SMALL_VOCAB)


@pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")
def test_tiled_kernels_keep_the_eager_greedy_tokens(
    gemma4: tuple[str, transformers.PreTrainedModel], tmp_path: Path, tokenizer_dir: Path
) -> None:
    """The C++ layer op in bf16 against bf16 eager torch, every layer of every shape: E2B's
    (K/V read from an earlier layer's pool, normed values, per-layer inputs, the layer
    scalar); 31B's and 26B-A4B's (full layers whose values are their keys, 26B-A4B's experts
    beside the dense MLP)."""
    name, hf = gemma4
    directory = save_checkpoint(hf, tmp_path, tokenizer_dir)
    config = load_model(directory, torch.float32).config
    weights = lambda: load_model(directory, torch.float32).weights  # noqa: E731
    assert_fast_paths_keep_the_eager_greedy_tokens(config, weights, VOCAB, fused=True)


@pytest.mark.skipif(not kernels.available(), reason="C++ kernels unavailable")
def test_the_26b_experts_in_one_call_are_the_block_op_by_op(
    tmp_path: Path, tokenizer_dir: Path, kernel_isa: str
) -> None:
    """26B-A4B's experts in kernels/csrc/moe.cpp's one call (the router on its own rows, the
    weights times each expert's scale, GeGLU) against the block op by op on the same tiled
    kernels, on every kernel variant this CPU runs: one token, a few rows, many. (Its
    layers run whole in the C++ layer op, experts and all: the greedy tokens of
    test_tiled_kernels_keep_the_eager_greedy_tokens.)"""
    directory = save_checkpoint(gemma4_model("26b"), tmp_path, tokenizer_dir)
    loaded = load_model(directory, torch.bfloat16)
    model = LlamaForCausalLM(loaded.config, torch.bfloat16, torch.device("cpu"))
    model.load(loaded.weights, "tiled")
    # Every layer takes the layer op, the full ones (keys as values) too.
    assert all(layer.fused is not None for layer in model.layers)
    generator = torch.Generator().manual_seed(0)
    for layer in model.layers:
        block = layer.moe
        assert block is not None and block.kernel is not None
        for tokens in (1, 3, 90):  # 90 x 2 pairs: past the loop that scatters a few
            x, stream = torch.randn(2, tokens, block.hidden, generator=generator).bfloat16()
            routed = block.router_input(stream)
            got, want = block.run(x, None, routed), block.run_ops(x, None, routed)
            torch.testing.assert_close(got, want, atol=0.02, rtol=0.02)
            assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_reads_as_its_hf_checkpoint(
    gemma4: tuple[str, transformers.PreTrainedModel],
    qtype: str,
    tmp_path: Path,
    tokenizer_dir: Path,
) -> None:
    """A GGUF written as llama.cpp's converter writes Gemma 4 (the full layers' head size as
    key_length, the windowed ones' as key_length_swa, kv heads and MLP widths a layer, the
    proportional RoPE as a rope_freqs tensor, the per-layer tensors under llama.cpp's names;
    no v projection where keys are values) gives the config of its HF directory and, against
    transformers over the weights it holds (Q8_0: their dequantized values), its logits."""
    name, hf = gemma4
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    path = tmp_path / f"tiny.{qtype}.gguf"
    write_gguf(
        path,
        "gemma4",
        hf,
        tokenizer,
        qtype=GGMLQuantizationType[qtype],
        rope_tensors={"rope_freqs": gemma4_rope_freqs(hf.config)},
    )
    loaded = load_model(path, torch.float32)
    hf_config = load_model(save_checkpoint(hf, tmp_path / "hf", tokenizer_dir)).config
    # GGUF says RoPE's share by frequency divisors, HF by a proportion: the same rotation.
    assert dataclasses.replace(loaded.config, rope_scaling=None, eos_token_ids=()) == (
        dataclasses.replace(hf_config, rope_scaling=None, eos_token_ids=())
    )
    reference = hf
    if qtype == "Q8_0":
        reference = gemma4_model(name)
        state = _stacked_experts({n: loaded.weights[n] for n in loaded.weights})
        missing = reference.load_state_dict(state, strict=False).missing_keys
        assert missing in ([], ["lm_head.weight"])
    ours = LlamaForCausalLM(loaded.config, torch.float32, torch.device("cpu"))
    ours.load_weights(loaded.weights)
    tokens = [random.Random(7).randrange(VOCAB) for _ in range(60)]
    runner = PagedRunner(ours, block_size=8, num_blocks=32)
    runner.add("s", tokens)
    got = torch.cat(
        [runner.step([("s", 40)])["s"], *(runner.step([("s", 1)])["s"] for _ in range(20))]
    )
    torch.testing.assert_close(
        got, hf_token_by_token(reference, tokens, prompt=40), atol=1e-4, rtol=0
    )


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our weights' names (each expert's projections, transformers' Gemma 4 expert stacks
    unstacked) stacked back as transformers keeps them."""
    out, experts = {}, {}
    for name, tensor in state.items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)_proj\.weight", name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(match[1], {})[(int(match[2]), match[3])] = tensor
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(count)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in range(count)])
    return out


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ({"enable_moe_block": True}, "no num_experts"),
        ({"use_bidirectional_attention": "all"}, "both ways"),
    ],
)
def test_what_gemma4_runs_otherwise_is_refused_by_name(
    field: dict[str, object], message: str
) -> None:
    raw = {
        "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": VOCAB,
        **field,
    }
    with pytest.raises(ModelLoadError, match=message):
        hf_model_config(raw)
