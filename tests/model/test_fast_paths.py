"""Every fast path of the model against the eager torch reference on tiny random checkpoints:
oneDNN-packed and tiled linears (bf16, 4-bit and int8), the compiled layer stack, the C++
attention.

fp32 paths must agree within a tight tolerance; bf16 ones must pick the reference's greedy
token wherever the reference is not near a tie; weights in GGUF blocks are checked against
the same weights dequantized and run in fp32 (here W8A8's Q8_0 blocks; every GGUF type, read
from a file, in test_gguf_models.py).
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch._dynamo.utils import counters

from iterserve import kernels
from iterserve.model import llama
from iterserve.model.block_formats import quantize_q8_0
from iterserve.model.gguf_blocks import GGUFBlocks
from iterserve.model.linear import Backend, WeightMode, onednn_usable
from iterserve.model.llama import LlamaForCausalLM
from paged_runner import PagedRunner
from tiny_checkpoints import model_config_of, tiny_hf_model
from transformers_reference import assert_same_greedy

VOCAB = 256
# Runs the test once per ISA variant of the kernels (conftest.kernel_test_isas).
needs_kernels = pytest.mark.usefixtures("kernel_isa")
ONEDNN = pytest.param(
    "onednn",
    marks=pytest.mark.skipif(
        not onednn_usable(torch.bfloat16, torch.device("cpu")),
        reason="oneDNN has no bf16 arithmetic on this CPU",
    ),
)


# The tiny model these tests run (3 layers; one test takes 1).
_SHAPE: dict[str, object] = dict(
    vocab_size=VOCAB, weight_std=0.1, hidden_size=128, intermediate_size=256
)


@pytest.fixture(scope="module")
def hf() -> transformers.PreTrainedModel:
    return tiny_hf_model(
        **_SHAPE,  # type: ignore[arg-type]
        num_hidden_layers=3,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


def _model(
    hf: transformers.LlamaForCausalLM,
    dtype: torch.dtype,
    backend: Backend = "torch",
    weights: dict[str, torch.Tensor] | None = None,
    quantized: dict[str, GGUFBlocks] | None = None,
    compiled: bool = False,
    mode: WeightMode = "blocks",
) -> LlamaForCausalLM:
    model = LlamaForCausalLM(model_config_of(hf), dtype, torch.device("cpu"))
    model.load(weights or hf.state_dict(), backend, quantized, mode)
    if compiled:
        model.compile_layers()
    return model


def _run(
    model: LlamaForCausalLM,
    tokens: list[list[int]],
    kernel: bool,
    kv_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Teacher-forced over fixed tokens: prefill chunks (mixed with decodes), then decodes.

    Returns each sequence's logits rows, in position order.
    """
    runner = PagedRunner(
        model, block_size=16, num_blocks=64, paged_kernel=kernel, kv_dtype=kv_dtype
    )
    return _teacher_force(runner, tokens)


def _teacher_force(runner: PagedRunner, tokens: list[list[int]]) -> list[torch.Tensor]:
    for i, seq in enumerate(tokens):
        runner.add(f"s{i}", seq)
    rows: list[list[torch.Tensor]] = [[] for _ in tokens]

    def step(plan: list[tuple[str, int]]) -> None:
        for name, logits in runner.step(plan).items():
            rows[int(name[1:])].append(logits)

    step([("s0", 20), ("s1", 3)])
    step([("s1", 1), ("s0", 12), ("s2", 30)])  # a chunk over a cached prefix beside a decode
    while any(runner.computed[f"s{i}"] < len(seq) for i, seq in enumerate(tokens)):
        step([(f"s{i}", 1) for i, seq in enumerate(tokens) if runner.computed[f"s{i}"] < len(seq)])
    return [torch.cat(r) for r in rows]


