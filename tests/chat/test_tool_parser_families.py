"""The call formats beyond Hermes and Llama 3 JSON (chat/tool_parsers/): Mistral's two
forms, pythonic lists (bare and inside LFM2's markers), Qwen3-Coder's XML with values
typed by the tool's schema, DeepSeek V3's and V3.1's blocks, Granite's and Phi-4-mini's
JSON lists after a marker. Each on answers written as
the family's models write them, parallel calls included, and on malformed ones, which
stay content; streamed in random pieces, each gives the whole answer's calls and content.
The families' real chat templates pick their parser under `auto`, one each."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from iterserve.chat.tool_parsers import TOOL_PARSERS, ToolParser, select_tool_parser
from iterserve.chat.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from iterserve.chat.tool_parsers.gemma4 import Gemma4ToolParser
from iterserve.chat.tool_parsers.json_list import GraniteToolParser, Phi4MiniJsonToolParser
from iterserve.chat.tool_parsers.mistral import MistralToolParser
from iterserve.chat.tool_parsers.python_literals import NotALiteral, literal_text, parse_literal
from iterserve.chat.tool_parsers.pythonic import PythonicToolParser
from iterserve.chat.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from iterserve.chat.tool_parsers.schema_values import typed_value
from iterserve.chat.tool_parsers.streaming import ToolCallStream, parse_answer

TEMPLATES = Path(__file__).parent.parent / "server" / "chat_templates"
# Each committed template, and the parser `auto` must pick for it.
TEMPLATE_PARSERS = {
    "qwen2_5_tools.jinja": "hermes",
    "mistral_nemo_2407.jinja": "mistral",
    "ministral_3_2512.jinja": "mistral",
    "lfm2_5_8b_a1b.jinja": "pythonic",
    "qwen3_coder.jinja": "qwen3_coder",
    "deepseek_r1_distill_qwen_32b.jinja": "deepseek_v3",
    "deepseek_v3_1.jinja": "deepseek_v31",
    "granite_3_3_2b_instruct.jinja": "granite",
    "gemma_4_31b_it.jinja": "gemma4",
}

PARIS = {"city": "Paris", "unit": "celsius"}
UTC = {"tz": "UTC"}
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"
QWEN3_CODER = Qwen3CoderToolParser().with_tools(
    {
        "get_weather": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string"},
                "days": {"type": "integer"},
            },
        },
        "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}},
    }
)

# (parser, answer, content, calls as (name, arguments)); no calls: the answer is content.
ANSWERS: list[tuple[ToolParser, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    # Mistral, older form: one JSON list after the marker.
    (
        MistralToolParser(),
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
        None,
        [("get_weather", PARIS), ("get_time", UTC)],
    ),
    # Newer form: a marker per call; v11's call id between the name and the arguments.
    (
        MistralToolParser(),
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "UTC"}',
        "Checking.",
        [("get_weather", PARIS), ("get_time", UTC)],
    ),
    (
        MistralToolParser(),
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
        None,
        [],
    ),
    (
        MistralToolParser(),
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}]',
        None,
        [],
    ),
    (MistralToolParser(), '[TOOL_CALLS] get_time(tz="UTC")', None, []),
    (MistralToolParser(), "Lists look like [1, 2] and [TOOL_ are not calls.", None, []),
    # Pythonic: the answer is the list, or it sits in LFM2's markers after some text.
    (
        PythonicToolParser(),
        "[get_weather(city='Paris', unit=\"celsius\"), get_time(tz='UTC')]",
        None,
        [("get_weather", PARIS), ("get_time", UTC)],
    ),
    (
        PythonicToolParser(),
        "Let me look.<|tool_call_start|>[get_weather(city='Paris', unit='celsius', days=-2,"
        " hours=[1.5, None], flags={'raw': True})]<|tool_call_end|>",
        "Let me look.",
        [("get_weather", {**PARIS, "days": -2, "hours": [1.5, None], "flags": {"raw": True}})],
    ),
    (
        PythonicToolParser(),
        "[get_time(tz='UTC')]\n[get_time(tz='Europe/Paris')]",
        None,
        [("get_time", UTC), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (PythonicToolParser(), "[get_weather(city=paris)]", None, []),  # a name, not a literal
    (PythonicToolParser(), "[get_weather(city=__import__('os').getcwd())]", None, []),
    (PythonicToolParser(), "[get_weather('Paris')]", None, []),  # positional
    (PythonicToolParser(), "[get_weather(city='Paris')", None, []),  # never closed
    (PythonicToolParser(), "[get_weather(city='Par", None, []),
    (PythonicToolParser(), "[1, 2] are the options.", None, []),
    (PythonicToolParser(), "<|tool_call_start|>[get_time(tz=UTC)]<|tool_call_end|>", None, []),
    # Qwen3-Coder: values typed by the request's schemas.
    (
        QWEN3_CODER,
        "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>",
        "I'll check both.",
        [("get_weather", {**PARIS, "days": 3}), ("get_time", UTC)],
    ),
    # A stop string may take the closing tag: the whole function is still a call.
    (
        QWEN3_CODER,
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n",
        None,
        [("get_time", UTC)],
    ),
    (
        QWEN3_CODER,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        [],
    ),
    (
        QWEN3_CODER,
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</tool_call>",
        None,
        [],
    ),
    (QWEN3_CODER, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None, []),
    # DeepSeek V3 / R1: the type, the name, the arguments in a JSON fence.
    (
        DeepSeekV3ToolParser(),
        f"{BEGIN}{CALL}function{SEP}get_weather\n{FENCE}json\n"
        f'{{"city": "Paris", "unit": "celsius"}}\n{FENCE}{CALL_END}\n'
        f'{CALL}function{SEP}get_time\n{FENCE}json\n{{"tz": "UTC"}}\n{FENCE}{CALL_END}{END}',
        None,
        [("get_weather", PARIS), ("get_time", UTC)],
    ),
    # V3.1: the name, then the arguments.
    (
        DeepSeekV31ToolParser(),
        f'Sure.{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris", "unit": "celsius"}}{CALL_END}'
        f'{CALL}get_time{SEP}{{"tz": "UTC"}}{CALL_END}{END}',
        "Sure.",
        [("get_weather", PARIS), ("get_time", UTC)],
    ),
    (
        DeepSeekV31ToolParser(),
        f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris"}}{CALL}get_time{SEP}{{}}{CALL_END}{END}',
        None,
        [],
    ),
    (DeepSeekV31ToolParser(), f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Par', None, []),
    (DeepSeekV3ToolParser(), f"{BEGIN}{CALL}get_time(){CALL_END}{END}", None, []),
    # Granite 3.x: a JSON list after <|tool_call|>, as its template asks; text before it is
    # content.
    (
        GraniteToolParser(),
        'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
        "Let me check.",
        [("get_weather", PARIS), ("get_time", UTC)],
    ),
    (GraniteToolParser(), '<|tool_call|>[{"name": "get_weather", "arguments": "{\'city', None, []),
    (GraniteToolParser(), "<|tool_call|> I would call a tool here.", None, []),
    # Phi-4-mini: functools[...], "parameters" or "arguments".
    (
        Phi4MiniJsonToolParser(),
        'functools[{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
        None,
        [("get_weather", PARIS), ("get_time", UTC)],
    ),
    (Phi4MiniJsonToolParser(), "The functools module has lru_cache.", None, []),
    # Gemma 4: a block a call, its arguments in Gemma's notation (strings between <|"|>).
    (
        Gemma4ToolParser(),
        'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}'
        '<tool_call|><|tool_call>call:get_time{tz:<|"|>UTC<|"|>}<tool_call|>',
        "Checking.",
        [("get_weather", PARIS), ("get_time", UTC)],
    ),
    (
        Gemma4ToolParser(),
        '<|tool_call>call:get_weather{city:<|"|>a "quoted", {braced} name<|"|>, days: -2,'
        ' hours:[1.5,null], flags:{raw:true,<|"|>odd key<|"|>:false}}<tool_call|>',
        None,
        [
            (
                "get_weather",
                {
                    "city": 'a "quoted", {braced} name',
                    "days": -2,
                    "hours": [1.5, None],
                    "flags": {"raw": True, "odd key": False},
                },
            )
        ],
    ),
    # The closing marker taken by a stop: a whole call still; a cut one is content.
    (Gemma4ToolParser(), '<|tool_call>call:get_time{tz:<|"|>UTC<|"|>}', None, [("get_time", UTC)]),
    (Gemma4ToolParser(), '<|tool_call>call:get_time{tz:<|"|>UT', None, []),
    (Gemma4ToolParser(), "<|tool_call>call:get_time{tz:UTC}<tool_call|>", None, []),  # unquoted
    (Gemma4ToolParser(), "<|tool_call>get_time{}<tool_call|>", None, []),  # no call:
    (Gemma4ToolParser(), "<|tool_call>call:f{a,b:1}<tool_call|>", None, []),  # not a key
    (Gemma4ToolParser(), "<|tool_call>call:f{a:Infinity}<tool_call|>", None, []),
    (Gemma4ToolParser(), "Braces {like:these} are not calls.", None, []),
]


@pytest.mark.parametrize(("parser", "answer", "content", "calls"), ANSWERS)
def test_parsers_read_the_families_answers(
    parser: ToolParser, answer: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    parsed = parse_answer(parser, answer, max_calls=None)
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == calls
    # No calls: the answer is content, untouched (malformed calls included).
    assert parsed.content == (content if calls else answer)


@pytest.mark.parametrize(("parser", "answer", "content", "calls"), ANSWERS)
def test_streamed_answers_give_the_whole_answers_calls(
    parser: ToolParser, answer: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    whole = parse_answer(parser, answer, max_calls=None)
    rng = random.Random(answer)
    for _ in range(8):
        stream, streamed_content, streamed_calls = ToolCallStream(parser, None), "", []
        pos = 0
        while pos < len(answer):
            piece = answer[pos : pos + rng.randint(1, 6)]  # token-sized, cut anywhere
            pos += len(piece)
            delta = stream.feed(piece, final=pos >= len(answer))
            streamed_content += delta.content
            streamed_calls += [call for _, _, call in delta.new_calls]
            if whole.calls:  # nothing sent is a marker that later opened a call
                assert not any(marker in streamed_content for marker in parser.markers)
        assert (streamed_content or None) == (whole.content or None)
        assert streamed_calls == whole.calls


@pytest.mark.parametrize(("template", "parser"), TEMPLATE_PARSERS.items())
def test_each_real_template_picks_its_own_parser(template: str, parser: str) -> None:
    text = (TEMPLATES / template).read_text()
    assert [name for name, kind in TOOL_PARSERS.items() if kind.detects(text)] == [parser]
    chosen = select_tool_parser("auto", text)
    assert chosen is not None and chosen.name == parser


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_written_calls_read_back(name: str) -> None:
    # write_call writes earlier calls into prompts whose template does not; one call per
    # line, as tool_prompt.with_calls_as_text joins them. (Qwen3-Coder's values are
    # typed by the request's schemas.)
    schemas = {
        "get_weather": {
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "raw": {"type": "array"},
            }
        }
    }
    parser = TOOL_PARSERS[name]().with_tools(schemas)
    calls = [
        {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2, "raw": [True, None]}},
        {"name": "get_time", "arguments": {}},
    ]
    text = "\n".join(parser.write_call(call) for call in calls)
    parsed = parse_answer(parser, text, max_calls=None)
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [
        (call["name"], call["arguments"]) for call in calls
    ]
    assert parsed.content is None


def test_mistral_ids_are_what_its_templates_take_back() -> None:
    ids = {MistralToolParser().new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("3", {"type": "integer"}, 3),
        ("three", {"type": "integer"}, "three"),  # not its type: the text, as written
        ("2.5", {"type": "number"}, 2.5),
        ("NaN", {"type": "number"}, "NaN"),
        ("True", {"type": "boolean"}, True),  # the template writes Python's str(True)
        ("null", {"type": ["integer", "null"]}, None),
        ("7", {"type": ["integer", "null"]}, 7),
        ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
        ("{'a': [1, 2]}", {"type": "object"}, {"a": [1, 2]}),  # the template's repr
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("3", {"type": "string"}, "3"),
        ("  indented\ncode  ", {"type": "string"}, "  indented\ncode  "),
        ("3", None, "3"),  # a parameter the schema does not name
        ("3", {"anyOf": [{"type": "integer"}]}, "3"),
    ],
)
def test_qwen3_coder_values_take_the_schemas_type(raw: str, schema: Any, value: Any) -> None:
    assert typed_value(raw, schema) == value


@pytest.mark.parametrize(
    "value", ['it\'s "quoted"\n', -3, 2.5, True, None, [1, {"k": "v"}], {"a": {"b": []}}]
)
def test_python_literals_round_trip(value: Any) -> None:
    assert parse_literal(literal_text(value)) == value


@pytest.mark.parametrize(
    "text", ["os", "f(1)", "1 + 2", "(1, 2)", "{1, 2}", "{1: 'a'}", "b'x'", "1e999", "{**a}", "[1,"]
)
def test_only_json_literals_are_literals(text: str) -> None:
    with pytest.raises(NotALiteral):
        parse_literal(text)
