"""instructor: `instructor.from_openai(OpenAI(base_url=...))` with `response_model=CityInfo`
in its default mode (TOOLS: a forced tool call), JSON_SCHEMA (response_format
json_schema), JSON (response_format json_object, the schema in the prompt), TOOLS_STRICT
(the tool with `strict: true`) and RESPONSES_TOOLS (a forced call on /v1/responses)."""

from __future__ import annotations

from typing import Any

import instructor
from _scenario import API_KEY, BASE_URL, EXTRACT_PROMPT, MAX_TOKENS, MODEL, CityInfo, run_case
from openai import OpenAI


def extract(mode: instructor.Mode | None) -> tuple[bool, object, dict[str, Any]]:
    openai_client = OpenAI(base_url=BASE_URL, api_key=API_KEY)
    client = (
        instructor.from_openai(openai_client)
        if mode is None
        else instructor.from_openai(openai_client, mode=mode)
    )
    answer = client.chat.completions.create(
        model=MODEL,
        response_model=CityInfo,
        messages=[{"role": "user", "content": EXTRACT_PROMPT}],
        temperature=0.0,
        max_tokens=MAX_TOKENS,
    )
    return isinstance(answer, CityInfo), answer, {"mode": str(client.mode)}


if __name__ == "__main__":
    raise SystemExit(
        run_case(
            {
                "default_tools": lambda: extract(None),
                "json_schema": lambda: extract(instructor.Mode.JSON_SCHEMA),
                "json": lambda: extract(instructor.Mode.JSON),
                "tools_strict": lambda: extract(instructor.Mode.TOOLS_STRICT),
                "responses_tools": lambda: extract(instructor.Mode.RESPONSES_TOOLS),
            }
        )
    )
