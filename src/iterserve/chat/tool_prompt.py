"""Tools for a chat template that has no place for them (the bundled SmolLM2's, many
small and base models'): the definitions go into the system message, with the call
format the server's parser reads, and earlier calls are written into their assistant
message's text in that format; llama.cpp serves such templates the same way. Without
this the tools would silently never reach the model, or the history would not render.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from iterserve.chat.tool_parsers import shows_tool_calls
from iterserve.chat.tool_parsers.base import ToolParser
from iterserve.engine.prompts import RenderedChat, render_chat

if TYPE_CHECKING:
    from iterserve.chat.tools import ToolPlan

Message = dict[str, Any]


def render_with_tools(
    tokenizer: Any,
    chat_template: str | None,
    messages: Sequence[Message],
    plan: ToolPlan,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> RenderedChat:
    """A conversation (template inputs: calls' arguments as objects) through the chat
    template with the plan's tools; the server's chat route and `LLM.chat` both."""
    if not shows_tool_calls(chat_template or ""):
        messages = with_calls_as_text(messages, plan.call_format)
    if plan.tools_in_system_message and plan.template_tools:
        messages = with_tools_in_system_message(messages, plan.template_tools, plan.call_format)
    return render_chat(
        tokenizer,
        chat_template,
        messages,
        add_generation_prompt,
        template_kwargs,
        plan.template_tools,
        continue_final_message,
    )


def with_tools_in_system_message(
    messages: Sequence[Message], tools: Sequence[Message], parser: ToolParser
) -> list[Message]:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    prompt = (
        "You can call these functions, described as JSON schemas:\n"
        f"{listed}\n\n"
        "To call one, answer with this and nothing else (once per call):\n"
        f"{parser.call_format}"
    )
    first = messages[0] if messages else None
    if first is not None and first.get("role") == "system" and isinstance(first["content"], str):
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def with_calls_as_text(messages: Sequence[Message], parser: ToolParser) -> list[Message]:
    """Assistant messages' calls appended to their text, as the model was asked to write
    them; `tool_calls` itself is dropped (a template that never reads it may still trip
    over a null content)."""
    written = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            written.append(message)
            continue
        parts = [message["content"]] if message.get("content") else []
        parts += [parser.write_call(call["function"]) for call in calls]
        rest = {key: value for key, value in message.items() if key != "tool_calls"}
        written.append({**rest, "content": "\n".join(parts)})
    return written
