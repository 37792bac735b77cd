"""Anthropic's context editing (`context_management.edits` on a Messages request).

An edit clears, before the prompt is rendered, what a long agent conversation no longer
needs the model to read; the client keeps and resends its whole history, and the answer's
`context_management.applied_edits` says what was cleared. Two strategies, as Anthropic's API
runs them (Claude Code sends the first with every request):

- `clear_thinking_20251015`: the thinking blocks of all but the last `keep` assistant turns
  that have some (default 1; `"all"` keeps every one, and the prompt's cached prefix with
  them);
- `clear_tool_uses_20250919`: once `trigger` is passed (input tokens, default 100,000, or
  a count of tool uses), every tool use but the last `keep` (default 3) has its result
  replaced by a placeholder, and its input emptied where `clear_tool_inputs` says so; uses
  of `exclude_tools` stay whole, and nothing is cleared unless at least `clear_at_least`
  input tokens would be.

Token counts are the rendered prompt's, before and after the edit (`PromptCounter`), so a
template that hides old thinking anyway reports nothing cleared for it. Server-side
compaction (`compact_20260112`, a summary written by the model) is not run here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from iterserve.sampling_params import InvalidRequestError
from iterserve.server.error_paths import validated

if TYPE_CHECKING:
    from iterserve.server.messages_protocol import InputMessage, MessagesRequest

# What a cleared tool result reads (the model still sees that the call was made).
CLEARED_RESULT = "[tool result cleared to save context]"

# The input tokens of a Messages request as rendered for the model.
PromptCounter = Callable[["MessagesRequest"], int]


class _ThinkingTurns(BaseModel):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class _AllTurns(BaseModel):
    type: Literal["all"]


class _InputTokens(BaseModel):
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class _ToolUses(BaseModel):
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ClearThinking(BaseModel):
    type: Literal["clear_thinking_20251015"]
    keep: _ThinkingTurns | _AllTurns | Literal["all"] = _ThinkingTurns(
        type="thinking_turns", value=1
    )

    def apply(self, messages: list[InputMessage]) -> tuple[list[InputMessage], int]:
        """The messages with old turns' thinking cleared, and how many turns lost it."""
        if not isinstance(self.keep, _ThinkingTurns):
            return messages, 0
        thinking = [i for i, message in enumerate(messages) if _has_thinking(message)]
        older = thinking[: max(0, len(thinking) - self.keep.value)]
        edited = list(messages)
        for index in older:
            blocks = [block for block in edited[index].content if not _is_thinking(block)]
            edited[index] = edited[index].model_copy(update={"content": blocks})
        return edited, len(older)

    def report(self, cleared: int, tokens: int) -> dict[str, Any]:
        return {
            "type": self.type,
            "cleared_thinking_turns": cleared,
            "cleared_input_tokens": tokens,
        }


class ClearToolUses(BaseModel):
    type: Literal["clear_tool_uses_20250919"]
    trigger: _InputTokens | _ToolUses = _InputTokens(type="input_tokens", value=100_000)
    keep: _ToolUses = _ToolUses(type="tool_uses", value=3)
    clear_at_least: _InputTokens | None = None
    exclude_tools: list[str] = []
    clear_tool_inputs: bool | list[str] = False

    def triggered(self, messages: Sequence[InputMessage], tokens: Callable[[], int]) -> bool:
        if isinstance(self.trigger, _ToolUses):
            return len(_tool_uses(messages)) > self.trigger.value
        return tokens() > self.trigger.value

    def apply(self, messages: list[InputMessage]) -> tuple[list[InputMessage], int]:
        """The messages with every tool use but the last `keep` cleared (those of
        `exclude_tools` aside, and those cleared already), and how many were."""
        uses = _tool_uses(messages)
        older = uses[: max(0, len(uses) - self.keep.value)]
        chosen = {
            use_id: name for use_id, name in older if use_id and name not in self.exclude_tools
        }
        edited, cleared = [], set()
        for message in messages:
            if isinstance(message.content, str):
                edited.append(message)
                continue
            blocks = [copy.copy(block) for block in message.content]
            for block in blocks:
                kind = block.get("type")
                if kind == "tool_use" and self._clears_input(chosen.get(_text(block, "id"))):
                    block["input"] = {}
                elif kind == "tool_result" and _text(block, "tool_use_id") in chosen:
                    if block.get("content") != CLEARED_RESULT:
                        cleared.add(block["tool_use_id"])
                    block["content"] = CLEARED_RESULT
            edited.append(message.model_copy(update={"content": blocks}))
        return edited, len(cleared)

    def _clears_input(self, name: str | None) -> bool:
        if name is None:
            return False
        inputs = self.clear_tool_inputs
        return inputs if isinstance(inputs, bool) else name in inputs

    def enough(self, tokens: int) -> bool:
        return self.clear_at_least is None or tokens >= self.clear_at_least.value

    def report(self, cleared: int, tokens: int) -> dict[str, Any]:
        return {"type": self.type, "cleared_tool_uses": cleared, "cleared_input_tokens": tokens}


