"""Tiny thinking models, made here: the bundled SmolLM2 tokenizer with `<think>` and
`</think>` added as the real Qwen3 and DeepSeek-R1 tokenizers have them (one token each, not
special), a tiny random checkpoint of the family's architecture (Qwen3; R1's distills are
Qwen2), and the family's real chat template, as llama.cpp keeps them in `models/templates/`
(Qwen-Qwen3-0.6B.jinja, deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja), under
tests/server/chat_templates/. Likewise a tiny gpt-oss, with Harmony's special tokens and
its template (openai-gpt-oss-120b.jinja).

A random model never writes `<think>` by itself, so `forced_tokens` makes a request's first
tokens a script, chosen where the sampler draws: after the logit controls and the grammar's
mask, so a scripted token the mask forbids is not drawn but reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken

from iterserve.core.outputs import ScheduledSeq
from iterserve.engine.llm_engine import LLMEngine
from iterserve.model.tokenizer import load_hf_tokenizer
from tiny_checkpoints import save_checkpoint, tiny_hf_model
from tiny_families import gpt_oss_model

TEMPLATES = Path(__file__).parent / "server" / "chat_templates"
QWEN3_TEMPLATE = (TEMPLATES / "qwen3.jinja").read_text()
R1_TEMPLATE = (TEMPLATES / "deepseek_r1_distill_qwen_32b.jinja").read_text()
GPT_OSS_TEMPLATE = (TEMPLATES / "openai_gpt_oss_120b.jinja").read_text()
OPEN, CLOSE = "<think>", "</think>"
# Harmony's special tokens, as gpt-oss's tokenizer has them; the last two end a turn.
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
HARMONY_ENDS = ("<|return|>", "<|call|>")


def thinking_tokenizer(tokenizer_dir: Path, template: str, special: bool = False) -> Any:
    """SmolLM2's tokenizer with the thinking markers as tokens (`special`: as special
    tokens, which some tokenizers make them) and `template` as its chat template."""
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    markers = [AddedToken(text, special=special, normalized=False) for text in (OPEN, CLOSE)]
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": markers})
    else:
        tokenizer.add_tokens(markers)
    tokenizer.chat_template = template
    return tokenizer


def thinking_checkpoint(tokenizer_dir: Path, out: Path, family: str) -> Path:
    """A tiny random `family` model ("qwen3" or "deepseek_r1") with its chat template."""
    template = QWEN3_TEMPLATE if family == "qwen3" else R1_TEMPLATE
    tokenizer = thinking_tokenizer(tokenizer_dir, template)
    model = tiny_hf_model(
        "qwen3" if family == "qwen3" else "qwen2",
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        **({"head_dim": 16} if family == "qwen3" else {}),
    )
    return save_checkpoint(model, out, tokenizer)


def harmony_tokenizer(tokenizer_dir: Path) -> Any:
    """SmolLM2's tokenizer with Harmony's special tokens and gpt-oss's chat template (as
    llama.cpp keeps it: models/templates/openai-gpt-oss-120b.jinja)."""
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    tokens = [
        AddedToken(text, special=True, normalized=False)
        for text in (*HARMONY_TOKENS, *HARMONY_ENDS)
    ]
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = GPT_OSS_TEMPLATE
    return tokenizer


def gpt_oss_checkpoint(tokenizer_dir: Path, out: Path) -> Path:
    """A tiny random gpt-oss with Harmony's tokens, whose turns end at either end token."""
    tokenizer = harmony_tokenizer(tokenizer_dir)
    model = gpt_oss_model(vocab_size=len(tokenizer))
    model.config.eos_token_id = tokenizer.convert_tokens_to_ids(list(HARMONY_ENDS))
    return save_checkpoint(model, out, tokenizer)


def ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def thinking_answer(tokenizer: Any, thought: str, answer: str, opened: bool = False) -> list[int]:
    """A thinking answer's tokens, then EOS: `<think>` (unless the prompt `opened` it),
    the thought, `</think>`, the answer."""
    opening = [] if opened else ids(tokenizer, OPEN)
    return [
        *opening,
        *ids(tokenizer, thought),
        *ids(tokenizer, CLOSE),
        *ids(tokenizer, answer),
        tokenizer.eos_token_id,
    ]


@contextmanager
def forced_tokens(engine: LLMEngine, script: list[int]) -> Iterator[list[tuple[str, int, int]]]:
    """Every request's first `len(script)` tokens are the script's, drawn where the sampler
    draws: the row is left with that token alone, unless the controls or the grammar's mask
    forbid it there, in which case the row is left as it is (the request samples as it
    would) and (request id, position, token) is added to the list this yields. One token a
    step: no speculation."""
    runner = engine.executor
    original = runner._sample_matching
    position: dict[str, int] = {}
    refused: list[tuple[str, int, int]] = []

    def sample(
        logits: torch.Tensor, raw_logits: torch.Tensor, seqs: list[ScheduledSeq]
    ) -> dict[str, Any]:
        logits = logits.clone()  # it may be raw_logits itself, which the logprobs read
        for row, seq in enumerate(seqs):
            assert seq.num_samples == 1, "forced_tokens runs without speculation"
            index = position.get(seq.request_id, 0)
            position[seq.request_id] = index + 1
            if index < len(script):
                token = script[index]
                if torch.isfinite(logits[row, token]):
                    logits[row] = float("-inf")
                    logits[row, token] = 0.0
                else:
                    refused.append((seq.request_id, index, token))
        return original(logits, raw_logits, seqs)

    runner._sample_matching = sample  # type: ignore[method-assign]
    try:
        yield refused
    finally:
        runner._sample_matching = original  # type: ignore[method-assign]
