"""A chat message as the OpenAI API sends it, and as a chat template takes it: shared by
the server's /v1/chat/completions and the offline LLM.chat."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from iterserve.chat.tool_protocol import ToolCall
from iterserve.sampling_params import InvalidRequestError


class TextContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, earlier in the chat
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's earlier thinking, sent back: templates that show it read this (Qwen3's,
    # within the turn of a tool loop).
    reasoning_content: str | None = None

    def as_template_input(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidRequestError(
                    "only text content parts are supported by this model", "messages"
                )
            # One text, the parts a line apart, as vLLM and llama-server join them.
            content = "\n".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            where = f"messages.{index}.tool_calls"
            message["tool_calls"] = [
                call.as_template_input(f"{where}.{i}") for i, call in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message
