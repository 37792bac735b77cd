"""`LLM.chat(..., tools=...)`: the server's tool calling, offline.

The same plan (chat/tools.py: which tools the template gets, `tool_choice`, a forced
call's schema), the same rendering (tools in the system message for a template with no
place for them) and the same parsers (chat/tool_parsers/, read in chat/offline_chat.py),
so an offline answer is read into calls exactly as `/v1/chat/completions` reads it. The
calls are returned in OpenAI's shape (`{"id", "type": "function", "function": {"name",
"arguments"}}`, arguments as JSON text), so an assistant message `{"role": "assistant",
"content": ..., "tool_calls": output.tool_calls}` continues the conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from pydantic import TypeAdapter, ValidationError

from iterserve.chat.messages import ChatMessage
from iterserve.chat.tool_parsers import select_tool_parser
from iterserve.chat.tool_prompt import render_with_tools
from iterserve.chat.tool_protocol import ToolChoice, ToolDefinition
from iterserve.chat.tools import ToolPlan, plan_tools
from iterserve.engine.prompts import RenderedChat
from iterserve.invalid_request import InvalidRequestError
from iterserve.sampling_params import SamplingParams

_TOOL_CHOICE: TypeAdapter[Any] = TypeAdapter(ToolChoice)


class ChatWithTools:
    """One `LLM.chat` call's conversations, rendered with their tools, and each output's
    plan (`plans`, one per conversation) to read its answers by."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | Mapping[str, Any] | None,
        parallel_tool_calls: bool,
        tool_parser: str,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        self.tools = [
            _validated(ToolDefinition, tool, f"tools.{i}") for i, tool in enumerate(tools or ())
        ]
        self.tool_choice = (
            None if tool_choice is None else _validated(_TOOL_CHOICE, tool_choice, "tool_choice")
        )
        self.parallel_tool_calls = parallel_tool_calls
        try:
            self.parser = select_tool_parser(tool_parser, chat_template)
        except ValueError as error:
            raise InvalidRequestError(str(error), "tool_parser") from None
        self.special_tokens = set(getattr(tokenizer, "all_special_tokens", ()))
        self.plans: list[ToolPlan] = []

    def prepare(
        self, conversation: Sequence[Mapping[str, Any]], params: SamplingParams
    ) -> tuple[RenderedChat, SamplingParams]:
        """The conversation's prompt, and its own copy of `params` (a forced call
        constrains it; a call marker that is a special token must stay in the text)."""
        params = replace(params)
        plan = plan_tools(
            self.tools or None,
            self.tool_choice,
            self.parallel_tool_calls,
            self.chat_template,
            self.parser,
            params,
            self.special_tokens,
        )
        self.plans.append(plan)
        messages = [
            _validated(ChatMessage, message, f"messages.{i}").as_template_input(i)
            for i, message in enumerate(conversation)
        ]
        prompt = render_with_tools(
            self.tokenizer, self.chat_template, messages, plan, True, self.template_kwargs
        )
        return prompt, params


def _validated(model: Any, value: Any, param: str) -> Any:
    adapter = model if isinstance(model, TypeAdapter) else TypeAdapter(model)
    try:
        return adapter.validate_python(value)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in (param, *first["loc"]))
        raise InvalidRequestError(f"{where}: {first['msg']}", where) from None
