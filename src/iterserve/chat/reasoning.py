"""What serving a thinking model needs beside its parser, shared by the server and
`LLM.chat`: the markers as the tokenizer writes them (the grammar of structured output and
forced tool calls starts after the thinking, and usage counts the tokens up to its end), the
chat template's switch that turns thinking off, and what `reasoning_effort` (Responses:
`reasoning.effort`) sets it to (or, where the template takes efforts, the effort itself). docs/reasoning.md has the rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from iterserve.chat.reasoning_parsers import (
    ReasoningParser,
    ThinkingReader,
    ThinkingStart,
    select_reasoning_parser,
)
from iterserve.engine.prompts import render_chat
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.structured_output import ThinkingMarkers
from iterserve.thinking_budget import ThinkingBudget

# OpenAI's efforts that ask for no thinking; every other asks for it.
NO_THINKING_EFFORTS = ("none", "minimal")
# Template variables that turn thinking on and off: Qwen3's (and GLM-4.5's), DeepSeek-V3.1's.
_SWITCHES = ("enable_thinking", "thinking")
_PROBE = [{"role": "user", "content": "Hi"}]
# The template variable that takes the effort itself, where a template has efforts (gpt-oss).
EFFORT_VARIABLE = "reasoning_effort"


@dataclass(frozen=True)
class ReasoningSupport:
    parser: ReasoningParser
    end_ids: tuple[int, ...]  # the end marker's tokens
    grammar_ids: tuple[int, ...]  # the tokens a grammar starts after
    open_id: int | None  # the open marker's token, when it is a single one
    switch: str | None  # the template variable that turns thinking off, if it has one
    markers_are_special: bool  # then special tokens are kept in the text, or they vanish
    # A thinking budget's markers as tokens (opener, end, close), by where answers start.
    budget_ids: Mapping[ThinkingStart, tuple[tuple[int, ...], ...]]

    @classmethod
    def for_model(
        cls, choice: str, tokenizer: Any, chat_template: str | None
    ) -> ReasoningSupport | None:
        """The support `--reasoning-parser choice` gives this model (None: answers are
        not read for thinking). Raises ValueError for an unknown choice."""
        parser = select_reasoning_parser(
            choice, chat_template, lambda: _probe(tokenizer, chat_template)
        )
        if parser is None:
            return None

        def tokens(marker: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(marker, add_special_tokens=False))

        opening = tokens(parser.open_marker) if parser.open_marker else ()
        special = getattr(tokenizer, "all_special_tokens", ())
        budget_ids = {
            start: tuple(tokens(marker) if marker else () for marker in markers)
            for start in ThinkingStart
            if (markers := parser.budget_markers(start)) is not None
        }
        return cls(
            parser,
            tokens(parser.end_marker),
            tokens(parser.grammar_marker),
            opening[0] if len(opening) == 1 else None,
            None if parser.effort_levels else _thinking_switch(tokenizer, chat_template),
            any(token in marker for marker in parser.markers for token in special),
            budget_ids,
        )

    def prepare(self, prompt: str, params: SamplingParams) -> ThinkingReader:
        """The reader of the answer to `prompt` (rendered); adjusts `params`, the request's
        own copy: a grammar starts after the thinking, special markers stay in the text."""
        reader = self.parser.reader(prompt)
        if self.markers_are_special:
            params.skip_special_tokens = False
        spec = params.structured_output
        markers = self._grammar_start(reader.start)
        if spec is not None and markers is not None:
            # A copy: the constraint object may be shared by the requests of one call.
            params.structured_output = replace(spec, after_thinking=markers)
        return reader

    def _grammar_start(self, start: ThinkingStart) -> ThinkingMarkers | None:
        if start is ThinkingStart.INSIDE:
            return ThinkingMarkers(self.grammar_ids)
        if start is ThinkingStart.MAY_OPEN and self.open_id is not None:
            return ThinkingMarkers(self.grammar_ids, self.open_id)
        # Thinking closed by the prompt: the grammar starts at once. (Where the open marker
        # is several tokens the model could not open thinking under a grammar either.)
        return None

    @property
    def effort_variable(self) -> str | None:
        """The template variable a request's effort sets (template_kwargs): the effort
        itself where the template takes levels (gpt-oss's), else the thinking switch."""
        return EFFORT_VARIABLE if self.parser.effort_levels is not None else self.switch

    def effort_note(self) -> str:
        """What `reasoning_effort` sets, for the start-up log."""
        if self.parser.effort_levels:
            return f"; efforts: {', '.join(self.parser.effort_levels)}"
        return f"; thinking switch: {self.switch}" if self.switch else ""

    def reasoning_tokens(self, token_ids: Sequence[int], thought: bool) -> int:
        """How many of an answer's tokens are its thinking, end marker included (all of
        them when it never ended)."""
        if not thought:
            return 0
        end, count = self.end_ids, len(self.end_ids)
        for index in range(len(token_ids) - count + 1):
            if tuple(token_ids[index : index + count]) == end:
                return index + count
        return len(token_ids)

    def template_kwargs(
        self, given: Mapping[str, Any] | None, effort: str, param: str
    ) -> dict[str, Any] | None:
        """`given` (chat_template_kwargs) with the switch set as `effort` asks, or the
        effort itself where the template takes it (gpt-oss's)."""
        levels = self.parser.effort_levels
        if levels is not None:
            return _with_effort_level(given, effort, levels, param)
        thinking = effort not in NO_THINKING_EFFORTS
        if self.switch is None:
            if not thinking:
                raise InvalidRequestError(
                    f"{param} {effort!r} asks for no thinking, and this model's chat template "
                    "has no switch to turn it off",
                    param,
                )
            return dict(given) if given else None  # it thinks already
        if given and self.switch in given and bool(given[self.switch]) != thinking:
            raise InvalidRequestError(
                f"{param} {effort!r} and chat_template_kwargs.{self.switch}="
                f"{given[self.switch]!r} disagree",
                param,
            )
        return {**(given or {}), self.switch: thinking}


def _with_effort_level(
    given: Mapping[str, Any] | None, effort: str, levels: tuple[str, ...], param: str
) -> dict[str, Any]:
    if effort not in levels:
        raise InvalidRequestError(
            f"{param} {effort!r} is not one of this model's efforts: {', '.join(levels)} "
            "(it always thinks)",
            param,
        )
    if given and given.get(EFFORT_VARIABLE, effort) != effort:
        raise InvalidRequestError(
            f"{param} {effort!r} and chat_template_kwargs.{EFFORT_VARIABLE}="
            f"{given[EFFORT_VARIABLE]!r} disagree",
            param,
        )
    return {**(given or {}), EFFORT_VARIABLE: effort}


def cap_thinking(
    support: ReasoningSupport | None,
    reader: ThinkingReader | None,
    params: SamplingParams,
    tokens: int,
) -> None:
    """Cap the thinking of the answer `reader` reads at `tokens` tokens (`params`: the
    request's own copy), as `thinking_token_budget` asks; an answer whose prompt closed
    its thinking has none to cap. A budget for a model whose thinking is not read is
    refused."""
    if tokens < 0:
        raise InvalidRequestError(
            f"thinking_token_budget must be at least 0, got {tokens}", "thinking_token_budget"
        )
    if support is None or reader is None:
        raise InvalidRequestError(
            "thinking_token_budget is not supported by this model: the server reads no "
            "thinking from its answers (a model with <think> in its chat template, or "
            "--reasoning-parser)",
            "thinking_token_budget",
        )
    ids = support.budget_ids.get(reader.start)
    if ids is None:
        return
    opener, ended, close = ids
    params.thinking_budget = ThinkingBudget(tokens, opener, ended, close)
    params.validate()


def thinking_template_kwargs(
    support: ReasoningSupport | None,
    given: Mapping[str, Any] | None,
    effort: str | None,
    param: str = "reasoning_effort",
) -> Mapping[str, Any] | None:
    """The chat template's kwargs for a request: `given`, with the thinking switch set as
    `effort` asks. Effort for a model whose thinking is not read is refused (but 'none',
    which a model that does not think honours already)."""
    if effort is None:
        return given
    if support is None:
        if effort == "none":
            return given
        raise InvalidRequestError(
            f"{param} is not supported by this model: the server reads no thinking from its "
            "answers (a model with <think> in its chat template, or --reasoning-parser)",
            param,
        )
    return support.template_kwargs(given, effort, param)


def _probe(
    tokenizer: Any, chat_template: str | None, kwargs: Mapping[str, Any] | None = None
) -> str | None:
    """A one-message conversation through the template (None if it cannot render it)."""
    if not chat_template:
        return None
    try:
        return render_chat(tokenizer, chat_template, _PROBE, True, kwargs).text
    except InvalidRequestError:
        return None


def _thinking_switch(tokenizer: Any, chat_template: str | None) -> str | None:
    """The template variable whose value changes the generation prompt (so it turns
    thinking on and off), if the template has one of the known ones."""
    for name in _SWITCHES:
        if chat_template is None or name not in chat_template:
            continue
        on = _probe(tokenizer, chat_template, {name: True})
        off = _probe(tokenizer, chat_template, {name: False})
        if on is not None and off is not None and on != off:
            return name
    return None
