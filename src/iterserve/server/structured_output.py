"""The request fields that constrain the output: OpenAI's `response_format`, vLLM's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and their newer
spelling `structured_outputs`, into one `StructuredOutput` (at most one constraint)."""

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


class StructuredOutputsSpec(BaseModel):
    """vLLM's `structured_outputs` object (its successor to the guided_* fields)."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_spec(self) -> StructuredOutput:
        param = "structured_outputs"
        if self.json_schema is not None:
            if self.regex or self.choice is not None or self.grammar or self.json_object:
                raise InvalidRequestError("give only one constraint", param)
            return StructuredOutput.from_json_schema(self.json_schema, param)
        return StructuredOutput(
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            param=param,
        )


class GuidedDecodingFields(BaseModel):
    """The constraint fields, shared by /v1/completions and /v1/chat/completions."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    # Changes the output and is not honoured: refused rather than dropped.
    guided_whitespace_pattern: str | None = None

    def output_constraint(self) -> StructuredOutput | None:
        if self.guided_whitespace_pattern is not None:
            raise InvalidRequestError(
                "guided_whitespace_pattern is not supported by this server: JSON is "
                "generated compact",
                "guided_whitespace_pattern",
            )
        given = [
            (name, value)
            for name, value in (
                ("guided_json", self.guided_json),
                ("guided_regex", self.guided_regex),
                ("guided_choice", self.guided_choice),
                ("guided_grammar", self.guided_grammar),
                ("structured_outputs", self.structured_outputs),
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
        if isinstance(value, StructuredOutputsSpec):
            return value.to_spec()
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