def _tokens(seed: int, lengths: tuple[int, ...] = (120, 100, 130)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


@needs_kernels
@pytest.mark.parametrize("backend", [ONEDNN, "tiled"])
def test_bf16_fast_linears_keep_the_reference_greedy_tokens(hf, backend: Backend) -> None:
    tokens = _tokens(1)
    reference = _run(_model(hf, torch.bfloat16), tokens, kernel=False)
    fast = _run(_model(hf, torch.bfloat16, backend), tokens, kernel=True)
    assert_same_greedy(reference, fast)


@needs_kernels
def test_paged_attention_op_equals_torch_attention_in_fp32(hf) -> None:
    tokens = _tokens(2, (70, 40, 90))
    model = _model(hf, torch.float32)
    for ref, got in zip(_run(model, tokens, False), _run(model, tokens, True), strict=True):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


def test_compiled_stack_equals_eager_in_fp32(hf) -> None:
    tokens = _tokens(3, (40, 20, 35))
    eager = _run(_model(hf, torch.float32), tokens, kernel=False)
    compiled = _run(_model(hf, torch.float32, compiled=True), tokens, kernel=False)
    for ref, got in zip(eager, compiled, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


@needs_kernels
@pytest.mark.parametrize("backend", [ONEDNN, "tiled"])
def test_compiled_stack_with_fast_linears_keeps_the_reference_greedy_tokens(
    hf, backend: Backend
) -> None:
    tokens = _tokens(4, (50, 30, 45))
    reference = _run(_model(hf, torch.bfloat16), tokens, kernel=False)
    fast = _run(_model(hf, torch.bfloat16, backend, compiled=True), tokens, kernel=True)
    assert_same_greedy(reference, fast)


@needs_kernels
def test_int8_kv_cache_kernels_store_and_read_what_torch_does() -> None:
    """fp32 model, int8 pool: the C++ store writes the bytes model/kv_cache_format.py does,
    and the C++ attention reads them as the torch path does. One layer, so that both paths
    quantize the same K/V (deeper, fp32 rounding differences in attention would flip some
    roundings to int8 and the comparison would measure quantization noise instead)."""
    one_layer = tiny_hf_model(**_SHAPE, num_hidden_layers=1)  # type: ignore[arg-type]
    tokens = _tokens(7, (70, 40, 90))
    model = _model(one_layer, torch.float32)
    runs = {}
    for kernel in (False, True):
        runner = PagedRunner(
            model, block_size=16, num_blocks=64, paged_kernel=kernel, kv_dtype=torch.int8
        )
        runs[kernel] = (_teacher_force(runner, tokens), runner.caches)
    (ref, ref_caches), (got, got_caches) = runs[False], runs[True]
    assert all(torch.equal(g, r) for g, r in zip(got_caches[0], ref_caches[0], strict=True))
    for ref_rows, got_rows in zip(ref, got, strict=True):
        torch.testing.assert_close(got_rows, ref_rows, atol=2e-5, rtol=0)


@needs_kernels
def test_int8_kv_cache_keeps_the_reference_greedy_tokens(hf) -> None:
    """bf16 model on the fused-layer kernels with an int8 pool against the fp32 reference
    with an exact (fp32) pool."""
    tokens = _tokens(8)
    reference = _run(_model(hf, torch.float32), tokens, kernel=False)
    fast = _run(_model(hf, torch.bfloat16, "tiled"), tokens, kernel=True, kv_dtype=torch.int8)
    assert_same_greedy(reference, [rows.float() for rows in fast])


@pytest.mark.parametrize(
    ("dtype", "backend"),
    [
        (torch.float32, "torch"),
        pytest.param(
            torch.bfloat16,
            "tiled",
            marks=pytest.mark.skipif(not kernels.available(), reason="no C++ kernels here"),
        ),
    ],
)
def test_frozen_graphs_run_without_guards_and_compute_the_same(
    hf, dtype: torch.dtype, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a one-token and a many-token step, calls bypass dynamo's guards: still the same
    logits for steps of every shape (mixed chunks, decodes, a lone decode), and the rotary
    tables still grow as sequences reach past them (graph inputs, not constants of the
    trace: the frozen graphs must read the new ones). A KV pool of another size takes the
    same graphs: `--kv-cache-memory auto` sizes it by the memory free at each start, and
    a block count traced in would also miss inductor's on-disk cache at every start."""
    monkeypatch.setattr(llama, "_ROPE_POSITIONS", 8)
    kernel = backend == "tiled"
    tokens = _tokens(6, (40, 20, 35))
    compiled = _model(hf, dtype, backend, compiled=True)

    def warm_up(num_blocks: int) -> None:
        warm = PagedRunner(compiled, block_size=16, num_blocks=num_blocks, paged_kernel=kernel)
        warm.add("w", [1, 2, 3, 4])
        warm.step([("w", 1)])
        warm.step([("w", 3)])

    warm_up(64)
    graphs = counters["stats"]["unique_graphs"]
    warm_up(48)
    assert counters["stats"]["unique_graphs"] == graphs
    compiled.freeze_compiled()
    assert compiled._run_layers.frozen
    assert compiled.rope_positions == 8
    eager = _run(_model(hf, dtype, backend), tokens, kernel=kernel)
    frozen = _run(compiled, tokens, kernel=kernel)
    assert compiled.rope_positions == 40  # grown past 8 rows to the longest sequence
    if dtype == torch.bfloat16:  # the graph keeps fp32 between fused ops where eager rounds
        assert_same_greedy(eager, frozen)
        return
    for ref, got in zip(eager, frozen, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


def _assert_as_close_as_bf16(
    reference: list[torch.Tensor],
    fast: list[torch.Tensor],
    bf16: list[torch.Tensor],
    error_factor: float = 1.5,
    miss_share: float = 0.01,
) -> None:
    """`fast` (bf16 activations over quantized weights) against the fp32 `reference` over the
    same weights, by the yardstick of plain bf16 there: bf16 activations round where fp32
    does not, so no bf16 path can match fp32 exactly. `miss_share`: the greedy picks it may
    miss beyond bf16's, as a share of the rows that are no near-tie."""
    ref = torch.cat(reference)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * ref.std()

    def misses(rows: list[torch.Tensor]) -> int:
        return int((torch.cat(rows).argmax(-1) != ref.argmax(-1))[clear].sum())

    assert misses(fast) <= misses(bf16) + max(2, int(miss_share * int(clear.sum())))
    fast_error = (torch.cat(fast) - ref).abs().mean()
    bf16_error = (torch.cat(bf16) - ref).abs().mean()
    assert fast_error <= error_factor * bf16_error


@needs_kernels
def test_int8_weights_and_activations_keep_the_reference_greedy_tokens(hf) -> None:
    """`--weights int8` on a bf16 checkpoint: every projection and the head made Q8_0 blocks
    at load (W8A8 at every step size), against the same weights through Q8_0 and back, run in
    fp32. What remains is the activations' rounding to 8 bits per block of 32 (steps of 2^-7
    of the block's largest), about twice the error of bf16's 8-bit mantissa (measured 2.0-2.3x
    on these checkpoints)."""
    tokens = _tokens(6)
    int8 = _model(hf, torch.bfloat16, "tiled", mode="int8")
    assert set(int8.describe_linears().values()) == {"tiled-Q8_0"}
    weights = {
        name: _q8_0_roundtrip(tensor) if name.endswith("proj.weight") or "embed" in name else tensor
        for name, tensor in hf.state_dict().items()
    }
    reference = _run(_model(hf, torch.float32, weights=weights), tokens, kernel=False)
    bf16 = _run(_model(hf, torch.bfloat16, weights=weights), tokens, kernel=False)
    fast = _run(int8, tokens, kernel=True)
    _assert_as_close_as_bf16(reference, fast, bf16, error_factor=2.5)


def _q8_0_roundtrip(weight: torch.Tensor) -> torch.Tensor:
    raw = quantize_q8_0(weight)
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0)).reshape(weight.shape)
