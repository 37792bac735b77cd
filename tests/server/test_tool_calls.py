"""Tool calls on /v1/chat/completions: the parsers on model-like answers, streamed calls
against the whole answer's, the request checks, and a tool loop through the official
openai client against a real server (a tiny Llama with Qwen 2.5's template; the answer's
tokens are scripted, since a random model writes no calls)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from iterserve import LLM
from iterserve.chat import tools as tools_module
from iterserve.chat.tool_parsers import (
    ParsedCall,
    ToolParser,
    select_tool_parser,
    shows_tool_calls,
    shows_tools,
)
from iterserve.chat.tool_parsers.forced import forced_call_schema, parse_forced_answer
from iterserve.chat.tool_parsers.hermes import HermesToolParser
from iterserve.chat.tool_parsers.llama3_json import Llama3JsonToolParser
from iterserve.chat.tool_parsers.streaming import ToolCallStream, parse_answer
from iterserve.chat.tool_prompt import with_calls_as_text, with_tools_in_system_message
from iterserve.chat.tool_protocol import NamedToolChoice, ToolDefinition
from iterserve.chat.tools import plan_tools
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from server_fixtures import (
    MODEL_NAME,
    QWEN_TOOLS_TEMPLATE,
    RunningServer,
    answer_tokens,
    reassembled,
    running_server,
    scripted_tokens,
    with_chat_template,
)

pytestmark = pytest.mark.timeout(180)

QWEN_TEMPLATE = QWEN_TOOLS_TEMPLATE
LLAMA3_TEMPLATE_LINE = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument '
    "name and its value}. Do not use variables.\n\n{{ tools | tojson }}"
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]

# ---- parsers, on answers as models write them ------------------------------------------

PARIS = {"city": "Paris", "unit": "celsius"}
QWEN_ONE_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
QWEN_TWO_CALLS = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
    "</tool_call>"
)
# (parser, answer, expected content, expected calls as (name, arguments))
ANSWERS: list[tuple[ToolParser, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (HermesToolParser(), QWEN_ONE_CALL, None, [("get_weather", PARIS)]),
    (
        HermesToolParser(),
        QWEN_TWO_CALLS,
        "I'll check both.",
        [("get_weather", PARIS), ("get_time", {"tz": "Europe/Paris"})],
    ),
    # Hermes 2 Pro writes the arguments first; some models stop without the closing tag.
    (
        HermesToolParser(),
        '<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}\n',
        None,
        [("get_time", {"tz": "UTC"})],
    ),
    (HermesToolParser(), "It is 3 < 4 and <tool_ is not a tag.", None, []),
    # Malformed JSON in the block: the model's text stays, as content.
    (
        HermesToolParser(),
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        None,
        [],
    ),
    (
        Llama3JsonToolParser(),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"tz": "UTC"}}',
        None,
        [("get_weather", PARIS), ("get_time", {"tz": "UTC"})],
    ),
    (
        Llama3JsonToolParser(),
        '{"name": "get_time", "parameters": {}}',
        None,
        [("get_time", {})],
    ),
    (Llama3JsonToolParser(), "The weather in Paris is mild.", None, []),
    (Llama3JsonToolParser(), '{"name": "get_time", "parameters": {"tz": "UTC"}', None, []),
    (Llama3JsonToolParser(), '{"answer": 42}', None, []),
]


def _expected_content(answer: str, content: str | None, calls: list[Any]) -> str | None:
    # No calls: the answer is content, untouched (malformed calls included).
    return content if calls else answer


@pytest.mark.parametrize(("parser", "answer", "content", "calls"), ANSWERS)
def test_parsers_read_model_answers(
    parser: ToolParser, answer: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    parsed = parse_answer(parser, answer, max_calls=None)
    assert parsed.content == _expected_content(answer, content, calls)
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == calls


@pytest.mark.parametrize(("parser", "answer", "content", "calls"), ANSWERS)
def test_streamed_calls_reassemble_to_the_whole_answers(
    parser: ToolParser, answer: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    whole = parse_answer(parser, answer, max_calls=None)
    rng = random.Random(len(answer))
    for _ in range(5):
        stream, streamed_content, streamed_calls = ToolCallStream(parser, None), "", []
        pos = 0
        while pos < len(answer):
            step = rng.randint(1, 6)  # token-sized pieces, cut anywhere
            piece, pos = answer[pos : pos + step], pos + step
            delta = stream.feed(piece, final=pos >= len(answer))
            streamed_content += delta.content
            streamed_calls += [call for _, _, call in delta.new_calls]
            # What is sent is never a marker's beginning that later became a call.
            if whole.calls:
                assert "<tool_call>" not in streamed_content
        assert (streamed_content or None) == (whole.content or None)
        assert streamed_calls == whole.calls


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    parsed = parse_answer(HermesToolParser(), QWEN_TWO_CALLS, max_calls=1)
    assert [call.name for call in parsed.calls] == ["get_weather"]


def test_auto_picks_the_parser_by_template() -> None:
    assert isinstance(select_tool_parser("auto", QWEN_TEMPLATE), HermesToolParser)
    assert isinstance(select_tool_parser("auto", LLAMA3_TEMPLATE_LINE), Llama3JsonToolParser)
    # No place for tools: the system message will teach Hermes' format (tool_prompt.py).
    assert isinstance(select_tool_parser("auto", "{{ messages }}"), HermesToolParser)
    assert select_tool_parser("auto", "{{ tools }}{{ messages }}") is None  # unknown format
    assert select_tool_parser("none", QWEN_TEMPLATE) is None
    assert isinstance(select_tool_parser("llama3_json", QWEN_TEMPLATE), Llama3JsonToolParser)


# ---- what a request may ask ------------------------------------------------------------


def _plan(tool_choice: Any, template: str = QWEN_TEMPLATE, tools: Any = TOOLS) -> Any:
    definitions = [ToolDefinition.model_validate(tool) for tool in tools] if tools else None
    return plan_tools(
        definitions, tool_choice, True, template, HermesToolParser(), SamplingParams(), set()
    )


@pytest.mark.parametrize(
    ("tool_choice", "template", "tools", "param"),
    [
        ("auto", QWEN_TEMPLATE, None, "tool_choice"),  # nothing to choose from
        ({"type": "function", "function": {"name": "nope"}}, QWEN_TEMPLATE, TOOLS, "tool_choice"),
        ("auto", QWEN_TEMPLATE, TOOLS + TOOLS[:1], "tools.2.function.name"),  # a twin name
    ],
)
def test_requests_the_server_cannot_honour_are_400s_naming_the_field(
    tool_choice: Any, template: str, tools: Any, param: str
) -> None:
    if isinstance(tool_choice, dict):
        tool_choice = NamedToolChoice.model_validate(tool_choice)
    with pytest.raises(InvalidRequestError) as error:
        _plan(tool_choice, template, tools)
    assert error.value.param == param


def test_tool_choice_none_keeps_tools_in_the_template_and_parses_nothing() -> None:
    plan = _plan("none")
    assert plan.reader is None and [t["function"]["name"] for t in plan.template_tools] == [
        "get_weather",
        "get_time",
    ]


def test_special_token_markers_are_kept_in_the_text() -> None:
    # Where the tokenizer makes `<tool_call>` a special token (Hermes 2 Pro), skipping
    # special tokens would erase the marker the parser looks for.
    definitions = [ToolDefinition.model_validate(tool) for tool in TOOLS]
    for special, kept in ((set(), False), ({"<tool_call>", "</tool_call>"}, True)):
        params = SamplingParams()
        plan_tools(definitions, "auto", True, QWEN_TEMPLATE, HermesToolParser(), params, special)
        assert params.skip_special_tokens is not kept


def test_auto_without_a_parser_is_a_400_naming_tool_choice() -> None:
    definitions = [ToolDefinition.model_validate(tool) for tool in TOOLS]
    with pytest.raises(InvalidRequestError) as error:
        plan_tools(definitions, "auto", True, QWEN_TEMPLATE, None, SamplingParams(), set())
    assert error.value.param == "tool_choice"


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer_dir: Path) -> None:
    # The bundled SmolLM2's template knows neither tools nor calls: the tools and the
    # format go into the system message, and an earlier call is written in that format,
    # which the parser reads back as the same call.
    from iterserve.engine.prompts import render_chat
    from iterserve.model.tokenizer import chat_template_of, load_hf_tokenizer

    tokenizer = load_hf_tokenizer(tokenizer_dir)
    template = chat_template_of(tokenizer)
    assert template and not shows_tools(template) and not shows_tool_calls(template)
    plan = _plan("auto", template)
    assert plan.tools_in_system_message and isinstance(plan.reader, HermesToolParser)
    call = {"name": "get_weather", "arguments": PARIS}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": call}]},
        {"role": "tool", "tool_call_id": "c", "content": "18 C"},
    ]
    messages = with_tools_in_system_message(
        with_calls_as_text(history, plan.call_format), plan.template_tools, plan.call_format
    )
    text = render_chat(tokenizer, template, messages).text
    assert text.startswith("<|im_start|>system\nYou can call these functions")
    assert json.dumps(TOOLS[0]) in text and "<|im_start|>tool\n18 C<|im_end|>" in text
    written = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_answer(plan.reader, written, None).calls == [
        ParsedCall("get_weather", json.dumps(PARIS))
    ]


def test_forced_call_schema_accepts_exactly_the_calls_it_reads_back() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    tools = [ToolDefinition.model_validate(tool) for tool in TOOLS]
    schema = forced_call_schema(tools, "required", None)
    answer = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    jsonschema.validate(json.loads(answer), schema)
    assert parse_forced_answer(answer, "required") == [
        ParsedCall("get_weather", '{"city": "Paris"}')
    ]
    for wrong in (
        "[]",
        '[{"name": "get_weather", "parameters": {"unit": "celsius"}}]',  # city is required
        '[{"name": "launch", "parameters": {}}]',
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(wrong), schema)
    named = NamedToolChoice.model_validate({"function": {"name": "get_time"}})
    assert forced_call_schema(tools, named, None) == {
        **TOOLS[1]["function"]["parameters"],
        "additionalProperties": False,
    }
    assert parse_forced_answer('{"tz": "UTC"}', named) == [ParsedCall("get_time", '{"tz": "UTC"}')]


def test_forced_call_arguments_take_only_the_declared_keys() -> None:
    """An object that lists its properties and says nothing of others is closed, at every
    depth (LangChain's @tool schemas leave it unsaid: a small model then wrote keys until
    max_tokens cut the call into text); a free-form object and an explicit choice stay."""
    jsonschema = pytest.importorskip("jsonschema")
    parameters = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"anyOf": [{"type": "object", "properties": {"lat": {"type": "number"}}}]},
            "stops": {"type": "array", "items": {"$ref": "#/$defs/stop"}},
            "tags": {"type": "object"},  # a free-form mapping
            "extra": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"stop": {"type": "object", "properties": {"name": {"type": "string"}}}},
    }
    tool = ToolDefinition.model_validate(
        {"type": "function", "function": {"name": "trip", "parameters": parameters}}
    )
    named = NamedToolChoice.model_validate({"function": {"name": "trip"}})
    schema = forced_call_schema([tool], named, None)
    fine = {"city": "Paris", "where": {"lat": 1.5}, "stops": [{"name": "a"}], "tags": {"x": 1}}
    jsonschema.validate({**fine, "extra": {"anything": 1}}, schema)
    for wrong in (
        {**fine, "weather": "sunny"},
        {**fine, "where": {"lat": 1.5, "lon": 2}},
        {**fine, "stops": [{"name": "a", "at": 3}]},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert "additionalProperties" not in parameters  # the tool's own schema is left as sent
    # Under `required`, each tool's definitions move to the root (a reference from a tool
    # nested in the list would not reach its own), renamed apart, and stay closed.
    other = ToolDefinition.model_validate(
        {"type": "function", "function": {"name": "wait", "parameters": {**parameters}}}
    )
    required = forced_call_schema([tool, other], "required", None)
    assert set(required["$defs"]) == {"tool0.stop", "tool1.stop"}
    calls = [{"name": "trip", "parameters": fine}, {"name": "wait", "parameters": fine}]
    jsonschema.validate(calls, required)
    for wrong in ({**fine, "weather": 1}, {**fine, "stops": [{"name": "a", "at": 3}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "trip", "parameters": wrong}], required)


# ---- through a real server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_template_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with Qwen 2.5's tool-calling chat template."""
    out = tmp_path_factory.mktemp("tiny-llama-tools") / "model"
    return with_chat_template(tiny_llama_dir, out, QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def server(qwen_template_dir: Path) -> Iterator[RunningServer]:
    with running_server(qwen_template_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_tool_loop_through_the_openai_client(client: openai.OpenAI, server: RunningServer) -> None:
    question = [{"role": "user", "content": "Weather and time in Paris?"}]
    with scripted_tokens(server, answer_tokens(server, QWEN_TWO_CALLS)):
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=question, tools=TOOLS, max_tokens=200
        )
        chunks = list(  # two choices: each is parsed on its own
            client.chat.completions.create(
                model=MODEL_NAME, messages=question, tools=TOOLS, max_tokens=200, stream=True, n=2
            )
        )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I'll check both."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", PARIS),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)

    # Streamed: content first, then per call its id and name, then its arguments.
    for index in (0, 1):
        assert reassembled(chunks, index) == (
            choice.message.content,
            [(c.function.name, c.function.arguments) for c in calls],
            "tool_calls",
        )

    # The results go back: the assistant's calls (content null) and a tool message each.
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
    with scripted_tokens(server, answer_tokens(server, "Sunny, 18 C; it is 14:05.")):
        final = client.chat.completions.create(
            model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=50
        )
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "Sunny, 18 C; it is 14:05."
    # No calls: no `tool_calls` at all, as OpenAI answers (the SDK reads None; `[]`
    # would read as a call list to loop over).
    assert final.choices[0].message.tool_calls is None
    with scripted_tokens(server, answer_tokens(server, "Sunny.")):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=50
        )
    assert "tool_calls" not in raw.http_response.json()["choices"][0]["message"]
    # The template saw the calls with their arguments as objects (as HF templates want
    # them) and the tool results: the prompt is transformers' own rendering of that.
    template_history = json.loads(json.dumps(history))
    for call in template_history[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = server.engine.tokenizer.apply_chat_template(
        template_history, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in expected
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in expected
    assert final.usage is not None
    assert final.usage.prompt_tokens == len(
        server.engine.tokenizer.encode(expected, add_special_tokens=False)
    )
    # Agents often send the SDK's message object back as it came (nulls and all).
    with scripted_tokens(server, answer_tokens(server, "Sunny.")):
        again = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[*question, choice.message, *history[2:]],  # type: ignore[list-item]
            tools=TOOLS,
            max_tokens=50,
        )
    assert again.choices[0].message.content == "Sunny."


def test_bad_tool_requests_are_400s(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Hi"}]
    bad_history = [
        *question,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}
            ],
        },
    ]
    for extra, param in (
        ({"messages": question, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": question, "tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
        ({"messages": question, "tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"messages": bad_history}, "messages.1.tool_calls.0.function.arguments"),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL_NAME, **extra)  # type: ignore[call-overload]
        assert error.value.body["param"] == param  # type: ignore[index]


def test_forced_calls_are_read_back_once_decoding_is_constrained(
    client: openai.OpenAI, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Everything after the hook: the hook passes and the "model" writes what the schema
    # allows (scripted); the answer must come back as calls, streamed or not.
    monkeypatch.setattr(tools_module, "enforce_schema", lambda params, schema: None)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for tool_choice, answer, expected in (
        (
            "required",
            '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
            [("get_weather", PARIS)],
        ),
        (named, '{"tz": "UTC"}', [("get_time", {"tz": "UTC"})]),
    ):
        request = dict(model=MODEL_NAME, messages=question, tools=TOOLS, tool_choice=tool_choice)
        with scripted_tokens(server, answer_tokens(server, answer)):
            whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
            chunks = list(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
        message = whole.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert [(name, json.loads(args)) for name, args in calls] == expected
        assert message.content is None and whole.choices[0].finish_reason == "tool_calls"
        assert reassembled(chunks) == ("", calls, "tool_calls")


def _closed_tools() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """TOOLS with closed schemas, as OpenAI's strict mode has them, and bounded strings:
    a random tiny model would never end an open-ended object or string before max_tokens.
    Also each tool's schema by name."""
    tools = json.loads(json.dumps(TOOLS))
    for tool in tools:
        parameters = tool["function"]["parameters"]
        parameters["additionalProperties"] = False
        for spec in parameters["properties"].values():
            if "enum" not in spec:
                spec["maxLength"] = 12
    return tools, {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}


def test_forced_tool_choice_gives_arguments_valid_for_the_tool(client: openai.OpenAI) -> None:
    # A random tiny model, so only constrained decoding can make these calls. The schemas
    # are closed, as OpenAI's strict mode has them, and strings bounded: such a model
    # would never end an open-ended object or string before max_tokens.
    jsonschema = pytest.importorskip("jsonschema")
    tools, schemas = _closed_tools()
    question = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        request = dict(
            model=MODEL_NAME,
            messages=question,
            tools=tools,
            tool_choice=tool_choice,
            max_tokens=200,
            temperature=0.0,
            extra_body={"return_token_ids": True},
        )
        answer = client.chat.completions.create(**request)  # type: ignore[call-overload]
        calls = [
            (c.function.name, c.function.arguments)
            for c in answer.choices[0].message.tool_calls or []
        ]
        assert calls and answer.choices[0].finish_reason == "tool_calls"
        if tool_choice == named:
            assert [name for name, _ in calls] == ["get_weather"]
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
        chunks = list(client.chat.completions.create(**request, stream=True))  # type: ignore[call-overload]
        assert reassembled(chunks) == ("", calls, "tool_calls")
        # vLLM's return_token_ids through the call reader: the chunks' ids add up to the
        # answer's, however the reader split its text into deltas.
        streamed = [t for c in chunks if c.choices for t in c.choices[0].token_ids or []]
        assert streamed == answer.choices[0].token_ids  # type: ignore[attr-defined]


# ---- offline: LLM.chat with tools -------------------------------------------------------


@pytest.fixture(scope="module")
def tools_llm(qwen_template_dir: Path) -> LLM:
    return LLM(str(qwen_template_dir), dtype="float32", compile=False)


def test_offline_chat_reads_calls_and_takes_them_back(tools_llm: LLM) -> None:
    """The server's parser and rendering offline: the calls come back in OpenAI's shape,
    and an assistant message carrying them, with the tool results, continues the chat
    as transformers renders that conversation."""
    model = SimpleNamespace(engine=tools_llm.engine)  # what scripted_tokens drives
    question = [{"role": "user", "content": "Weather and time in Paris?"}]
    params = SamplingParams(max_tokens=100)
    with scripted_tokens(model, answer_tokens(model, QWEN_TWO_CALLS)):  # type: ignore[arg-type]
        out = tools_llm.chat(question, params, use_tqdm=False, tools=TOOLS)[0]
    calls = out.tool_calls or []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", PARIS),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert out.content == "I'll check both." and QWEN_TWO_CALLS.startswith(out.text[:16])
    history = [
        *question,
        {"role": "assistant", "content": out.content, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "14:05"},
    ]
    with scripted_tokens(model, answer_tokens(model, "Sunny.")):  # type: ignore[arg-type]
        final = tools_llm.chat(history, params, use_tqdm=False, tools=TOOLS)[0]
    assert final.tool_calls == [] and final.content == final.text == "Sunny."
    template_history = json.loads(json.dumps(history))
    for call in template_history[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = tools_llm.tokenizer.apply_chat_template(
        template_history, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert final.prompt_token_ids == tools_llm.tokenizer.encode(expected, add_special_tokens=False)


def test_offline_forced_call_is_valid_for_its_tool(tools_llm: LLM) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    tools, schemas = _closed_tools()
    question = [{"role": "user", "content": "Weather in Paris?"}]
    params = SamplingParams(max_tokens=120, temperature=0.0)
    out = tools_llm.chat(question, params, use_tqdm=False, tools=tools, tool_choice="required")[0]
    assert out.tool_calls and out.content is None
    for call in out.tool_calls:
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]]
        )
    for extra, param in (
        ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tool_choice": "auto"}, "tool_choice"),
    ):
        with pytest.raises(InvalidRequestError) as error:
            tools_llm.chat(question, params, use_tqdm=False, **extra)  # type: ignore[arg-type]
        assert error.value.param == param
