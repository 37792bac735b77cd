"""Each call format through a real server and the official openai client, on the family's
real chat template (tests/server/chat_templates/, README.md there names the sources):
`--tool-call-parser auto` picks the format from the template; two parallel calls come
back as calls, streamed and not; a malformed call comes back as the text it is; a
forced call comes back too; and the calls and their results go back into the next
prompt through the same template, which writes them in the family's syntax. The tiny
model's tokens are scripted, since a random model writes no calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from conftest import _save_tiny
from iterserve.chat import tools as tools_module
from iterserve.chat.tool_parsers import TOOL_PARSERS, ToolParser, shows_tools
from iterserve.chat.tool_parsers.streaming import parse_answer
from iterserve.chat.tool_prompt import with_tools_in_system_message
from server_fixtures import (
    MODEL_NAME,
    RunningServer,
    answer_tokens,
    reassembled,
    running_server,
    scripted_tokens,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TEMPLATES = Path(__file__).parent / "chat_templates"
QUESTION = "Weather for three days in Paris, and the time in UTC?"
# A short system message: Ministral 3's default one would not fit the tiny model's context.
ASKED = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": QUESTION},
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city for some days",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


@dataclass(frozen=True)
class Family:
    template: str  # in chat_templates/
    parser: str  # what `auto` picks for it
    answer: str  # CALLS, as the family's models write them
    content: str | None  # the answer's text besides the calls
    malformed: str  # a call that does not read: it is content
    # DeepSeek's templates join an earlier call's arguments to text, as OpenAI's JSON.
    arguments_as_text: bool = False
    # The template tests `content is none`, which transformers' rendering never lets be
    # true (it drops None values): a calls-only message gets content "" instead.
    empty_content: bool = False
    # What the family's models write first where the prompt opens their thinking (R1's
    # template ends with `<think>\n`): it goes to reasoning_content (docs/reasoning.md).
    thought: str = ""

    def written(self, answer: str) -> str:
        return f"{self.thought}\n</think>\n\n{answer}" if self.thought else answer


FAMILIES = [
    Family(
        "mistral_nemo_2407.jinja",
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"tz": "UTC"}}]',
        None,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}]',
    ),
    Family(
        "ministral_3_2512.jinja",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
        None,
        '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
        empty_content=True,
    ),
    Family(
        "lfm2_5_8b_a1b.jinja",
        "pythonic",
        "Checking.<|tool_call_start|>[get_weather(city='Paris', days=3), get_time(tz='UTC')]"
        "<|tool_call_end|>",
        "Checking.",
        "<|tool_call_start|>[get_weather(city=Paris, days=3)]<|tool_call_end|>",
    ),
    Family(
        "qwen3_coder.jinja",
        "qwen3_coder",
        "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n"
        "</tool_call>",
        "I'll check both.",
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</function>\n</tool_call>",
    ),
    Family(
        "deepseek_r1_distill_qwen_32b.jinja",
        "deepseek_v3",
        f"{BEGIN}{CALL}function{SEP}get_weather\n{FENCE}json\n"
        f'{{"city": "Paris", "days": 3}}\n{FENCE}{CALL_END}\n'
        f'{CALL}function{SEP}get_time\n{FENCE}json\n{{"tz": "UTC"}}\n{FENCE}{CALL_END}{END}',
        None,
        f'{BEGIN}{CALL}function{SEP}get_time\n{FENCE}json\n{{"tz": "UTC"}}\n{FENCE}{END}',
        arguments_as_text=True,
        empty_content=True,
        thought="The user wants the weather and the time.",
    ),
    Family(
        "deepseek_v3_1.jinja",
        "deepseek_v31",
        f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris", "days": 3}}{CALL_END}'
        f'{CALL}get_time{SEP}{{"tz": "UTC"}}{CALL_END}{END}',
        None,
        f'{BEGIN}{CALL}get_time{SEP}{{"tz": "UTC"{CALL_END}{END}',
        arguments_as_text=True,
        empty_content=True,
    ),
    Family(
        "gemma_4_31b_it.jinja",
        "gemma4",
        'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
        '<|tool_call>call:get_time{tz:<|"|>UTC<|"|>}<tool_call|>',
        "Checking.",
        "<|tool_call>call:get_time{tz:UTC}<tool_call|>",
    ),
]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.template for f in FAMILIES])
def family(request: pytest.FixtureRequest) -> Family:
    return request.param


CONTEXT = 2048  # the tools and Qwen3-Coder's or Ministral's instructions take room


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-long")
    return _save_tiny(
        "llama", out, tokenizer_dir, tie_word_embeddings=True, max_position_embeddings=CONTEXT
    )


@pytest.fixture(scope="module")
def server(family: Family, long_llama_dir: Path) -> Iterator[RunningServer]:
    """A tiny Llama served with the family's template (`--chat-template FILE`) and
    `--tool-call-parser auto`."""
    template = str(TEMPLATES / family.template)
    with running_server(long_llama_dir, chat_template=template, max_model_len=CONTEXT) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_parallel_calls_come_back_and_go_back_through_the_template(
    family: Family, client: openai.OpenAI, server: RunningServer
) -> None:
    question = ASKED
    request = dict(model=MODEL_NAME, messages=question, tools=TOOLS, max_tokens=200)
    with scripted_tokens(server, answer_tokens(server, family.written(family.answer))):
        answer = client.chat.completions.create(**request)  # type: ignore[call-overload]
        chunks = list(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
    choice = answer.choices[0]
    assert _calls(choice.message) == CALLS
    assert choice.message.content == family.content
    assert getattr(choice.message, "reasoning_content", None) == (family.thought or None)
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    if family.parser == "mistral":  # Nemo's template takes back only such ids
        assert all(len(call.id) == 9 and call.id.isalnum() for call in calls)
    written = [(c.function.name, c.function.arguments) for c in calls]
    assert reassembled(chunks) == (family.content or "", written, "tool_calls")

    # The calls and their results go back: the template writes them in its syntax.
    history = [
        *question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call.model_dump(exclude_none=True) for call in calls],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "14:05"},
    ]
    with scripted_tokens(server, answer_tokens(server, "Sunny, 18 C.")):
        final = client.chat.completions.create(
            model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=20
        )
    assert final.choices[0].message.content == "Sunny, 18 C."
    assert final.choices[0].message.tool_calls is None
    prompt = _rendered_by_transformers(server, family, history)
    assert final.usage is not None
    assert final.usage.prompt_tokens == len(
        server.engine.tokenizer.encode(prompt, add_special_tokens=False)
    )
    parser = TOOL_PARSERS[family.parser]().with_tools(SCHEMAS)
    earlier = parse_answer(parser, prompt.split(QUESTION, 1)[1], None).calls
    assert [(call.name, json.loads(call.arguments)) for call in earlier] == CALLS


def _rendered_by_transformers(
    server: RunningServer, family: Family, history: list[dict[str, Any]]
) -> str:
    """`history` through the template by transformers itself, the arguments in the form
    the template reads (objects, or DeepSeek's text), and the tools where the server puts
    them (the template's `tools`, or the system message for a template with no place)."""
    messages = json.loads(json.dumps(history))
    for message in messages:
        for call in message.get("tool_calls") or []:
            if not family.arguments_as_text:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if family.empty_content and message.get("tool_calls") and message["content"] is None:
            message["content"] = ""
    template = (TEMPLATES / family.template).read_text()
    tools: list[dict[str, Any]] | None = TOOLS
    if not shows_tools(template):
        parser: ToolParser = TOOL_PARSERS[family.parser]()
        messages = with_tools_in_system_message(messages, TOOLS, parser)
        tools = None
    return server.engine.tokenizer.apply_chat_template(
        messages, chat_template=template, tools=tools, add_generation_prompt=True, tokenize=False
    )


def test_a_malformed_call_is_content(
    family: Family, client: openai.OpenAI, server: RunningServer
) -> None:
    request = dict(model=MODEL_NAME, messages=ASKED, tools=TOOLS, max_tokens=100)
    with scripted_tokens(server, answer_tokens(server, family.written(family.malformed))):
        answer = client.chat.completions.create(**request)  # type: ignore[call-overload]
        chunks = list(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == family.malformed
    assert reassembled(chunks) == (family.malformed, [], "stop")


def test_a_forced_call_comes_back_and_goes_back(
    family: Family, client: openai.OpenAI, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A forced call is JSON whatever the family (decoding is constrained to its schema;
    # tests/server/test_tool_calls.py runs the constraint): after the hook, the scripted
    # "model" writes what the schema allows. Its ids must suit the family's template.
    monkeypatch.setattr(tools_module, "enforce_schema", lambda params, schema: None)
    question = ASKED
    forced = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'
    with scripted_tokens(server, answer_tokens(server, family.written(forced))):
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=question, tools=TOOLS, tool_choice="required", max_tokens=100
        )
    message = answer.choices[0].message
    assert _calls(message) == CALLS[:1] and message.content is None
    call = (message.tool_calls or [])[0]
    history = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    with scripted_tokens(server, answer_tokens(server, "Sunny.")):
        final = client.chat.completions.create(
            model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=10
        )
    assert final.choices[0].message.content == "Sunny."
