"""`LLM.chat`: conversations rendered and answers read as the server's chat route does.

Tools (chat/offline_tools.py) and a thinking model's answers (chat/reasoning.py) go through
the same plan, rendering and parsers as `/v1/chat/completions`, so an offline answer is
read exactly as the server reads it: `output.reasoning_content` holds the thinking,
`output.content` what follows it (without the calls), `output.tool_calls` the calls in
OpenAI's shape; `output.text` stays the model's whole answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from iterserve.chat.answer import read_answer
from iterserve.chat.image_parts import take_images
from iterserve.chat.offline_tools import ChatWithTools
from iterserve.chat.reasoning import ReasoningSupport, cap_thinking
from iterserve.chat.reasoning_parsers import ThinkingReader
from iterserve.chat.tool_parsers.hermes import HermesToolParser
from iterserve.chat.tools import ToolPlan
from iterserve.engine.images import ImagesPrompt
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import RenderedChat, render_chat
from iterserve.invalid_request import InvalidRequestError
from iterserve.sampling_params import SamplingParams

# A chat without tools: nothing is read as calls.
_NO_TOOLS = ToolPlan(None, None, None, HermesToolParser())


class OfflineChat:
    """One `LLM.chat` call: its conversations' prompts, and the reading of their answers."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | Mapping[str, Any] | None,
        parallel_tool_calls: bool,
        tool_parser: str,
        reasoning_parser: str,
        template_kwargs: Mapping[str, Any] | None,
        thinking_token_budget: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        self.tools = None
        if tools is not None or tool_choice is not None:
            self.tools = ChatWithTools(
                tokenizer,
                chat_template,
                tools,
                tool_choice,
                parallel_tool_calls,
                tool_parser,
                template_kwargs,
            )
        try:
            self.reasoning = ReasoningSupport.for_model(reasoning_parser, tokenizer, chat_template)
        except ValueError as error:
            raise InvalidRequestError(str(error), "reasoning_parser") from None
        self.readers: list[ThinkingReader | None] = []
        self.thinking_token_budget = thinking_token_budget

    def prepare(
        self, conversation: Sequence[Mapping[str, Any]], params: SamplingParams
    ) -> tuple[RenderedChat | ImagesPrompt, SamplingParams]:
        """The conversation's prompt (with its images, if any), and its own copy of
        `params` (adjusted for its tools and its thinking)."""
        conversation, images = take_images(conversation)
        if self.tools is not None:
            prompt, params = self.tools.prepare(conversation, params)
        else:
            prompt = render_chat(
                self.tokenizer, self.chat_template, conversation, True, self.template_kwargs
            )
            params = replace(params)
        reader = self.reasoning.prepare(prompt.text, params) if self.reasoning else None
        if self.thinking_token_budget is not None:
            cap_thinking(self.reasoning, reader, params, self.thinking_token_budget)
        self.readers.append(reader)
        if images:
            return ImagesPrompt(prompt.text, tuple(images), rendered=True), params
        return prompt, params

    def read(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Each answer's thinking, content and calls (left None where nothing is read)."""
        plans = self.tools.plans if self.tools is not None else [_NO_TOOLS] * len(outputs)
        for first, reader, plan in zip(outputs, self.readers, plans, strict=True):
            if reader is None and plan.reader is None:
                continue
            for output in first.choices or [first]:  # each of n choices
                answer = read_answer(output.text, reader, plan)
                output.reasoning_content = answer.reasoning
                output.content = answer.content
                if plan.reader is None:
                    continue
                output.tool_calls = [
                    {
                        "id": plan.reader.new_call_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in answer.calls
                ]
        return outputs
