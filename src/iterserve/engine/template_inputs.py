"""Earlier tool calls (and the tools) in the shape a chat template was written for.

Messages reach a template as HF's convention has them: a call's arguments as a mapping,
and, since transformers 5 drops keys whose value is None, no `content` at all for an
assistant message that is only calls. Some templates were written for other shapes:

- DeepSeek's (V3, R1, V3.1) join the arguments to text,
  `'...' + tool['function']['arguments']`, for OpenAI's JSON text: a mapping raises.
- The same templates test `message['content'] is none`, which a missing key never is;
  the calls-only message then fails on its content. With content "" such a template
  writes nothing for it (V3.1), or an empty turn (V3 / R1, which writes any content as
  a turn of its own after the calls).
- gpt-oss's joins a tool's description to text, `"// " + tool.description`: a tool
  sent without one (OpenAI's schema allows it) raises. It gets an empty one.
- gpt-oss's takes one analysis text before a message's calls, from its `thinking` (which
  transformers fills from `reasoning_content`) or else its content, and refuses both. An
  agent sends back both when the answer had a preamble; the thinking is kept, as llama.cpp
  keeps it.

The template's source says which it expects (as `template_roles` reads roles from it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

_ARGUMENTS = r"""(?:\[['"]arguments['"]\]|\.arguments\b)"""
# `x + tool['function']['arguments']` or `tool.function.arguments + x`.
_JOINS_ARGUMENTS = re.compile(rf"""\+\s*[\w.\[\]'"]*{_ARGUMENTS}|{_ARGUMENTS}\s*\+""")
# `message['content'] is none`, `message.content is not none`.
_CONTENT_IS_NONE = re.compile(r"""(?:\[['"]content['"]\]|\.content\b)\s+is\s+(?:not\s+)?none""")


# `"// " + tool.description` or `tool.description + x`.
_JOINS_DESCRIPTION = re.compile(r"""\+\s*[\w.\[\]'"]*description\b|description['"]?\]?\s*\+""")
_THINKING = re.compile(r"""message(?:\[['"]thinking['"]\]|\.thinking\b)""")


@lru_cache(maxsize=8)
def joins_description_as_text(template: str) -> bool:
    return bool(_JOINS_DESCRIPTION.search(template))


@lru_cache(maxsize=8)
def reads_thinking(template: str) -> bool:
    return bool(_THINKING.search(template))


@lru_cache(maxsize=8)
def joins_arguments_as_text(template: str) -> bool:
    return bool(_JOINS_ARGUMENTS.search(template))


@lru_cache(maxsize=8)
def checks_content_for_none(template: str) -> bool:
    return bool(_CONTENT_IS_NONE.search(template))


def fitted_to_template(
    template: str, messages: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """`messages` with their calls and thinking in the shape `template` reads."""
    as_text = joins_arguments_as_text(template)
    empty_content = checks_content_for_none(template)
    thinking = reads_thinking(template)
    if not (as_text or empty_content or thinking):
        return list(messages)
    fitted: list[Mapping[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            fitted.append(message)
            continue
        message = dict(message)
        if thinking and message.get("reasoning_content") is not None:
            message.pop("content", None)
        if as_text:
            message["tool_calls"] = [_with_text_arguments(call) for call in calls]
        if empty_content and message.get("content") is None:
            message["content"] = ""
        fitted.append(message)
    return fitted


def _with_text_arguments(call: Mapping[str, Any]) -> Mapping[str, Any]:
    function = call.get("function")
    if not isinstance(function, Mapping) or isinstance(function.get("arguments"), str):
        return call
    text = json.dumps(function.get("arguments"), ensure_ascii=False)
    return {**call, "function": {**function, "arguments": text}}


def fitted_tools(template: str, tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """`tools` (HF's schemas) with what `template` reads unguarded."""
    if not joins_description_as_text(template):
        return list(tools)
    fitted: list[Mapping[str, Any]] = []
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, Mapping) and function.get("description") is None:
            tool = {**tool, "function": {**function, "description": ""}}
        fitted.append(tool)
    return fitted
