"""A chat message as the OpenAI API sends it, and as a chat template takes it: shared by
the server's /v1/chat/completions and the offline LLM.chat."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from iterserve.chat.tool_protocol import ToolCall
from iterserve.sampling_params import InvalidRequestError


class ImageURL(BaseModel):
    url: str
    detail: str | None = None  # OpenAI's resolution hint; the model's processor decides


class ContentPart(BaseModel):
    """A text part, or an image (`image_url`: chat/image_parts.py reads it)."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, earlier in the chat
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's earlier thinking, sent back: templates that show it read this (Qwen3's,
    # within the turn of a tool loop).
    reasoning_content: str | None = None

    def as_template_input(self, index: int) -> dict[str, Any]:
        content: str | list[dict[str, Any]] | None = self.content  # type: ignore[assignment]
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if not _is_text(part) and not (part.type == "image_url" and part.image_url):
                    where = f"messages.{index}.content.{j}"
                    raise InvalidRequestError(
                        f"{where}: a content part is text or an image_url, got {part.type!r}",
                        where,
                    )
            if all(_is_text(part) for part in self.content):
                # One text, the parts a line apart, as vLLM and llama-server join them.
                content = "\n".join(part.text or "" for part in self.content)
            else:  # in order, for the template to place the images (chat/image_parts.py)
                content = [part.model_dump(exclude_none=True) for part in self.content]
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


def _is_text(part: ContentPart) -> bool:
    return part.type == "text" and part.text is not None
