"""The request fields that constrain the output: OpenAI's `response_format` and vLLM's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, into one
`StructuredOutput` (at most one of them may be given)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from iterserve.sampling_params import InvalidRequestError
from iterserve.structured_output import StructuredOutput


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    # `schema` is a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # The schema is enforced by the grammar whether or not the client asks for strict.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class GuidedDecodingFields(BaseModel):
    """The constraint fields, shared by /v1/completions and /v1/chat/completions."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        given = [
            (name, value)
            for name, value in (
                ("guided_json", self.guided_json),
                ("guided_regex", self.guided_regex),
                ("guided_choice", self.guided_choice),
                ("guided_grammar", self.guided_grammar),
            )
            if value is not None
        ]
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            given.insert(0, ("response_format", response_format))
        if not given:
            return None
        if len(given) > 1:
            names = " and ".join(name for name, _ in given)
            raise InvalidRequestError(
                f"{names} each constrain the output; give only one", given[1][0]
            )
        name, value = given[0]
        if isinstance(value, ResponseFormat):
            return _from_response_format(value)
        if name == "guided_json":
            return StructuredOutput.from_json_schema(value, name)
        if name == "guided_regex":
            return StructuredOutput(regex=value, param=name)
        if name == "guided_choice":
            return StructuredOutput(choice=value, param=name)
        return StructuredOutput(grammar=value, param=name)


def _from_response_format(response_format: ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput(json_object=True, param="response_format")
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise InvalidRequestError(
            "response_format of type json_schema needs json_schema.schema", "response_format"
        )
    return StructuredOutput.from_json_schema(spec.json_schema, "response_format")
