"""The OpenAI tool-calling shapes: tool definitions and `tool_choice` in a request, calls in
an assistant message (history or answer) and in a streamed delta.

Kept apart from protocol.py, which only imports these into the chat request and answer.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from iterserve.sampling_params import InvalidRequestError

# ---- request ----------------------------------------------------------------------------


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    # None: a function without arguments (OpenAI's default); the template gets `{}`.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def _one_tool_choice(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # One message naming `tool_choice` itself, rather than pydantic's per-member errors
    # (`tool_choice.literal['none','auto','required']`).
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "tool_choice",
            "must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
        ) from None


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice, WrapValidator(_one_tool_choice)
]


# ---- calls ------------------------------------------------------------------------------


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's convention)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_input(self, where: str) -> dict[str, Any]:
        """The call as chat templates read it. HF templates write `arguments | tojson`,
        so they take the arguments as a mapping, not OpenAI's JSON text (vLLM converts
        them the same way); text that is not a JSON object is the client's mistake."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(
                f"{where}.function.arguments must be a JSON object as text",
                f"{where}.function.arguments",
            )
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": arguments},
        }


class _DropsUnset(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # A delta carries only what changed: {"arguments": "x"}, not {"name": null, ...}.
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_DropsUnset):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropsUnset):
    """A streamed piece of the `index`-th call: id, type and name come first, then the
    arguments, which a client appends together."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