_EDITS: dict[str, type[ClearThinking | ClearToolUses]] = {
    "clear_thinking_20251015": ClearThinking,
    "clear_tool_uses_20250919": ClearToolUses,
}


def read_edits(raw: Any) -> list[ClearThinking | ClearToolUses]:
    """`context_management` read, each edit checked (a 400 naming the field otherwise)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("edits", []), list):
        raise InvalidRequestError(
            "context_management is an object with a list of edits", "context_management"
        )
    edits = []
    for index, edit in enumerate(raw.get("edits", [])):
        where = f"context_management.edits.{index}"
        kind = edit.get("type") if isinstance(edit, dict) else None
        model = _EDITS.get(kind) if isinstance(kind, str) else None
        if model is None:
            known = ", ".join(_EDITS)
            raise InvalidRequestError(
                f"context edits of type {kind!r} are not run here (only {known}; compaction "
                "is the client's to do)",
                f"{where}.type",
            )
        edits.append(validated(model, edit, where))
    return edits


def apply_edits(
    body: MessagesRequest, edits: Sequence[ClearThinking | ClearToolUses], count: PromptCounter
) -> tuple[MessagesRequest, list[dict[str, Any]]]:
    """The request as the model will read it, and Anthropic's `applied_edits`. Each edit
    works on the last one's result; the prompt is rendered only when a count is needed."""
    applied = []
    tokens: int | None = None  # the current request's, once counted

    def current() -> int:
        nonlocal tokens
        if tokens is None:
            tokens = count(body)
        return tokens

    for edit in edits:
        if isinstance(edit, ClearToolUses) and not edit.triggered(body.messages, current):
            continue
        messages, cleared = edit.apply(body.messages)
        if not cleared:
            continue
        edited = body.model_copy(update={"messages": messages})
        before, after = current(), count(edited)
        if isinstance(edit, ClearToolUses) and not edit.enough(before - after):
            continue
        body, tokens = edited, after
        applied.append(edit.report(cleared, before - after))
    return body, applied


def _is_thinking(block: dict[str, Any]) -> bool:
    return block.get("type") in ("thinking", "redacted_thinking")


def _has_thinking(message: InputMessage) -> bool:
    content = message.content
    return (
        message.role == "assistant"
        and isinstance(content, list)
        and any(map(_is_thinking, content))
    )


def _text(block: dict[str, Any], key: str) -> str | None:
    """A block's string field (blocks are checked after the edits: this one may be anything)."""
    value = block.get(key)
    return value if isinstance(value, str) else None


def _tool_uses(messages: Sequence[InputMessage]) -> list[tuple[str | None, str | None]]:
    """Every tool use, (id, name), in the order made."""
    return [
        (_text(block, "id"), _text(block, "name"))
        for message in messages
        if message.role == "assistant" and isinstance(message.content, list)
        for block in message.content
        if block.get("type") == "tool_use"
    ]
