"""A grammar that starts after the thinking (sample/thinking_gate.py, StructuredBatch): rows
are left alone until the thinking's end marker, then masked as the grammar's from its
start, whether the marker is one token or several, comes in one step or across guesses;
and through the engine, the same greedy text with and without speculation.

Every mask is checked against a fresh matcher of the same grammar asked token by token,
never against masks recorded from this code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from iterserve.sample.thinking_gate import Phase, ThinkingGate
from iterserve.structured_output import StructuredOutput, ThinkingMarkers

VOCAB = 49152
DIGITS = StructuredOutput(regex=r"[0-9]{2,6}")


def test_the_gate_opens_at_the_end_marker() -> None:
    gate = ThinkingGate.start(ThinkingMarkers((7, 8)))
    assert gate.phase is Phase.THINKING and not gate.masks
    gate, taken = gate.follow([1, 7, 2, 7, 8, 5, 6])  # 7 alone is not the end
    assert gate.is_open and taken == 5  # 5 and 6 are the grammar's
    one = ThinkingGate.start(ThinkingMarkers((9,)))
    assert one.follow([9])[0].is_open and not one.follow([1, 2])[0].is_open


def test_an_undecided_gate_opens_on_its_first_token_unless_it_opens_thinking() -> None:
    gate = ThinkingGate.start(ThinkingMarkers((9,), open=4))
    assert gate.phase is Phase.UNDECIDED and gate.masks
    answered, taken = gate.follow([5, 6])
    assert answered.is_open and taken == 0  # all the grammar's
    thinking, taken = gate.follow([4, 5, 9, 6])
    assert thinking.is_open and taken == 3
    assert gate.after(4) == (ThinkingGate(gate.markers, Phase.THINKING), False)


@pytest.fixture(scope="module")
def compiler(tokenizer_dir: Path) -> Any:
    from iterserve.model.tokenizer import load_hf_tokenizer
    from iterserve.sample.structured import GrammarCompiler

    tokenizer = load_hf_tokenizer(tokenizer_dir)
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    compiler.tokenizer = tokenizer  # for the tests' own encoding
    return compiler


def _ids(compiler: Any, text: str) -> list[int]:
    return compiler.tokenizer.encode(text, add_special_tokens=False)


def _allowed_after(compiler: Any, tokens: list[int], probe: list[int]) -> set[int]:
    """Which of `probe` a fresh matcher of DIGITS allows after `tokens`."""
    matcher = compiler.compile(DIGITS).new_matcher()
    assert matcher.consume_tokens(tokens) if tokens else True
    return {token for token in probe if matcher.deep_copy().consume_token(token)}


def _probe(compiler: Any) -> list[int]:
    torch.manual_seed(0)
    named = [token for text in ("0 1 7 99 x", "Hmm", "</think>") for token in _ids(compiler, text)]
    return sorted(set(torch.randint(VOCAB, (300,)).tolist() + named))


def _finite(row: torch.Tensor, probe: list[int]) -> set[int]:
    return {token for token in probe if bool(torch.isfinite(row[token]))}


def test_rows_are_left_alone_until_the_end_marker_then_masked(compiler: Any) -> None:
    from iterserve.sample.structured import StructuredBatch

    end = tuple(_ids(compiler, "</think>"))
    assert len(end) > 1, "this tokenizer writes the marker in several tokens"
    thought, digits = _ids(compiler, "Hmm, digits"), _ids(compiler, "12")
    probe = _probe(compiler)
    batch = StructuredBatch()
    batch.add("gated", compiler.compile(DIGITS), ThinkingMarkers(end))
    batch.add("plain", compiler.compile(DIGITS))  # the control: masked from the start
    logits = torch.zeros(2, VOCAB)
    batch.mask(logits, ["gated", "plain"])
    assert bool((logits[0] == 0).all()), "thinking is not masked"
    assert _finite(logits[1], probe) == _allowed_after(compiler, [], probe)
    assert not set(thought) & _finite(logits[1], probe), "a grammar from the start would refuse it"
    assert batch.valid_prefix("gated", [*thought, *end, *digits, *thought]) == (
        len(thought) + len(end) + len(digits)
    )
    # One step's tokens: the thought, the end, and the grammar's first digits.
    batch.advance("gated", [*thought, *end[:1]])
    assert not batch.is_finished("gated")
    batch.advance("gated", [*end[1:], *digits])
    logits = torch.zeros(1, VOCAB)
    batch.mask(logits, ["gated"])
    assert _finite(logits[0], probe) == _allowed_after(compiler, digits, probe)


def test_guesses_across_the_end_are_masked_from_where_the_grammar_starts(compiler: Any) -> None:
    """Speculation: a row is masked by the grammar after the guesses before it that follow
    the end; rows before the end are thinking; the matcher is left where it was."""
    from iterserve.sample.structured import StructuredBatch

    end = tuple(_ids(compiler, "</think>"))
    opener = _ids(compiler, "Hmm")[0]
    thought, digits = _ids(compiler, " so"), _ids(compiler, "1") + _ids(compiler, "2")
    probe = _probe(compiler)
    batch = StructuredBatch()
    batch.add("inside", compiler.compile(DIGITS), ThinkingMarkers(end))
    batch.add("undecided", compiler.compile(DIGITS), ThinkingMarkers(end, opener))
    guesses = {
        "inside": [*thought, *end, *digits],
        "undecided": [opener, *thought, *end, *digits],
    }
    starts = {"inside": 0, "undecided": len(guesses["inside"]) + 1}
    logits = torch.zeros(sum(len(g) + 1 for g in guesses.values()), VOCAB)
    for _ in range(2):  # and again: the first masking moved no matcher or gate
        logits.zero_()
        batch.mask(logits, list(guesses), list(starts.values()), list(guesses.values()))
        for name, draft in guesses.items():
            grammar_from = draft.index(end[-1]) + 1
            for j in range(len(draft) + 1):
                row = logits[starts[name] + j]
                if name == "undecided" and j == 0:  # the grammar's first tokens, or the opener
                    want = _allowed_after(compiler, [], probe) | {opener}
                    assert _finite(row, probe) == want
                elif j < grammar_from:
                    assert bool((row == 0).all()), (name, j)
                else:
                    want = _allowed_after(compiler, draft[grammar_from:j], probe)
                    assert _finite(row, probe) == want, (name, j)


def test_followed_guesses_are_taken_back_with_the_gate(compiler: Any) -> None:
    """A draft model follows its guesses one by one and rolls them back: the gate goes
    back to thinking, the matcher to its start."""
    from iterserve.sample.structured import StructuredBatch

    end = tuple(_ids(compiler, "</think>"))
    opener = _ids(compiler, "Hmm")[0]
    probe = _probe(compiler)
    batch = StructuredBatch()
    batch.add("r", compiler.compile(DIGITS), ThinkingMarkers(end, opener))
    guesses = [opener, *_ids(compiler, " ok"), *end, *_ids(compiler, "7")]
    for token in guesses:
        assert batch.try_advance("r", token)
    assert not batch.try_advance("r", _ids(compiler, "x")[0])  # the grammar refuses it
    batch.rollback("r", len(guesses))
    logits = torch.zeros(1, VOCAB)
    batch.mask(logits, ["r"])
    assert _finite(logits[0], probe) == _allowed_after(compiler, [], probe) | {opener}
    # Answered at once: the first token is the grammar's, and rolls back the matcher too.
    digit = _ids(compiler, "4")
    assert batch.try_advance("r", digit[0])
    batch.rollback("r", 1)
    batch.advance("r", digit)
    logits = torch.zeros(1, VOCAB)
    batch.mask(logits, ["r"])
    assert _finite(logits[0], probe) == _allowed_after(compiler, digit, probe)


# ---- through the engine --------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_the_grammar_starts_where_the_free_text_wrote_the_marker(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random model's greedy text, then the same prompt with its first three tokens as
    the end marker: the text is the free one up to them, then JSON the grammar made; and
    the same tokens with speculation (this model repeats itself, so guesses run into the
    marker, and the draft model's on past it, into the grammar, in one step)."""
    import json

    import jsonschema

    from iterserve import LLM, SamplingParams

    prompt = "1 2 3 1 2 3 1 2 3"
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    marker = tuple(free[0].token_ids[:3])
    spec = StructuredOutput.from_json_schema(SCHEMA)
    spec.after_thinking = ThinkingMarkers(marker)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_output=spec)
    gated = llm.generate(prompt, params, use_tqdm=False)[0]
    assert tuple(gated.token_ids[:3]) == marker
    answer = llm.tokenizer.decode(gated.token_ids[3:], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert gated.finish_reason == "stop"
    from iterserve.sample.structured import StructuredBatch

    rows = StructuredBatch._rows
    crossed: list[str] = []

    def spied(batch: StructuredBatch, request_id: str, draft: Any) -> Any:
        plan = rows(batch, request_id, draft)
        if plan.first is not None and 0 < plan.first < len(draft):
            crossed.append(request_id)  # guesses after the marker, masked by the grammar
        return plan

    monkeypatch.setattr(StructuredBatch, "_rows", spied)
    for method in ("ngram", "draft"):
        extra: dict[str, Any] = {"draft_model": str(tiny_llama_dir)} if method == "draft" else {}
        speculating = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            compile=False,
            speculative_method=method,
            num_speculative_tokens=3,
            **extra,
        )
        out = speculating.generate(prompt, params, use_tqdm=False)[0]
        assert out.token_ids == gated.token_ids, method
        assert out.num_accepted_tokens > 0, method  # guesses were made and kept
    assert crossed, "a step's guesses ran past the end of the thinking"
