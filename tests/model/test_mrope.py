"""M-RoPE (Qwen3-VL): an image's tokens turn by their grid positions and the text after it by
positions that go on from the grid's, against transformers' own rule (get_rope_index, its
text rotary embedding); and a step holding a grid, and the text after it, turn by them in
the C++ ops as in the torch paths."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import transformers
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLModel,
    Qwen3VLTextRotaryEmbedding,
)

from iterserve import kernels
from iterserve.core.request import PromptEmbeds
from iterserve.executor.paged_model import ForwardSeq, PagedModel
from iterserve.model.attention import allocate_kv_caches
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import hf_model_config
from iterserve.model.rope import grid_rope_rows, mrope_components, rope_tables
from tiny_families import VOCAB, family_model

IMAGE = 7  # the image token's id in the layouts below
# Text, a 3 x 5 image, text, a 4 x 2 image (merged patches), text.
LAYOUT = [(0, 4), (IMAGE, 15), (0, 6), (IMAGE, 8), (0, 3)]
GRIDS = ((3, 5), (4, 2))


def _layout() -> tuple[list[int], tuple[tuple[int, int], ...]]:
    ids: list[int] = []
    spans = []
    for token, count in LAYOUT:
        if token == IMAGE:
            spans.append((len(ids), count))
        ids += [token] * count
    return ids, tuple(spans)


def test_grid_positions_are_transformers_rope_index() -> None:
    ids, spans = _layout()
    embeds = PromptEmbeds(None, b"", spans, grids=GRIDS)
    config = transformers.Qwen3VLConfig(image_token_id=IMAGE)
    model = Qwen3VLModel.__new__(Qwen3VLModel)  # get_rope_index reads the config alone
    model.config = config
    input_ids = torch.tensor([ids])
    thw = torch.tensor([[1, 2 * rows, 2 * columns] for rows, columns in GRIDS])  # unmerged
    want, delta = model.get_rope_index(input_ids, (input_ids == IMAGE).int(), thw)
    got = embeds.grid_positions(0, len(ids))
    assert got is not None
    assert torch.tensor(got).T.tolist() == want[:, 0].tolist()
    # Every chunk's positions are the whole prompt's, and a chunk of text alone is shifted.
    for start in range(len(ids)):
        for count in range(1, len(ids) - start + 1):
            chunk = embeds.grid_positions(start, count)
            if chunk is None:
                assert all(token != IMAGE for token in ids[start : start + count])
                shift = embeds.rope_shift(start)
                chunk = [(p + shift,) * 3 for p in range(start, start + count)]
            assert chunk == got[start : start + count], (start, count)
    # The text after the prompt (its answer) goes on as transformers' rope delta says.
    assert embeds.rope_shift(len(ids)) == int(delta)


@pytest.mark.parametrize("interleaved", [True, False], ids=["qwen3vl", "qwen2vl"])
def test_grid_rows_are_transformers_rotary_embedding(interleaved: bool) -> None:
    """Qwen3-VL's frequencies take turns between the three positions, Qwen2-VL's (and
    Qwen2.5-VL's) take a run each: both read from one table as transformers computes them."""
    section = [6, 5, 5] if interleaved else [4, 6, 6]
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": section}
    shape = dict(hidden_size=64, num_attention_heads=2, head_dim=32, rope_parameters=rope)
    if interleaved:
        rotary = Qwen3VLTextRotaryEmbedding(transformers.Qwen3VLTextConfig(**shape))
    else:
        rotary = Qwen2VLRotaryEmbedding(transformers.Qwen2VLTextConfig(**shape))
    positions = torch.randint(0, 200, (3, 1, 40))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    table_cos, table_sin = rope_tables(32, 5e6, None, 256, torch.float32, torch.device("cpu"))
    components = mrope_components((section[0], section[1], section[2]), interleaved)
    got_cos = grid_rope_rows(table_cos, positions[:, 0], components)
    got_sin = grid_rope_rows(table_sin, positions[:, 0], components)  # signed: -sin, sin
    torch.testing.assert_close(got_cos, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got_sin, torch.cat((-sin[0, :, :16], sin[0, :, 16:]), -1))


@pytest.mark.usefixtures("kernel_isa")
def test_grid_and_shifted_rotary_positions_turn_alike_in_the_cpp_ops_and_torch() -> None:
    """Two sequences in one flat batch: a prompt's text, then a chunk holding a 4 x 4 grid
    (each row's own three positions) beside the other's text, then the text after it
    shifted, and decodes. The C++ layers (a grid step's rows at their rows of the step's
    own rope rows, a shifted step's at their sequence's shift: the step table) give the
    torch paths' logits to bf16's rounding (measured once: mean 0.023, largest 0.23). Checked
    by mutation: the text's shift left out of the step table puts the C++ logits far off (mean
    0.10, largest 7.7); the grid step's rows at their positions, not their rows, are refused."""
    hf = family_model("qwen3")
    rng = random.Random(3)
    tokens = {name: [rng.randrange(VOCAB) for _ in range(60)] for name in "ab"}
    grid = PromptEmbeds(None, b"", ((20, 16),), grids=((4, 4),))
    plan = [[("a", 20), ("b", 20)], [("a", 24), ("b", 10)], *[[("a", 1), ("b", 1)]] * 6]
    logits = {}
    for kernel in (True, False):
        config = hf_model_config({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
        config = dataclasses.replace(config, mrope_section=(12, 10, 10), mrope_interleaved=True)
        model = LlamaForCausalLM(config, torch.bfloat16, torch.device("cpu"))
        model.load(dict(hf.state_dict()), "tiled" if kernel else "torch")
        assert model.fused_layers == kernel
        if kernel:
            model.use_kernel_ops(kernels.ops())
        caches = allocate_kv_caches(config, 16, 16, torch.bfloat16, torch.device("cpu"))
        network = PagedModel(model, caches, 16, torch.device("cpu"), paged_attention_kernel=kernel)
        blocks = {"a": (3, 7, 1, 12), "b": (5, 0, 9, 14)}
        done = {"a": 0, "b": 0}
        rows = []
        for step in plan:
            seqs = []
            for name, count in step:
                start = done[name]
                embeds = grid if name == "a" else PromptEmbeds(None, b"")
                seqs.append(
                    ForwardSeq(
                        blocks[name], start, tokens[name][start : start + count], count,
                        rope_shift=embeds.rope_shift(start),
                        grid_positions=embeds.grid_positions(start, count),
                    )
                )  # fmt: skip
                done[name] += count
            rows.append(network.forward(seqs))
        logits[kernel] = torch.cat(rows)
    apart = (logits[True] - logits[False]).abs()
    assert float(apart.mean()) < 0.06 and float(apart.max()) < 0.6
