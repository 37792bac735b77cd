"""What a chat request's `tools` and `tool_choice` mean for serving it: which tools the
chat template gets, whether (and how) the answer is parsed into calls, and, for
`required` or a named function, the JSON schema the answer must follow.

`tool_choice` (OpenAI): `none` never parses calls (the tools still go to the template,
as vLLM does by default); `auto` lets the model choose and parses whatever calls it
wrote with the server's parser; `required` and a named function must be *enforced*,
which takes grammar-constrained decoding: `forced_call_schema` is the schema, and
`enforce_schema` hands it to the request as its structured output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iterserve.chat.tool_parsers import AnswerReader, ToolParser, shows_tools
from iterserve.chat.tool_parsers.forced import ForcedCallReader, forced_call_schema
from iterserve.chat.tool_parsers.hermes import HermesToolParser
from iterserve.chat.tool_protocol import ToolChoice, ToolDefinition
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.structured_output import StructuredOutput


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # what the chat template's `tools` gets
    reader: AnswerReader | None  # reads the answer into calls; None: plain content
    max_calls: int | None  # 1 when the client turned parallel_tool_calls off
    # The call format earlier calls are written in, and taught in the system message
    # when `tools_in_system_message` (a template with no place for tools).
    call_format: ToolParser
    tools_in_system_message: bool = False


def plan_tools(
    tools: list[ToolDefinition] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
    chat_template: str | None,
    parser: ToolParser | None,
    params: SamplingParams,
    special_tokens: set[str],
) -> ToolPlan:
    """Check the request's tools against this server and template; may adjust `params`
    (special tokens kept, a schema enforced). Raises InvalidRequestError naming the field."""
    call_format = parser or HermesToolParser()
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise InvalidRequestError("tool_choice needs tools to choose from", "tool_choice")
        return ToolPlan(None, None, None, call_format)
    _check_unique_names(tools)
    template_tools = [_template_tool(tool) for tool in tools]
    choice = tool_choice or "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return ToolPlan(template_tools, None, None, call_format)
    max_calls = None if parallel_tool_calls else 1
    in_system = not shows_tools(chat_template or "")
    if choice != "auto":
        enforce_schema(params, forced_call_schema(tools, choice, max_calls))
        reader = ForcedCallReader(choice, call_format)
        return ToolPlan(template_tools, reader, max_calls, call_format, in_system)
    if parser is None:
        raise InvalidRequestError(
            "tool_choice 'auto' needs a tool call parser, and none was chosen for this "
            "model's chat template: start the server with --tool-call-parser",
            "tool_choice",
        )
    if any(marker in special_tokens for marker in parser.markers):
        params.skip_special_tokens = False  # or the call's marker vanishes from the text
    reader = parser.with_tools(
        {tool.function.name: tool.function.parameters_schema() for tool in tools}
    )
    return ToolPlan(template_tools, reader, max_calls, call_format, in_system)


def _template_tool(tool: ToolDefinition) -> dict[str, Any]:
    # Templates read `function.parameters` unguarded: a function without arguments gets
    # OpenAI's meaning of that, an empty object schema.
    function = tool.function.model_dump(exclude_none=True)
    return {
        "type": tool.type,
        "function": {**function, "parameters": tool.function.parameters_schema()},
    }


def _check_unique_names(tools: list[ToolDefinition]) -> None:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.function.name in seen:
            raise InvalidRequestError(
                f"two tools are named {tool.function.name!r}", f"tools.{index}.function.name"
            )
        seen.add(tool.function.name)


def enforce_schema(params: SamplingParams, schema: dict[str, Any]) -> None:
    """Constrain this request's decoding to `schema`: the forced call is then valid JSON
    for its tool, whatever the model (structured output, docs/structured_output.md).

    A `response_format` (Responses' `text.format`) gives way: it shapes a text answer,
    and a forced call's answer has none. OpenAI takes the two together, and instructor's
    RESPONSES_TOOLS mode sends both. A vLLM `guided_*` field constrains the generated
    text itself, so it and a forced call are still a 400."""
    constraint = params.structured_output
    if constraint is not None and constraint.param != "response_format":
        raise InvalidRequestError(
            f"tool_choice forces a call, and {constraint.param} constrains "
            "the output too; give only one",
            "tool_choice",
        )
    params.structured_output = StructuredOutput.from_json_schema(schema, "tool_choice")
    params.validate()  # ignore_eos or min_tokens with a constraint are refused
