"""A thinking model through Anthropic's Messages API and the official anthropic client: the
thinking as a `thinking` block (streamed as thinking_delta and a signature_delta),
`thinking` turning the template's switch, `display: "omitted"`, thinking sent back in the
history; and a thinking budget (`thinking.budget_tokens`, chat's `thinking_token_budget`)
closing the thinking where it runs out.

A tiny random Qwen3 with its family's real chat template and `<think>`/`</think>` as
single tokens (tests/thinking_models.py); each answer's first tokens are forced where the
sampler draws, after every control (a forced token the budget forbids is reported)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from iterserve import LLM, SamplingParams
from server_fixtures import MODEL_NAME, RunningServer, anthropic_prompt_tokens, running_server
from thinking_models import CLOSE, OPEN, forced_tokens, ids, thinking_answer

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

HI = [{"role": "user", "content": "Hi"}]
THOUGHT = "The user greets me, so I greet back."
ANSWER = "Hello there!"
THINK = {"type": "enabled", "budget_tokens": 1024}


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> Iterator[RunningServer]:
    with running_server(qwen3_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(qwen3: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=qwen3.base_url, api_key="unused", max_retries=0)


def _chat(server: RunningServer, **request: Any) -> Any:
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    return chat.chat.completions.create(model=MODEL_NAME, messages=HI, **request)


def test_thinking_is_a_thinking_block(client: anthropic.Anthropic, qwen3: RunningServer) -> None:
    tokenizer = qwen3.engine.tokenizer
    script = thinking_answer(tokenizer, "\n" + THOUGHT + "\n", "\n\n" + ANSWER)
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": HI,
        "max_tokens": 80,
        "thinking": THINK,
    }
    with forced_tokens(qwen3.engine, script) as refused:
        message = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            events = list(stream)
            streamed = stream.get_final_message()
        chat = _chat(qwen3, max_tokens=80)
    assert not refused
    assert [block.type for block in message.content] == ["thinking", "text"]
    thinking, text = message.content
    assert thinking.thinking == THOUGHT and thinking.signature  # type: ignore[union-attr]
    assert text.text == ANSWER and message.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == THOUGHT
    assert [d.signature for d in deltas if d.type == "signature_delta"] == [thinking.signature]  # type: ignore[union-attr]
    details = message.usage.output_tokens_details
    assert details is not None
    assert details.thinking_tokens == chat.usage.completion_tokens_details.reasoning_tokens > 0


def test_thinking_turns_the_templates_switch(
    client: anthropic.Anthropic, qwen3: RunningServer
) -> None:
    off = _chat(
        qwen3, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    on = _chat(qwen3, max_tokens=1)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the empty thinking block
    for thinking, expected in (
        ({"type": "disabled"}, off),
        (THINK, on),
        ({"type": "adaptive"}, on),  # the model's own measure: Qwen3's default, on
        (None, on),
    ):
        extra = {} if thinking is None else {"thinking": thinking}
        message = client.messages.create(model=MODEL_NAME, messages=HI, max_tokens=1, **extra)  # type: ignore[arg-type]
        assert anthropic_prompt_tokens(message) == expected.usage.prompt_tokens, thinking
        counted = client.messages.count_tokens(model=MODEL_NAME, messages=HI, **extra)  # type: ignore[arg-type]
        assert counted.input_tokens == expected.usage.prompt_tokens, thinking


def test_display_omitted_sends_no_thinking_text(
    client: anthropic.Anthropic, qwen3: RunningServer
) -> None:
    script = thinking_answer(qwen3.engine.tokenizer, THOUGHT, "\n\n" + ANSWER)
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": HI,
        "max_tokens": 80,
        "thinking": {**THINK, "display": "omitted"},
    }
    with forced_tokens(qwen3.engine, script):
        message = client.messages.create(**request)
        events = list(client.messages.create(**request, stream=True))
    thinking, text = message.content
    assert thinking.thinking == "" and thinking.signature  # type: ignore[union-attr]
    assert text.text == ANSWER  # type: ignore[union-attr]
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" not in kinds and "signature_delta" in kinds


def test_thinking_sent_back_is_the_chats_reasoning_content(
    client: anthropic.Anthropic, qwen3: RunningServer
) -> None:
    """An assistant turn with its thinking block renders as chat's `reasoning_content`:
    Qwen3's template shows the thinking of the turn after the last user message (here the
    last turn, so the answer would continue it: Anthropic's prefill)."""
    turns = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": THOUGHT, "signature": "x"},
                {"type": "text", "text": ANSWER},
            ],
        },
    ]
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=turns)  # type: ignore[arg-type]
    tokenizer = qwen3.engine.tokenizer
    text = tokenizer.apply_chat_template(
        [HI[0], {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}],
        tokenize=False,
        add_generation_prompt=False,
    )
    prompt = text[: text.rindex(ANSWER) + len(ANSWER)]  # prefill: the answer goes on from it
    assert THOUGHT in prompt
    assert counted.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


