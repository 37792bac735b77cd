"""Chat rendering shared by LLM.chat and the server: roles, template errors, no extra BOS."""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve.engine.prompts import STANDARD_ROLES, RenderedChat, render_chat, template_roles
from iterserve.model.tokenizer import chat_template_of, load_hf_tokenizer
from iterserve.sampling_params import InvalidRequestError

LLAMA31_LIKE = (
    "{% for message in messages %}{% if message.role == 'ipython' %}<|python|>"
    "{% elif message['role'] in ['user', 'developer'] %}<|user|>{% endif %}"
    "{{ message['content'] }}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):  # type: ignore[no-untyped-def]
    return load_hf_tokenizer(tokenizer_dir)


def test_template_roles_are_openai_s_plus_the_ones_a_template_names() -> None:
    assert template_roles("{{ messages }}") == STANDARD_ROLES
    assert template_roles(LLAMA31_LIKE) == STANDARD_ROLES | {"ipython", "developer"}
    assert template_roles("{% if 'system' != messages[0]['role'] %}x{% endif %}") == (
        STANDARD_ROLES
    )


@pytest.mark.parametrize("role", ["", "hacker", None, "System"])
def test_roles_outside_the_template_s_set_are_refused(tokenizer, role: object) -> None:  # type: ignore[no-untyped-def]
    template = chat_template_of(tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
    with pytest.raises(InvalidRequestError, match="role") as caught:
        render_chat(tokenizer, template, messages)
    assert caught.value.param == "messages.1.role"


def test_known_roles_render_and_template_errors_are_bad_requests(tokenizer) -> None:  # type: ignore[no-untyped-def]
    template = chat_template_of(tokenizer)
    rendered = render_chat(tokenizer, template, [{"role": "tool", "content": "42"}])
    assert isinstance(rendered, RenderedChat) and "tool\n42" in rendered.text
    with pytest.raises(InvalidRequestError) as caught:  # content None: the template raises
        render_chat(tokenizer, template, [{"role": "user", "content": None}])
    assert caught.value.param == "messages"
    with pytest.raises(InvalidRequestError) as caught:  # kwargs clashing with ours
        render_chat(tokenizer, template, [{"role": "user", "content": "hi"}], True, {"tokenize": 1})
    assert caught.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="no chat template"):
        render_chat(tokenizer, None, [{"role": "user", "content": "hi"}])
