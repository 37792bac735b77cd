"""LlamaForCausalLM + paged attention against transformers on tiny random checkpoints."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import torch
import transformers

from iterserve import kernels
from iterserve.model import attention
from iterserve.model.attention_metadata import SeqSpan, build_attention_metadata
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.rope import rope_inv_freq
from paged_runner import PagedRunner
from tiny_checkpoints import model_config_of, tiny_hf_model

VOCAB = 128
ATOL = 1e-4


def _hf_model(kind: str = "llama", **overrides: object) -> transformers.PreTrainedModel:
    """A tiny random HF model whose every weight (biases and norms too) is non-trivial."""
    shape = dict(
        num_hidden_layers=3,
        head_dim=32,  # wider than hidden/heads: the C++ attention op takes multiples of 32
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return tiny_hf_model(kind, vocab_size=VOCAB, weight_std=0.15, **{**shape, **overrides})


def _ours(hf: transformers.PreTrainedModel, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM(model_config_of(hf), dtype, torch.device("cpu"))
    model.load_weights(hf.state_dict())
    return model


@torch.inference_mode()
def _reference(hf: transformers.PreTrainedModel, tokens: Sequence[int]) -> torch.Tensor:
    return hf(torch.tensor([list(tokens)])).logits[0].float()


def _prompts(lengths: Sequence[int], seed: int = 1) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"s{i}": [rng.randrange(VOCAB) for _ in range(n)] for i, n in enumerate(lengths)}


def _check(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def _add_prompts(
    runner: PagedRunner, lengths: Sequence[int], seed: int = 1
) -> dict[str, list[int]]:
    """Random prompts of these lengths, added to `runner` as s0, s1, ...; returned by name."""
    prompts = _prompts(lengths, seed)
    for name, tokens in prompts.items():
        runner.add(name, tokens)
    return prompts


def _check_one_step_prefill(
    runner: PagedRunner, hf: transformers.PreTrainedModel, prompts: dict[str, list[int]]
) -> None:
    """Every prompt prefilled whole in one step: each one's logits as transformers'."""
    out = runner.step([(name, len(t)) for name, t in prompts.items()])
    for name, tokens in prompts.items():
        _check(out[name], _reference(hf, tokens))


@pytest.fixture(scope="module")
def llama() -> transformers.PreTrainedModel:
    return _hf_model()


@pytest.fixture(params=["sdpa", "embedding_bag", "paged_kernel"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """Run a test through each decode path: tiny models would otherwise only meet SDPA.

    Returns the PagedRunner settings that select it; "paged_kernel" is the C++ op.
    """
    if request.param == "embedding_bag":
        monkeypatch.setattr(attention, "_SDPA_DECODE_MAX_BYTES", 0)
    if request.param == "paged_kernel":
        if not kernels.available():
            pytest.skip(f"C++ kernels unavailable: {kernels.why_unavailable()}")
        return {"paged_kernel": True}
    return {}


@pytest.mark.parametrize("block_size", [4, 16])
def test_batched_prefill_matches_transformers(
    llama: transformers.PreTrainedModel, block_size: int
) -> None:
    runner = PagedRunner(_ours(llama), block_size=block_size)
    _check_one_step_prefill(runner, llama, _add_prompts(runner, [5, 17, 1, 33, 8]))


def test_chunked_prefill_mixed_with_decodes(
    llama: transformers.PreTrainedModel, decode_path: dict[str, bool]
) -> None:
    runner = PagedRunner(_ours(llama), block_size=4, seed=3, **decode_path)
    seqs = _add_prompts(runner, [23, 19, 6, 12], seed=2)  # s0, s1 chunked; s2, s3 decode alongside
    refs = {name: _reference(llama, tokens) for name, tokens in seqs.items()}
    got: dict[str, list[torch.Tensor]] = {name: [] for name in seqs}

    def run(plan: list[tuple[str, int]]) -> None:
        for name, logits in runner.step(plan).items():
            got[name].append(logits)

    run([("s2", 3), ("s3", 9)])
    run([("s0", 3), ("s2", 1), ("s3", 1)])
    run([("s3", 1), ("s0", 5), ("s1", 3), ("s2", 1)])  # two chunks after cached prefixes
    run([("s1", 5), ("s2", 1), ("s0", 15)])
    run([("s1", 11)])
    run([("s3", 1)])  # a lone row takes the matrix-vector path
    for name in seqs:
        _check(torch.cat(got[name]), refs[name][: runner.computed[name]])


def test_greedy_decode_steps_match_full_sequence(
    llama: transformers.PreTrainedModel, decode_path: dict[str, bool]
) -> None:
    runner = PagedRunner(_ours(llama), block_size=4, seed=5, **decode_path)
    prompts = _prompts([9, 14, 3], seed=4)
    for name, tokens in prompts.items():
        runner.add(name, tokens + [0] * 8)  # room for the generated tokens
    last = runner.step([(name, len(t)) for name, t in prompts.items()])
    step_logits: dict[str, list[torch.Tensor]] = {name: [] for name in prompts}
    for _ in range(7):
        for name, logits in last.items():
            runner.tokens[name][runner.computed[name]] = int(logits[-1].argmax())
        last = runner.step([(name, 1) for name in prompts])
        for name, logits in last.items():
            step_logits[name].append(logits[0])
    for name, prompt in prompts.items():
        full = runner.tokens[name][: runner.computed[name]]
        ref = _reference(llama, full)
        _check(torch.stack(step_logits[name]), ref[len(prompt) :])


def test_llama3_rope_scaling_untied() -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,  # all three bands at head_dim 16
    }
    hf = _hf_model(tie_word_embeddings=False, rope_parameters=rope)
    assert "lm_head.weight" in hf.state_dict()
    # Bit-exact frequencies, not merely close logits.
    c = model_config_of(hf)
    inv_freq, _ = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    assert torch.equal(inv_freq, hf.model.rotary_emb.inv_freq)
    runner = PagedRunner(_ours(hf), block_size=4)
    seqs = _add_prompts(runner, [40, 7], seed=6)
    first = runner.step([("s0", 25), ("s1", 7)])
    second = runner.step([("s0", 15)])
    _check(torch.cat([first["s0"], second["s0"]]), _reference(hf, seqs["s0"]))
    _check(first["s1"], _reference(hf, seqs["s1"]))


def test_mistral_sliding_window_matches_transformers_past_the_window(
    decode_path: dict[str, bool],
) -> None:
    hf = _hf_model("mistral", sliding_window=5)
    runner = PagedRunner(_ours(hf), block_size=4, seed=9, **decode_path)
    seqs = _add_prompts(runner, [23, 14, 9], seed=10)
    got: dict[str, list[torch.Tensor]] = {name: [] for name in seqs}
    plans = [
        [("s2", 1), ("s0", 12), ("s1", 3)],  # a fresh 12-token chunk longer than the window
        [("s2", 1), ("s1", 1), ("s0", 7)],  # a chunk over a cached prefix past the window
        *[[("s0", 1), ("s1", 1), ("s2", 1)] for _ in range(4)],  # decodes past the window
    ]
    for plan in plans:
        for name, logits in runner.step(plan).items():
            got[name].append(logits)
    for name, tokens in seqs.items():
        _check(torch.cat(got[name]), _reference(hf, tokens)[: runner.computed[name]])


def test_qwen2_qkv_bias() -> None:
    hf = _hf_model("qwen2", num_key_value_heads=1)
    assert "model.layers.0.self_attn.q_proj.bias" in hf.state_dict()
    runner = PagedRunner(_ours(hf), block_size=8)
    _check_one_step_prefill(runner, hf, _add_prompts(runner, [12, 30, 1], seed=7))


def test_bf16_keeps_greedy_argmax(
    llama: transformers.PreTrainedModel, decode_path: dict[str, bool]
) -> None:
    """bf16 vs fp32 over the same tokens: same argmax wherever fp32 is not near a tie."""
    tokens = _prompts([10], seed=8)["s0"] + [0] * 10
    logits: dict[torch.dtype, list[torch.Tensor]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = PagedRunner(_ours(llama, dtype), block_size=4, **decode_path)
        runner.add("s", tokens)
        rows = [runner.step([("s", 10)])["s"][-1]]
        for _ in range(10):
            if dtype == torch.float32:  # fp32 chooses the continuation, bf16 follows it
                runner.tokens["s"][runner.computed["s"]] = int(rows[-1].argmax())
            rows.append(runner.step([("s", 1)])["s"][0])
        logits[dtype] = rows
        tokens = runner.tokens["s"]
    ref, low = torch.stack(logits[torch.float32]), torch.stack(logits[torch.bfloat16])
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * ref.std()
    assert clear.sum() >= len(ref) // 2
    assert torch.equal(ref.argmax(-1)[clear], low.argmax(-1)[clear])
    assert (ref - low).abs().max() < 0.1 * ref.abs().max()


def test_tied_checkpoint_without_lm_head_loads(llama: transformers.PreTrainedModel) -> None:
    weights = {n: t for n, t in llama.state_dict().items() if n != "lm_head.weight"}
    model = LlamaForCausalLM(model_config_of(llama), torch.float32, torch.device("cpu"))
    model.load_weights(weights)
    # One table: the head's weight is what the embedding looks up.
    assert model.head is not None and model.embedding is not None
    assert model.embedding.dense is model.head.weight


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda w: w.pop("model.layers.1.mlp.up_proj.weight"), "missing"),
        (lambda w: w.__setitem__("model.layers.0.extra.weight", torch.zeros(1)), "unexpected"),
        (lambda w: w.__setitem__("model.norm.weight", torch.zeros(3)), "mis-shaped"),
    ],
)
def test_load_weights_rejects_bad_checkpoints(
    llama: transformers.PreTrainedModel,
    edit: Callable[[dict[str, torch.Tensor]], object],
    message: str,
) -> None:
    weights = dict(llama.state_dict())
    edit(weights)
    model = LlamaForCausalLM(model_config_of(llama), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=message):
        model.load_weights(weights)


def test_untied_checkpoint_requires_lm_head() -> None:
    hf = _hf_model(tie_word_embeddings=False)
    weights = {n: t for n, t in hf.state_dict().items() if n != "lm_head.weight"}
    model = LlamaForCausalLM(model_config_of(hf), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        model.load_weights(weights)


def test_metadata_pads_decode_tables_with_own_blocks() -> None:
    spans = [SeqSpan((7, 2), 5, 1), SeqSpan((9,), 0, 1), SeqSpan((4, 1, 3), 6, 3)]
    meta = build_attention_metadata(spans, 4, torch.device("cpu"))
    assert meta.num_decodes == 2 and meta.decode_max_blocks == 2
    assert meta.decode_block_table.tolist() == [7, 2, 9, 9]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 9 * 4 + 0, 1 * 4 + 2, 1 * 4 + 3, 3 * 4 + 0]
    assert meta.decode_context_lens == [6, 1]
    visible = torch.isfinite(meta.decode_mask.view(2, -1)).sum(-1).tolist()
    assert visible == [6, 1]
    (chunk,) = meta.prefills
    assert (chunk.query_start, chunk.query_end, chunk.num_cached_tokens) == (2, 5, 6)
    assert chunk.attn_mask is not None
    assert torch.isfinite(chunk.attn_mask[0, 0]).sum(-1).tolist() == [7, 8, 9]
    assert meta.max_context_len == 9
