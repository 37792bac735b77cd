"""Earlier calls in the shape a template reads (engine/template_inputs.py): DeepSeek's
templates join arguments as text and test content for none; the others take HF's shape
unchanged. Checked on the committed real templates and through render_chat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iterserve.engine.prompts import render_chat
from iterserve.engine.template_inputs import (
    checks_content_for_none,
    fitted_to_template,
    joins_arguments_as_text,
)
from iterserve.model.tokenizer import load_hf_tokenizer

TEMPLATES = Path(__file__).parent.parent / "server" / "chat_templates"
# template: (joins arguments as text, tests content for none)
EXPECTED = {
    "qwen2_5_tools.jinja": (False, False),
    "qwen3_coder.jinja": (False, False),
    "mistral_nemo_2407.jinja": (False, False),
    "ministral_3_2512.jinja": (False, True),
    "lfm2_5_8b_a1b.jinja": (False, False),
    "deepseek_r1_distill_qwen_32b.jinja": (True, True),
    "deepseek_v3_1.jinja": (True, True),
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": "é"}}}
HISTORY = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
]


@pytest.mark.parametrize(("template", "expected"), EXPECTED.items())
def test_the_templates_say_what_shape_they_read(template: str, expected: tuple[bool, bool]) -> None:
    text = (TEMPLATES / template).read_text()
    assert (joins_arguments_as_text(text), checks_content_for_none(text)) == expected


def test_only_a_template_that_needs_it_gets_another_shape() -> None:
    plain = "{% for m in messages %}{{ m.tool_calls[0].function.arguments | tojson }}{% endfor %}"
    assert fitted_to_template(plain, HISTORY) == HISTORY
    joining = "{{ '<' + tool['function']['arguments'] + '>' }}{{ m['content'] is none }}"
    fitted = fitted_to_template(joining, HISTORY)
    assert fitted[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**CALL, "function": {"name": "f", "arguments": '{"x": "é"}'}}],
    }
    assert fitted[0] is HISTORY[0] and fitted[2] is HISTORY[2]
    assert HISTORY[1]["content"] is None  # the caller's messages are left as they were


@pytest.mark.parametrize("template", ["deepseek_r1_distill_qwen_32b.jinja", "deepseek_v3_1.jinja"])
def test_deepseek_templates_render_earlier_calls(tokenizer_dir: Path, template: str) -> None:
    # Without the fitting, both raise (a mapping joined to text; a missing content).
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    text = render_chat(tokenizer, (TEMPLATES / template).read_text(), HISTORY).text
    assert json.dumps(CALL["function"]["arguments"], ensure_ascii=False) in text
    assert "<｜tool▁output▁begin｜>ok<｜tool▁output▁end｜>" in text
