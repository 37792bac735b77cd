"""Multi-LoRA serving against transformers + peft (fp32): three adapters (attention-only, all
linear, rsLoRA) and the base mixed in the same steps, through chunked prefill, prefix-cache
hits and preemption, with fewer slots than adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve import LLM, SamplingParams
from iterserve.core.lora import LoRARequest
from iterserve.sampling_params import InvalidRequestError
from lora_adapters import SPECS, peft_greedy

MAX_TOKENS = 10
# Token-id prompts: one shared by every adapter and the base (their KV must never be shared
# through the prefix cache), long enough to be chunked and to fill blocks.
SHARED = [1] + [(7 * i + 3) % 900 + 10 for i in range(40)]
OWN = [[1] + [(13 * i + 5 * k) % 700 + 20 for i in range(18 + 6 * k)] for k in range(4)]


@pytest.fixture(scope="module")
def adapters(tiny_llama_adapters: dict[str, Path]) -> dict[str, Path]:
    return tiny_llama_adapters


@pytest.fixture(scope="module")
def expected(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> dict[str | None, list[tuple[list[int], list[float]]]]:
    """Per adapter (None: the base): the reference for [SHARED, its own prompt]."""
    names: list[str | None] = [None, *adapters]
    return {
        name: peft_greedy(
            tiny_llama_dir, adapters.get(name) if name else None, [SHARED, OWN[k]], MAX_TOKENS
        )
        for k, name in enumerate(names)
    }


@pytest.mark.slow
def test_adapters_and_base_in_one_batch_match_peft(
    tiny_llama_dir: Path, adapters: dict[str, Path], expected: dict
) -> None:
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        kernels="torch",
        compile=False,
        enable_lora=True,
        max_loras=2,  # three adapters: one waits for a slot, none starves
        max_lora_rank=16,
        max_num_batched_tokens=24,  # every prompt chunked, decodes beside chunks
        max_num_seqs=8,
        block_size=4,
        num_kv_blocks=40,  # preemption: the prompts fit, the outputs do not
    )
    loras = {
        spec.name: LoRARequest(spec.name, i, str(adapters[spec.name]))
        for i, spec in enumerate(SPECS, start=1)
    }
    names: list[str | None] = [None, *loras]
    prompts, requests = [], []
    for k, name in enumerate(names):
        prompts += [SHARED, OWN[k]]
        requests += [loras[name] if name else None] * 2
    # Last in line, the shared prompt again: a prefix-cache hit, on its own adapter's blocks.
    prompts.append(SHARED)
    requests.append(loras["mlp"])
    names.append("mlp")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    for i, out in enumerate(outputs):
        name = names[min(i // 2, len(names) - 1)]
        tokens, logprobs = expected[name][i % 2]
        assert out.token_ids == tokens, f"{name}, prompt {i % 2}"
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=2e-4)
        assert out.lora_name == name
    assert outputs[-1].num_cached_tokens > 0
    stats = llm.engine.scheduler.kv_cache_stats()
    assert llm.engine.scheduler.num_preemptions > 0
    assert stats.prefix_hits > 0 and stats.num_used_blocks == 0
    # The adapters changed the text (else the comparison above proves little).
    assert len({tuple(expected[n][0][0]) for n in names}) == len(expected)


def test_adapters_are_refused_by_an_engine_without_lora(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    plain = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    lora = LoRARequest("attn", 1, str(adapters["attn"]))
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        plain.generate([SHARED], use_tqdm=False, lora_request=lora)


def test_embeddings_and_scores_run_their_adapter(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """A pooled request with an adapter: its states are the adapter's (peft's final-norm
    states), beside the base's in the same steps; a score's head stays the base's rows."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from iterserve.pooling_params import PoolingParams

    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        compile=False,
        enable_lora=True,
        max_lora_rank=16,
        pooling="mean",
        task="both",
        classifier_from_tokens="yes",
        max_num_batched_tokens=24,  # the prompts chunked
        max_num_seqs=8,
    )
    lora = LoRARequest("mlp", 1, str(adapters["mlp"]))
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapters["mlp"]).eval().get_base_model()
    yes = llm.engine.tokenizer.convert_tokens_to_ids("yes")
    raw = PoolingParams(normalize=False)
    with_adapter = llm.embed([SHARED, OWN[1]], raw, use_tqdm=False, lora_request=lora)
    plain = llm.embed([SHARED], raw, use_tqdm=False)[0]
    scored = llm.score("a query", "a document", use_tqdm=False, lora_request=lora)[0]
    with torch.no_grad():
        for out, prompt in zip(with_adapter, [SHARED, OWN[1]], strict=True):
            states = peft.model(torch.tensor([prompt])).last_hidden_state[0]
            torch.testing.assert_close(
                torch.tensor(out.embedding), states.mean(0), atol=1e-5, rtol=1e-5
            )
        logit = peft(torch.tensor([scored.prompt_token_ids])).logits[0, -1, yes]
    assert scored.score == pytest.approx(float(torch.sigmoid(logit)), abs=1e-5)
    moved = torch.tensor(plain.embedding) - torch.tensor(with_adapter[0].embedding)
    assert moved.abs().max() > 1e-3  # the adapter changed the states (else this proves little)
    assert with_adapter[0].lora_name == "mlp" and plain.lora_name is None
