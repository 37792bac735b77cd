"""Adapters made with peft on the bundled SmolLM2-135M: iterserve serving the bundled GGUF
(fp32, the torch path) with three adapters and the base in one batch gives transformers +
peft's greedy tokens and logprobs, peft running on a copy of the same weights (the GGUF's
blocks dequantized, as tests/model/test_loader.py checks transformers' own reader gives)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from iterserve import LLM, SamplingParams
from iterserve.core.lora import LoRARequest
from iterserve.model.loader import load_model
from lora_adapters import SPECS, make_adapters, peft_greedy

pytestmark = pytest.mark.slow  # the bundled model, in transformers too

MAX_TOKENS = 8
# One prompt every adapter and the base run (their texts must differ), and one of each's own.
SHARED = [1] + [(11 * i + 3) % 4000 + 30 for i in range(24)]
OWN = [[1] + [(13 * i + 7 * k) % 3000 + 40 for i in range(20 + 9 * k)] for k in range(4)]


@pytest.fixture(scope="module")
def bundled_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model's weights as a transformers checkpoint (fp32)."""
    loaded = load_model(None, torch.float32)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    fields += ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")
    fields += ("rope_theta", "max_position_embeddings", "tie_word_embeddings")
    config = transformers.LlamaConfig(**{f: getattr(loaded.config, f) for f in fields})
    model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(dict(loaded.weights), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    out = tmp_path_factory.mktemp("bundled-hf")
    model.save_pretrained(out)
    return out


def test_adapters_on_the_bundled_model_match_peft(
    bundled_hf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    adapters = make_adapters(bundled_hf, tmp_path_factory.mktemp("bundled-adapters"))
    names: list[str | None] = [None, *adapters]
    expected = {
        name: peft_greedy(
            bundled_hf, adapters[name] if name else None, [SHARED, OWN[k]], MAX_TOKENS
        )
        for k, name in enumerate(names)
    }
    llm = LLM(
        dtype="float32",
        kernels="torch",
        compile=False,
        enable_lora=True,
        max_loras=2,  # three adapters: one waits for a slot
        max_lora_rank=16,
        max_num_batched_tokens=32,  # the prompts chunked, decodes beside chunks
        max_num_seqs=8,
    )
    prompts, requests = [], []
    for k, name in enumerate(names):
        prompts += [SHARED, OWN[k]]
        requests += [LoRARequest(name, k, str(adapters[name])) if name else None] * 2
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    for i, out in enumerate(outputs):
        name = names[i // 2]
        tokens, logprobs = expected[name][i % 2]
        assert out.token_ids == tokens, f"{name}, prompt {i % 2}"
        # fp32 both, summed in other orders through 30 layers (the tiny model's test holds
        # 2e-4 absolute): up to ~3e-4 relative measured.
        got = [lp.logprob for lp in out.logprobs]
        assert got == pytest.approx(logprobs, rel=1e-3, abs=2e-4), name
    # The adapters changed the text (else the comparison above proves little).
    assert len({tuple(expected[n][0][0]) for n in names}) == len(names)
    assert [spec.name for spec in SPECS] == list(adapters)
