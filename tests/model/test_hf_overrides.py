"""--hf-overrides: a model's context set at serve time (Qwen3's YaRN to 128K, as its model card
asks of vLLM and llama.cpp), for an HF directory and a GGUF alike: served as a checkpoint
that carries the same scaling itself is served (whose rope is checked against transformers
in test_rope.py), and anything but the context refused at start-up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import VOCAB
from iterserve import LLM, SamplingParams
from iterserve.config import ConfigError, EngineConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.hf_overrides import with_hf_overrides
from iterserve.model.tokenizer import load_hf_tokenizer
from tiny_checkpoints import model_config_of, tiny_hf_model
from tiny_gguf import write_gguf

CONTEXT = 512
# Copied where given away: transformers fills in the dicts it is handed.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": CONTEXT}
PROMPT = "The capital of France is Paris; of Italy, Rome; of Spain, Madrid; and of Germany,"
SMALL = dict(dtype="float32", compile=False, num_kv_blocks=64)


def test_an_override_is_the_config_of_a_checkpoint_that_carries_it() -> None:
    shape = dict(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=CONTEXT)
    plain = model_config_of(tiny_hf_model("qwen2", **shape))  # type: ignore[arg-type]
    scaled = model_config_of(tiny_hf_model("qwen2", **shape, rope_scaling=dict(YARN)))  # type: ignore[arg-type]
    overridden = with_hf_overrides(plain, {"rope_scaling": dict(YARN)})
    assert overridden == scaled
    assert (overridden.rope_scaling or {})["rope_type"] == "yarn"
    assert overridden.max_position_embeddings == 4 * CONTEXT
    assert (
        with_hf_overrides(plain, {"max_position_embeddings": 2048}).max_position_embeddings == 2048
    )
    with pytest.raises(ModelLoadError, match="--hf-overrides"):
        with_hf_overrides(plain, {"rope_scaling": {"rope_type": "su-mscale"}})


def test_what_would_change_the_network_stops_the_start() -> None:
    for overrides, said in [
        ({"num_hidden_layers": 2}, "'num_hidden_layers' cannot be set here"),
        ({"rope_scaling": "yarn"}, "rope_scaling must be a JSON object"),
        ({"max_position_embeddings": -4}, "must be a positive integer"),
    ]:
        with pytest.raises(ConfigError, match=f"--hf-overrides: .*{said}"):
            EngineConfig(hf_overrides=overrides)


def test_an_hf_directory_and_a_gguf_are_served_as_if_they_carried_the_scaling(
    tiny_qwen2_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    carried = tmp_path / "carried"
    shutil.copytree(tiny_qwen2_dir, carried)
    config = json.loads((carried / "config.json").read_text())
    # transformers 5's key for the rope (with rope_theta), which its loader reads first.
    rope = {**config.get("rope_parameters", {}), **YARN}
    (carried / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    # The tokens, and the prompt's logprobs: at these few positions YaRN moves the logits,
    # if not always the argmax.
    greedy = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0)

    def answer(llm: LLM) -> tuple[list[int], float]:
        out = llm.generate(PROMPT, greedy, use_tqdm=False)[0]
        return out.token_ids, sum(e.logprob for e in out.prompt_logprobs or [] if e)

    want_tokens, want_logprob = answer(LLM(str(carried), **SMALL))
    gguf = tmp_path / "tiny-qwen2.gguf"
    hf = tiny_hf_model(
        "qwen2", vocab_size=VOCAB, tie_word_embeddings=False, max_position_embeddings=CONTEXT,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip  # conftest's tiny_qwen2_dir, the same seed: the same weights
    write_gguf(gguf, "qwen2", hf, load_hf_tokenizer(tokenizer_dir))
    for path in (tiny_qwen2_dir, gguf):
        plain = LLM(str(path), **SMALL)
        assert plain.engine.model_config.rope_scaling is None
        assert abs(answer(plain)[1] - want_logprob) > 1e-3
        del plain
        llm = LLM(str(path), hf_overrides={"rope_scaling": dict(YARN)}, **SMALL)
        assert llm.engine.model_config.max_position_embeddings == 4 * CONTEXT
        tokens, logprob = answer(llm)
        assert tokens == want_tokens and logprob == pytest.approx(want_logprob, abs=1e-5), path
        del llm
