"""What a request's output must match: a JSON schema, any JSON object, a regex, one of
some strings, or a grammar, and, for a thinking model, from where on (after its thinking).
Pure Python, so core/ can carry it; the grammar library lives in sample/structured.py, on
the executor's side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from iterserve.invalid_request import InvalidRequestError

# The kinds, in the order a request may spell them (exactly one is set).
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class ThinkingMarkers:
    """The grammar starts once the model's thinking ends (docs/reasoning.md): until the
    output's tokens end with `end` (`</think>`'s ids) the grammar neither masks nor
    follows them. `open`: where the model may open thinking itself (Qwen3 writes `<think>`
    first, or answers at once), the one token that opens it; the first token may then be
    it as well as one the grammar allows. None: the prompt already opened thinking."""

    end: tuple[int, ...]
    open: int | None = None

    def __post_init__(self) -> None:
        if not self.end:
            raise ValueError("the end of thinking needs at least one token")


@dataclass
class StructuredOutput:
    """Exactly one of the constraints (vLLM's `guided_*` / `response_format`).

    `grammar` is Lark (llguidance's dialect) or GBNF/EBNF as llama.cpp and vLLM write it
    (told apart by `::=`). `param` names the request field the constraint came from, so
    a grammar that does not compile is refused naming what the client sent.
    """

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str = "structured_output"
    # Set for a thinking model's answer: the grammar applies after the thinking only.
    after_thinking: ThinkingMarkers | None = None
    # The compiled grammar (sample/structured.py), attached off the engine thread before
    # the request is queued; opaque here and never sent across processes.
    compiled: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_json_schema(
        cls, schema: dict[str, Any] | str, param: str = "json_schema"
    ) -> StructuredOutput:
        """Output constrained to JSON valid against `schema` (a dict or its JSON text):
        what `response_format` json_schema, `guided_json` and a forced tool call ask for."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise InvalidRequestError(
                    f"the JSON schema is not valid JSON: {error}", param
                ) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("the JSON schema must be a JSON object", param)
        return cls(json_schema=schema, param=param)

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on: the cache key."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json_schema" or kind == "choice":
            value = json.dumps(value, sort_keys=True)
        return kind, str(value)

    def validate(self) -> None:
        present = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(present) != 1:
            raise InvalidRequestError(
                "give exactly one output constraint (a JSON schema, a JSON object, a regex, "
                f"a choice or a grammar), got {', '.join(present) or 'none'}",
                self.param,
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(
                "the choices must be a non-empty list of non-empty strings", self.param
            )
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise InvalidRequestError(f"the {name} must not be empty", self.param)
        if self.json_schema is not None and "x-guidance" in self.json_schema:
            # llguidance's layout options would undo the bounds that make JSON end
            # (compact whitespace; its `lenient` ignores keywords it cannot enforce).
            raise InvalidRequestError(
                "the JSON schema's x-guidance options are not taken: the server lays JSON "
                "out itself (compact, numbers' digits bounded)",
                self.param,
            )

    def __getstate__(self) -> dict[str, Any]:
        # The compiled grammar belongs to one process's library objects; another process
        # (a data-parallel replica) compiles its own.
        return {**self.__dict__, "compiled": None}
