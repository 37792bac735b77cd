"""What every scenario shares: where the server is, the tasks' tools and output types,
and how a scenario reports (one `AGENT_RESULT {json}` line on stdout, read by run.py).

Runs in the frameworks' venv (not iterserve's), so it imports only pydantic and the
standard library."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

RESULT_MARK = "AGENT_RESULT "

BASE_URL = os.environ.get("AGENTS_BASE_URL", "http://127.0.0.1:8000/v1")
# Anthropic's clients add /v1 themselves.
ANTHROPIC_BASE_URL = BASE_URL.removesuffix("/v1")
# Ollama's clients too (its API is under /api).
OLLAMA_BASE_URL = ANTHROPIC_BASE_URL
MODEL = os.environ.get("AGENTS_MODEL", "SmolLM2-135M-Instruct")
API_KEY = "sk-dummy-key"  # the server runs without --api-key; clients insist on one
# Deterministic and short: greedy, and few enough tokens that a loop ends quickly.
MAX_TOKENS = int(os.environ.get("AGENTS_MAX_TOKENS", "96"))

# ---- the tasks --------------------------------------------------------------------------

CALLS: list[tuple[str, dict[str, Any]]] = []  # every tool the framework ran, in order


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    CALLS.append(("get_weather", {"city": city}))
    return f"The weather in {city} is sunny, 21 C."


def get_time(city: str) -> str:
    """Get the current local time in a city."""
    CALLS.append(("get_time", {"city": city}))
    return f"It is 14:05 in {city}."


class CityInfo(BaseModel):
    """A city and the country it is in."""

    city: str = Field(description="the city's name")
    country: str = Field(description="the country the city is in")


EXTRACT_PROMPT = "Paris is the capital of France. Extract the city and its country."

# ---- reporting --------------------------------------------------------------------------


def report(finished: bool, output: object = None, error: str | None = None, **notes: Any) -> None:
    line = {
        "finished": finished,
        "output": None if output is None else _short(repr(output)),
        "error": error,
        "tool_calls": [name for name, _ in CALLS],
        "notes": notes,
    }
    print(RESULT_MARK + json.dumps(line, default=str), flush=True)


def _short(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def run_case(cases: dict[str, Callable[[], tuple[bool, object, dict[str, Any]]]]) -> int:
    """Runs the case named by --case; a case returns (finished, output, notes) or raises.
    An exception is a failure whose type and message are the report's `error`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(cases), required=True)
    args = parser.parse_args()
    try:
        finished, output, notes = cases[args.case]()
    except BaseException as error:  # noqa: BLE001 - every failure is the finding
        traceback.print_exc(file=sys.stderr)
        report(False, error=_short(f"{type(error).__name__}: {error}", 1500))
        return 1
    report(finished, output, None if finished else "the result has the wrong shape", **notes)
    return 0 if finished else 1
