"""Chat rendering shared by LLM.chat and the server: roles, template errors, no extra BOS."""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve.engine.prompts import (
    STANDARD_ROLES,
    RenderedChat,
    continuing,
    encode_prompt,
    render_chat,
    takes_system_anywhere,
    template_roles,
)
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


def test_a_continued_chat_keeps_the_tokens_an_earlier_turn_ran(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The answer as the model wrote it, one token a character, is not how the tokenizer
    splits its text: the continued prompt keeps the written tokens, and only when they
    decode to exactly the rendering's start."""
    template = chat_template_of(tokenizer)
    question = [{"role": "user", "content": "Say hello."}]
    first = render_chat(tokenizer, template, question)
    answer = "hello world"
    written = [tokenizer.encode(ch, add_special_tokens=False)[0] for ch in answer]
    assert written != tokenizer.encode(answer, add_special_tokens=False)
    ran = [*encode_prompt(tokenizer, first), *written, tokenizer.eos_token_id]
    conversation = [*question, {"role": "assistant", "content": answer}]
    second = render_chat(
        tokenizer, template, [*conversation, {"role": "user", "content": "Again."}]
    )

    continued = continuing(second, [ran], tokenizer)
    ids = encode_prompt(tokenizer, continued)
    assert ids[: len(ran)] == ran and ids != encode_prompt(tokenizer, second)
    assert tokenizer.decode(ids, skip_special_tokens=False) == second.text

    # Text that is not the rendering's start, ids this vocabulary lacks: encoded anew.
    other = [*encode_prompt(tokenizer, first), *written[:-1], tokenizer.eos_token_id]
    assert continuing(second, [other], tokenizer) == second
    assert continuing(second, [[*ran[:-1], len(tokenizer)]], tokenizer) == second
    # The first candidate that fits is kept, longest first.
    prompt_only = encode_prompt(tokenizer, first)
    assert continuing(second, [other, prompt_only], tokenizer).known.token_ids == tuple(  # type: ignore[union-attr]
        prompt_only
    )


def test_continue_final_message_ends_the_prompt_at_the_assistant_s_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    template = chat_template_of(tokenizer)
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blu"}]
    closed = render_chat(tokenizer, template, turns, False).text
    continued = render_chat(tokenizer, template, turns, False, continue_final_message=True).text
    assert closed.startswith(continued) and continued.endswith("assistant\nBlu")
    assert len(closed) > len(continued)  # the turn's end is the model's to write
    # A template that trims the text keeps it without its trailing whitespace.
    trimmed = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}"
    spaced = [turns[0], {"role": "assistant", "content": "Blu  "}]
    assert render_chat(tokenizer, trimmed, spaced, False, continue_final_message=True).text == (
        "<user>Name a colour.</s><assistant>Blu"
    )
    for bad, args in (
        (turns[:1], (False,)),  # the last message is not an assistant's
        ([turns[0], {"role": "assistant", "content": ""}], (False,)),
        (turns, (True,)),  # and a generation prompt: two ends at once
    ):
        with pytest.raises(InvalidRequestError) as caught:
            render_chat(tokenizer, template, bad, *args, continue_final_message=True)
        assert caught.value.param in ("messages", "continue_final_message")
    # The text not written as it was sent cannot be continued.
    upper = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    with pytest.raises(InvalidRequestError, match="continue") as caught:
        render_chat(tokenizer, upper, turns, False, continue_final_message=True)
    assert caught.value.param == "messages"


def test_takes_system_anywhere_tells_templates_that_write_a_late_system_message(tokenizer) -> None:  # type: ignore[no-untyped-def]
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    refuses = (
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('System role only at the start') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    drops = "{% for m in messages %}{% if m['role'] != 'system' or loop.first %}{{ m['content'] }}{% endif %}{% endfor %}"
    assert takes_system_anywhere(tokenizer, chatml)
    assert not takes_system_anywhere(tokenizer, refuses)
    assert not takes_system_anywhere(tokenizer, drops)
    assert not takes_system_anywhere(tokenizer, None)