# ---- the budget -------------------------------------------------------------------------


def test_budget_closes_the_thinking_where_it_runs_out(
    client: anthropic.Anthropic, qwen3: RunningServer
) -> None:
    """The model opens its thinking and would go on; after 5 tokens of it the budget
    writes `</think>` (the script's token there is refused) and the answer follows."""
    tokenizer = qwen3.engine.tokenizer
    thought = ids(tokenizer, " one two three four five six seven eight nine ten")
    script = [*ids(tokenizer, OPEN), *thought]
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": HI,
        "max_tokens": 10,
        "thinking": {"type": "enabled", "budget_tokens": 5},
    }
    with forced_tokens(qwen3.engine, script) as refused:
        message = client.messages.create(**request)
        chat = _chat(qwen3, max_tokens=10, extra_body={"thinking_token_budget": 5})
    close = ids(tokenizer, CLOSE)
    assert [(position, token) for _, position, token in refused] == [(6, thought[5])] * 2
    thinking, text = message.content
    assert thinking.thinking == tokenizer.decode(thought[:5]).strip()  # type: ignore[union-attr]
    assert text.text == tokenizer.decode(thought[6:9]).strip()  # type: ignore[union-attr]
    assert message.usage.output_tokens_details.thinking_tokens == 1 + 5 + len(close)  # type: ignore[union-attr]
    choice = chat.choices[0].message
    assert (choice.reasoning_content, choice.content) == (thinking.thinking, text.text)  # type: ignore[union-attr]
    # A budget the thinking stays within changes nothing.
    script = thinking_answer(tokenizer, THOUGHT, "\n\n" + ANSWER)
    with forced_tokens(qwen3.engine, script) as refused:
        roomy = client.messages.create(**{**request, "max_tokens": 80, "thinking": THINK})
    assert not refused and roomy.content[0].thinking == THOUGHT  # type: ignore[union-attr]


def test_offline_chat_takes_the_budget(qwen3_dir: Path) -> None:
    llm = LLM(str(qwen3_dir), dtype="float32", compile=False)
    tokenizer = llm.tokenizer
    thought = ids(tokenizer, " one two three four five six")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with forced_tokens(llm.engine, [*ids(tokenizer, OPEN), *thought]) as refused:
        out = llm.chat(HI, params, use_tqdm=False, thinking_token_budget=3)[0]
    assert [(position, token) for _, position, token in refused] == [(4, thought[3])]
    assert out.reasoning_content == tokenizer.decode(thought[:3]).strip()
    assert out.token_ids[4:5] == ids(tokenizer, CLOSE)


@pytest.mark.parametrize(
    ("thinking", "param"),
    [
        ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
        ({"type": "disabled", "budget_tokens": 5}, "thinking.budget_tokens"),
        ({"type": "sometimes"}, "thinking.type"),
    ],
)
def test_bad_thinking_names_the_field(
    client: anthropic.Anthropic, thinking: dict[str, Any], param: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_NAME, messages=HI, max_tokens=4, thinking=thinking)  # type: ignore[arg-type]
    assert caught.value.body["error"]["param"] == param  # type: ignore[index]


def test_chat_budget_is_refused_below_zero(qwen3: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(qwen3, max_tokens=4, extra_body={"thinking_token_budget": -1})
    assert caught.value.body["param"] == "thinking_token_budget"  # type: ignore[index]
