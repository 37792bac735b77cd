"""Every dense family beyond Llama (model/family.py) against transformers: tiny random
checkpoints written with transformers' own classes, as an HF directory and as GGUF (F32 and
Q8_0) through the loader, the paged model and the engine (chunks, prefix hits, preemption,
n-gram speculation); and the fast paths against eager."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from family_checks import (
    assert_chunks_and_decodes_match_transformers,
    assert_fast_paths_keep_the_eager_greedy_tokens,
    greedy_tokens,
    preempted_ngram_run,
)
from iterserve import kernels
from iterserve.engine.llm import LLM
from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_loader import GGUFTensorInfo, gguf_model_config
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import hf_model_config, load_model
from iterserve.model.lora_model import LoRAModel
from iterserve.model.rope import query_temperature_scales, rope_tables
from iterserve.sampling_params import SamplingParams
from paged_runner import PagedRunner
from tiny_checkpoints import hf_token_by_token, save_checkpoint, tiny_hf_model
from tiny_families import (
    DENSE_FAMILIES,
    ENGINE_FAMILIES,
    GRANITE,
    ORIGINAL,
    SMALL_VOCAB,
    VOCAB,
    engine_family_model,
    family_checkpoint,
    family_model,
    gguf_metadata,
)
from tiny_gguf import write_gguf


@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[str, transformers.PreTrainedModel]:
    return request.param, family_model(request.param)


@pytest.mark.parametrize("kind", ["hf", "f32", "q8_0"])
def test_checkpoints_match_transformers_through_chunks_and_decodes(
    family: tuple[str, transformers.PreTrainedModel],
    kind: str,
    tmp_path: Path,
    tokenizer_dir: Path,
) -> None:
    """Chunked prefill (over cached prefixes, past Phi-3's window and original context)
    mixed with decodes, against transformers over the weights the loader produced (for Q8_0,
    the dequantized ones: the format's rounding is not ours to check here)."""
    name, hf = family
    if kind != "hf" and name.startswith("gemma"):
        hf = family_model(name, gguf=True)
    loaded = load_model(family_checkpoint(kind, hf, tmp_path, tokenizer_dir), torch.float32)
    assert loaded.config.architecture == hf.config.model_type.removesuffix("_text")
    if name == "phi4-mini":
        assert loaded.config.rotary_dim == 96 and loaded.config.rope_dim == 96
    if name == "smollm3":
        assert loaded.config.rope_layers == (True, True, True, False)
    reference = hf
    if kind == "q8_0":
        reference = family_model(name, gguf=True)
        weights = {_checkpoint_name(name, n): loaded.weights[n] for n in loaded.weights}
        missing = reference.load_state_dict(weights, strict=False).missing_keys
        assert missing in ([], ["lm_head.weight"])  # tied: the embedding
    ours = LlamaForCausalLM(loaded.config, torch.float32, torch.device("cpu"))
    ours.load_weights(loaded.weights)
    assert_chunks_and_decodes_match_transformers(ours, reference, VOCAB, prompt=ORIGINAL)


# The loader lists LFM2's tensors under Llama's names; these are its own (transformers').
_LFM2_NAMES = {
    ".self_attn.o_proj.": ".self_attn.out_proj.",
    ".self_attn.q_norm.": ".self_attn.q_layernorm.",
    ".self_attn.k_norm.": ".self_attn.k_layernorm.",
    ".mlp.gate_proj.": ".feed_forward.w1.",
    ".mlp.up_proj.": ".feed_forward.w3.",
    ".mlp.down_proj.": ".feed_forward.w2.",
    ".input_layernorm.": ".operator_norm.",
    ".post_attention_layernorm.": ".ffn_norm.",
    "model.norm.": "model.embedding_norm.",
}


def _checkpoint_name(family: str, name: str) -> str:
    """A tensor's name as the loader lists it, as the family's transformers model names it."""
    if family == "lfm2":
        for ours, theirs in _LFM2_NAMES.items():
            name = name.replace(ours, theirs)
    return name


@pytest.mark.parametrize(
    "config",
    [
        # The released shapes whose attention scale or window pattern a GGUF file cannot
        # state: Gemma 2 9B and 27B, Gemma 3 1B and 27B (27B: query_pre_attn_scalar is
        # hidden / heads, not head_dim).
        transformers.Gemma2Config(
            num_hidden_layers=42,
            hidden_size=3584,
            num_attention_heads=16,
            head_dim=256,
            query_pre_attn_scalar=256,
        ),
        transformers.Gemma2Config(
            num_hidden_layers=46,
            hidden_size=4608,
            num_attention_heads=32,
            head_dim=128,
            query_pre_attn_scalar=144,
        ),
        transformers.Gemma3TextConfig(
            num_hidden_layers=26,
            hidden_size=1152,
            num_attention_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
        ),
        transformers.Gemma3TextConfig(
            num_hidden_layers=62,
            hidden_size=5376,
            num_attention_heads=32,
            head_dim=128,
            query_pre_attn_scalar=168,
        ),
    ],
    ids=["gemma2-9b", "gemma2-27b", "gemma3-1b", "gemma3-27b"],
)
def test_gemma_gguf_metadata_reads_as_the_hf_config(config: transformers.PretrainedConfig) -> None:
    """What llama.cpp's converter writes for a Gemma (no layer pattern, no attention scale,
    no local RoPE base) reads as transformers' config of the same model does."""
    arch = config.model_type.removesuffix("_text")
    metadata: dict[str, object] = {
        "general.architecture": arch,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.attention.key_length": config.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        f"{arch}.attention.sliding_window": config.sliding_window,
        f"{arch}.rope.freq_base": config.rope_parameters.get(
            "full_attention", config.rope_parameters
        )["rope_theta"],
    }
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, cap, None) is not None:
            metadata[f"{arch}.{cap}"] = getattr(config, cap)
    shape = (config.vocab_size, config.hidden_size)
    tensors = {
        "token_embd.weight": GGUFTensorInfo(
            "token_embd.weight", shape, GGMLQuantizationType.F32, 0, 0, Path("unread.gguf")
        )
    }
    ours = gguf_model_config(metadata, tensors)
    architecture = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    hf = hf_model_config({**config.to_dict(), "architectures": [architecture]})

    def gemma_fields(c: ModelConfig) -> tuple[object, ...]:
        scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        return (
            c.sliding_window,
            c.sliding_window_layers,
            c.attn_logit_softcapping,
            c.final_logit_softcapping,
            scale,
            c.local_rope_theta,
            c.rope_theta,
        )

    assert gemma_fields(ours) == gemma_fields(hf)
    assert ours.sliding_window_layers == tuple(t == "sliding_attention" for t in config.layer_types)


def _embedding_only(rows: int, hidden: int) -> dict[str, GGUFTensorInfo]:
    """The one tensor a GGUF's config is read with (its vocabulary: the embedding's rows)."""
    info = GGUFTensorInfo(
        "token_embd.weight", (rows, hidden), GGMLQuantizationType.F32, 0, 0, Path("x.gguf")
    )
    return {info.name: info}


def test_olmo3_gguf_metadata_reads_as_its_released_config() -> None:
    """OLMo 3 7B's config.json (transformers 4's spelling: one rope_theta, YaRN in rope_scaling
    for the full layers only) and what llama.cpp's converter writes of it (an olmo2 file with
    a window) read alike: windows on three layers in four, plain RoPE on the model's base for
    those, YaRN with the config's attention factor for the rest."""
    sliding = [(i + 1) % 4 != 0 for i in range(32)]
    yarn = {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "attention_factor": 1.2079441541679836,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    raw = {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "vocab_size": 100278,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000,
        "rope_scaling": yarn,
        "sliding_window": 4096,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }
    metadata: dict[str, object] = {
        "general.architecture": "olmo2",
        "olmo2.context_length": 65536,
        "olmo2.embedding_length": 4096,
        "olmo2.block_count": 32,
        "olmo2.feed_forward_length": 11008,
        "olmo2.attention.head_count": 32,
        "olmo2.attention.head_count_kv": 32,
        "olmo2.attention.layer_norm_rms_epsilon": 1e-6,
        "olmo2.attention.sliding_window": 4096,
        "olmo2.attention.sliding_window_pattern": sliding,
        "olmo2.rope.freq_base": 500000.0,
        "olmo2.rope.scaling.type": "yarn",
        "olmo2.rope.scaling.factor": 8.0,
        "olmo2.rope.scaling.original_context_length": 8192,
        "olmo2.rope.scaling.yarn_attn_factor": 1.2079441541679836,
        "olmo2.rope.scaling.yarn_beta_fast": 32.0,
        "olmo2.rope.scaling.yarn_beta_slow": 1.0,
    }
    tensors = _embedding_only(100278, 4096)
    for ours in (hf_model_config(raw), gguf_model_config(metadata, tensors)):
        assert ours.architecture == "olmo3"
        assert ours.traits.qk_norm_whole and not ours.traits.pre_norms
        assert ours.sliding_window == 4096
        assert ours.sliding_window_layers == tuple(sliding)
        assert [ours.layer_window(i) for i in range(4)] == [4096, 4096, 4096, 0]
        assert ours.local_rope_theta == ours.rope_theta == 500000.0
        assert ours.rope_scaling is not None
        assert ours.rope_scaling["rope_type"] == "yarn"
        assert ours.rope_scaling["factor"] == 8.0
        assert ours.rope_scaling["attention_factor"] == pytest.approx(1.2079441541679836)
        assert ours.max_position_embeddings == 65536


def test_exaone4_windows_and_rope_read_alike_from_its_config_and_gguf() -> None:
    """EXAONE 4.0 32B's config.json (a window, `sliding_window_pattern` "LLLG") and what
    llama.cpp's converter writes of it read alike: windows on three layers in four and RoPE on
    those only; the 1.2B's (no window) attends fully and rotates everywhere."""
    sliding = [(i + 1) % 4 != 0 for i in range(64)]
    raw = {
        "architectures": ["Exaone4ForCausalLM"],
        "model_type": "exaone4",
        "vocab_size": 102400,
        "hidden_size": 5120,
        "intermediate_size": 27392,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": 4096,
        "sliding_window_pattern": "LLLG",
    }
    metadata: dict[str, object] = {
        "general.architecture": "exaone4",
        "exaone4.context_length": 131072,
        "exaone4.embedding_length": 5120,
        "exaone4.block_count": 64,
        "exaone4.feed_forward_length": 27392,
        "exaone4.attention.head_count": 40,
        "exaone4.attention.head_count_kv": 8,
        "exaone4.attention.key_length": 128,
        "exaone4.attention.layer_norm_rms_epsilon": 1e-5,
        "exaone4.attention.sliding_window": 4096,
        "exaone4.attention.sliding_window_pattern": sliding,
        "exaone4.rope.freq_base": 1000000.0,
    }
    tensors = {
        "token_embd.weight": GGUFTensorInfo(
            "token_embd.weight", (102400, 5120), GGMLQuantizationType.F32, 0, 0, Path("x.gguf")
        )
    }
    for ours in (hf_model_config(raw), gguf_model_config(metadata, tensors)):
        assert ours.architecture == "exaone4" and not ours.traits.pre_norms
        assert ours.sliding_window_layers == tuple(sliding) == ours.rope_layers
        assert [ours.layer_window(i) for i in range(4)] == [4096, 4096, 4096, 0]
        assert [ours.layer_rotates(i) for i in range(4)] == [True, True, True, False]
    small = {**raw, "num_hidden_layers": 30, "sliding_window": None}
    del metadata["exaone4.attention.sliding_window"]
    metadata.update({"exaone4.block_count": 30, "exaone4.attention.sliding_window_pattern": []})
    for ours in (hf_model_config(small), gguf_model_config(metadata, tensors)):
        assert ours.layer_window(3) == 0 and ours.layer_rotates(3) and ours.rope_layers is None


def test_engine_greedy_matches_transformers_with_chunks_and_prefix_hits(
    family: tuple[str, transformers.PreTrainedModel], tmp_path: Path, tokenizer_dir: Path
) -> None:
    _, hf = family
    directory = save_checkpoint(hf, tmp_path / "hf", tokenizer_dir)
    rng = random.Random(4)
    shared = [rng.randrange(3, VOCAB) for _ in range(24)]
    prompts = [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 9)]
    expected = [greedy_tokens(hf, p, 8) for p in prompts]
    llm = LLM(
        str(directory),
        dtype="float32",
        compile=False,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert [first[0].token_ids] == expected[:1]
    assert [o.token_ids for o in second] == expected
    assert second[1].num_cached_tokens > 0  # the shared prefix came from the cache


@pytest.mark.slow  # ~4 s each
@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_engine_greedy_matches_transformers_through_preemption_and_ngram_speculation(
    name: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """A KV pool too small for every sequence's output (preemption: prompts and outputs
    recomputed, past Gemma 2's window) while prompt lookup proposes drafts (verify steps of
    several rows, some drafts accepted, some rejected): the tokens of transformers run one
    at a time."""
    hf = engine_family_model(name)
    directory = save_checkpoint(hf, tmp_path / "hf", tokenizer_dir)
    # Random weights: a seed whose prompts this model's greedy output drafts into both ways
    # (some guesses accepted, some rejected).
    seed = {"gemma3": 7, "smollm3": 9, "granite": 9, "gpt_oss": 7, "olmo2": 5, "olmo3": 5}.get(
        name, 6
    )
    llm, got, expected = preempted_ngram_run(hf, directory, seed, SMALL_VOCAB, compiled=False)
    assert got == expected
    assert all(len(set(t)) > 3 for t in got), "degenerate text would prove little"
    assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"C++ kernels unavailable: {kernels.why_unavailable()}"
)


@needs_kernels
def test_fast_paths_keep_the_eager_greedy_tokens(
    family: tuple[str, transformers.PreTrainedModel], tmp_path: Path, tokenizer_dir: Path
) -> None:
    """bf16 tiled kernels in the fused layer op (window, q/k norms, GELU, sandwich norms, Gemma
    2's soft-caps and Gemma 3's local rope included) against bf16 eager."""
    _assert_fast_paths_keep_the_eager_greedy_tokens(family[1], tmp_path, tokenizer_dir)


@needs_kernels
def test_granite_moe_fast_paths_keep_the_eager_greedy_tokens(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Granite's multipliers and a layer of experts together in the fused layer op."""
    hf = family_model("granitemoe")
    _assert_fast_paths_keep_the_eager_greedy_tokens(hf, tmp_path, tokenizer_dir)


def _assert_fast_paths_keep_the_eager_greedy_tokens(
    hf: transformers.PreTrainedModel, tmp_path: Path, tokenizer_dir: Path
) -> None:
    directory = save_checkpoint(hf, tmp_path, tokenizer_dir)
    config = load_model(directory, torch.float32).config
    # The checkpoint's tensors as the loader lists them (Granite MoE's expert stacks as each
    # expert's projections).
    weights = lambda: load_model(directory, torch.float32).weights  # noqa: E731
    assert_fast_paths_keep_the_eager_greedy_tokens(config, weights, VOCAB, fused=True)


def test_lfm2_gguf_metadata_reads_as_its_released_config() -> None:
    """LFM2-1.2B's config.json (its own spelling: block_ff_dim adjusted to 2/3 and rounded,
    full_attn_idxs, norm_eps, tie_embedding) and what llama.cpp's converter writes of it
    (head_count_kv 0 on the conv layers, the adjusted width) read alike."""
    attention = (2, 5, 8, 10, 12, 14)
    raw = {
        "architectures": ["Lfm2ForCausalLM"],
        "model_type": "lfm2",
        "vocab_size": 65536,
        "hidden_size": 2048,
        "block_ff_dim": 12288,
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "conv_L_cache": 3,
        "conv_bias": False,
        "full_attn_idxs": list(attention),
        "norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 128000,
        "tie_embedding": True,
    }
    metadata: dict[str, object] = {
        "general.architecture": "lfm2",
        "lfm2.context_length": 128000,
        "lfm2.embedding_length": 2048,
        "lfm2.block_count": 16,
        "lfm2.feed_forward_length": 8192,
        "lfm2.attention.head_count": 32,
        "lfm2.attention.head_count_kv": [0 if i not in attention else 8 for i in range(16)],
        "lfm2.attention.layer_norm_rms_epsilon": 1e-5,
        "lfm2.rope.freq_base": 1000000.0,
        "lfm2.shortconv.l_cache": 3,
    }
    tensors = _embedding_only(65536, 2048)
    for ours in (hf_model_config(raw), gguf_model_config(metadata, tensors)):
        assert ours.architecture == "lfm2" and ours.traits.qk_norm
        assert ours.conv_layers == tuple(i not in attention for i in range(16))
        assert (ours.conv_kernel, ours.conv_history) == (3, 2)
        assert ours.intermediate_size == 8192
        assert (ours.num_key_value_heads, ours.head_dim) == (8, 64)
        assert ours.rms_norm_eps == 1e-5 and ours.rope_theta == 1e6
        assert ours.tie_word_embeddings and ours.max_position_embeddings == 128000


def test_ministral3_gguf_metadata_reads_as_its_released_config() -> None:
    """Ministral-3-3B's text config (as remembered: YaRN 16x over 16,384 tokens, mscale and
    mscale_all_dim 1, Llama 4's temperature 0.1) and what llama.cpp's converter writes of it
    (mistral3: yarn_log_multiplier for mscale_all_dim, attention.temperature_scale) read
    alike: RoPE served to 262,144 positions with an attention factor of 1, the queries'
    temperature over the original 16,384."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 16384,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    }
    raw = {
        "architectures": ["Ministral3ForCausalLM"],
        "model_type": "ministral3",
        "vocab_size": 131072,
        "hidden_size": 3072,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 262144,
        "rope_parameters": rope,
        "tie_word_embeddings": True,
    }
    arch = "mistral3"
    metadata: dict[str, object] = {
        "general.architecture": arch,
        **{
            f"{arch}.{key}": value
            for key, value in {
                "context_length": 262144,
                "embedding_length": 3072,
                "block_count": 26,
                "feed_forward_length": 9216,
                "attention.head_count": 32,
                "attention.head_count_kv": 8,
                "attention.key_length": 128,
                "attention.layer_norm_rms_epsilon": 1e-5,
                "rope.freq_base": 1000000.0,
                "rope.scaling.type": "yarn",
                "rope.scaling.factor": 16.0,
                "rope.scaling.original_context_length": 16384,
                "rope.scaling.yarn_beta_fast": 32.0,
                "rope.scaling.yarn_beta_slow": 1.0,
                "rope.scaling.yarn_log_multiplier": 1.0,
                "attention.temperature_scale": 0.1,
            }.items()
        },
    }
    configs = (hf_model_config(raw), gguf_model_config(metadata, _embedding_only(131072, 3072)))
    for ours in configs:
        assert ours.architecture == "ministral3"
        assert ours.query_temperature == (0.1, 16384)
        assert ours.max_position_embeddings == 262144 and ours.rope_theta == 1e6
        assert ours.rope_scaling is not None and ours.rope_scaling["rope_type"] == "yarn"
        assert ours.rope_scaling["factor"] == 16.0
        assert ours.rope_scaling["original_max_position_embeddings"] == 16384
        assert ours.tie_word_embeddings
    cpu = torch.device("cpu")
    tables = [rope_tables(128, 1e6, c.rope_scaling, 20000, torch.float32, cpu) for c in configs]
    torch.testing.assert_close(tables[0], tables[1], rtol=0, atol=0)
    # Its attention factor is 1: the table's first column at position 0 is cos(0).
    assert tables[0][0][0, 0] == 1.0
    positions = torch.tensor([0, 16383, 16384, 40000])
    scales = query_temperature_scales(positions, (0.1, 16384))
    torch.testing.assert_close(scales, 1 + 0.1 * torch.log(torch.tensor([1.0, 1.0, 2.0, 3.0])))


@needs_kernels
def test_ministral3_query_scales_reach_the_layer_by_layer_op(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """LoRA slots take the layers off decoder_stack, one decoder_layer call each: the query
    scales reach it too (no adapter in the slots: the same logits to the bit, past the
    original context, where the temperature is not 1)."""
    path = family_checkpoint("hf", family_model("ministral3"), tmp_path, tokenizer_dir)
    loaded = load_model(path, torch.float32)
    rng = random.Random(2)
    tokens = [rng.randrange(VOCAB) for _ in range(60)]
    rows = []
    for slots in (False, True):
        model = LlamaForCausalLM(loaded.config, torch.bfloat16, torch.device("cpu"))
        model.load(loaded.weights, "tiled")
        if slots:
            LoRAModel(model, max_loras=2, max_rank=8)
        assert model.fused_layers and (model.lora is not None) == slots
        runner = PagedRunner(model, block_size=16, num_blocks=32, paged_kernel=True)
        runner.add("s", tokens)
        rows.append(torch.cat([runner.step([("s", n)])["s"] for n in (40, 20)]))
    torch.testing.assert_close(rows[1], rows[0], rtol=0, atol=0)


def test_lfm2_conv_rows_keep_to_the_int8_pool_of_the_attention_layers(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """With --kv-cache-dtype int8 a conv layer's rows are 8-bit rows as K and V are (one
    scale a row): the logits stay close to those over a pool in the model's dtype."""
    path = family_checkpoint("hf", family_model("lfm2"), tmp_path, tokenizer_dir)
    loaded = load_model(path, torch.float32)
    rng = random.Random(1)
    tokens = [rng.randrange(VOCAB) for _ in range(40)]
    rows = {}
    for kv_dtype in (torch.float32, torch.int8):
        model = LlamaForCausalLM(loaded.config, torch.float32, torch.device("cpu"))
        model.load_weights(loaded.weights)
        runner = PagedRunner(model, block_size=8, num_blocks=16, kv_dtype=kv_dtype)
        runner.add("s", tokens)
        rows[kv_dtype] = torch.cat([runner.step([("s", n)])["s"] for n in (20, 1, 1, 1)])
    assert runner.caches[0][0].shape[-1] == 128 + 4  # hidden int8 values, then the scale
    ref, got = rows[torch.float32], rows[torch.int8]
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_a_granite_gguf_with_a_kv_head_count_a_layer_is_granite(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Granite 4.0's models without Mamba layers (granite-4.0-micro) as llama.cpp's
    granitehybrid converter writes them: a plain granite file whose head_count_kv is a list,
    a count a layer. It runs as the model; a list of unlike counts is refused by name."""
    hf = family_model("granite")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    metadata, _ = gguf_metadata(hf)
    layers = hf.config.num_hidden_layers
    path = tmp_path / "granite-4.0.gguf"
    kv_heads = [hf.config.num_key_value_heads] * layers
    write_gguf(
        path, "granite", hf, tokenizer, metadata={**metadata, "attention.head_count_kv": kv_heads}
    )
    loaded = load_model(path, torch.float32)
    assert loaded.config.num_key_value_heads == hf.config.num_key_value_heads
    ours = LlamaForCausalLM(loaded.config, torch.float32, torch.device("cpu"))
    ours.load_weights(loaded.weights)
    tokens = [random.Random(2).randrange(VOCAB) for _ in range(1)] + list(range(100, 130))
    runner = PagedRunner(ours, block_size=8, num_blocks=16)
    runner.add("s", tokens)
    got = runner.step([("s", len(tokens))])["s"]
    torch.testing.assert_close(got, hf_token_by_token(hf, tokens, len(tokens)), atol=1e-4, rtol=0)

    bad = tmp_path / "uneven.gguf"
    uneven = {**metadata, "attention.head_count_kv": [hf.config.num_key_value_heads, 1]}
    write_gguf(bad, "granite", hf, tokenizer, metadata=uneven)
    with pytest.raises(ModelLoadError, match="head_count_kv"):
        load_model(bad, torch.float32)


@pytest.mark.parametrize("rope", ["rope", None])
def test_granite_4_without_mamba_layers_is_granite(
    rope: str | None, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Granite 4.0's class (GraniteMoeHybrid) with every layer attending and no experts, as
    granite-4.0-micro is: Granite's multipliers, its MLP as `shared_mlp`; with RoPE or
    without (its position_embedding_type None: every layer NoPE), against transformers
    through chunks and decodes. Mamba layers are refused by name."""
    hf = tiny_hf_model(
        "granitemoehybrid",
        vocab_size=VOCAB,
        weight_std=0.15,
        hidden_size=128,
        intermediate_size=64,  # the experts' width, none here: shared_intermediate_size is
        shared_intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=0,
        layer_types=["attention", "attention"],
        position_embedding_type=rope,
        attn_implementation="eager",
        **GRANITE,
    )
    loaded = load_model(save_checkpoint(hf, tmp_path / "hf", tokenizer_dir), torch.float32)
    config = loaded.config
    assert config.architecture == "granite" and config.intermediate_size == 96
    assert config.rope_layers == (None if rope else (False, False))
    ours = LlamaForCausalLM(config, torch.float32, torch.device("cpu"))
    ours.load_weights(loaded.weights)
    rng = random.Random(3)
    tokens = [rng.randrange(VOCAB) for _ in range(40)]
    runner = PagedRunner(ours, block_size=8, num_blocks=16)
    runner.add("s", tokens)
    got = torch.cat([runner.step([("s", n)])["s"] for n in (25, 1, 1, 13)])
    torch.testing.assert_close(got, hf_token_by_token(hf, tokens, 25), atol=1e-4, rtol=0)

    raw = {**hf.config.to_dict(), "architectures": ["GraniteMoeHybridForCausalLM"]}
    with pytest.raises(ModelLoadError, match="mamba"):
        hf_model_config({**raw, "layer_types": ["mamba", "attention"]})
