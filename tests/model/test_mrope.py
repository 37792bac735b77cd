"""M-RoPE (Qwen3-VL): an image's tokens turn by their grid positions and the text after it by
positions that go on from the grid's, against transformers' own rule (get_rope_index, its
text rotary embedding); and a sequence whose rotary positions are shifted from its
positions (the text after an image) turns by them in the C++ ops as in the torch paths."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLModel,
    Qwen3VLTextRotaryEmbedding,
)

from iterserve.core.request import PromptEmbeds
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import hf_model_config
from iterserve.model.rope import grid_rope_rows, mrope_components, rope_tables
from paged_runner import PagedRunner
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
def test_shifted_rotary_positions_turn_alike_in_the_cpp_ops_and_torch() -> None:
    """Two sequences prefilled at their positions, then computed on with rotary positions
    shifted back and forth (as after images): the C++ layers (which read each sequence's
    shift from the step table) give the torch paths' logits, to bf16's rounding. Read
    unshifted, the C++ rows are ~20x as far (measured once: mean 0.49 against 0.023)."""
    hf = family_model("qwen3")
    rng = random.Random(3)
    prompts = {n: [rng.randrange(VOCAB) for _ in range(k)] for n, k in (("a", 60), ("b", 40))}
    logits = {}
    for kernel in (True, False):
        config = hf_model_config({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
        model = LlamaForCausalLM(config, torch.bfloat16, torch.device("cpu"))
        model.load(dict(hf.state_dict()), "tiled" if kernel else "torch")
        assert model.fused_layers == kernel
        runner = PagedRunner(model, block_size=16, num_blocks=16, paged_kernel=kernel)
        for name, tokens in prompts.items():
            runner.add(name, tokens)
        rows = [runner.step([("a", 30), ("b", 20)])]
        runner.rope_shift.update(a=-17, b=5)
        rows.append(runner.step([("a", 10), ("b", 20)]))
        rows += [runner.step([("a", 1)]) for _ in range(6)]
        logits[kernel] = torch.cat([row for step in rows for row in step.values()])
    apart = (logits[True] - logits[False]).abs()
    assert float(apart.mean()) < 0.06 and float(apart.max()) < 0.6
