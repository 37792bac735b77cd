"""LiteLLM (`litellm.completion`, what CrewAI, DSPy, smolagents and Aider call underneath, and
what LiteLLM's proxy runs) pointed at the server by each of the providers a user would pick
for it: `openai/` and `hosted_vllm/` (the OpenAI API at /v1), `ollama_chat/` (Ollama's
/api/chat) and `ollama/` (Ollama's /api/generate, /api/embed). The tool loop: the tools
passed and (OpenAI API) the first turn's call named, the call run and its result fed back
for the answer, streamed too (the chunks put together by `litellm.stream_chunk_builder`);
structured output by a pydantic class as `response_format`; embeddings."""

from __future__ import annotations

import json
import os
from typing import Any

# LiteLLM fetches its model price list from GitHub at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
from _scenario import (  # noqa: E402
    API_KEY,
    BASE_URL,
    EXTRACT_PROMPT,
    MAX_TOKENS,
    MODEL,
    OLLAMA_BASE_URL,
    CityInfo,
    get_time,
    get_weather,
    run_case,
)

TOOLS = {"get_weather": get_weather, "get_time": get_time}
TOOL_SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": function.__doc__,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city"}},
                "required": ["city"],
            },
        },
    }
    for name, function in TOOLS.items()
]


def where(provider: str) -> dict[str, Any]:
    """The model and endpoint arguments for a provider."""
    if provider.startswith("ollama"):
        return {"model": f"{provider}/{MODEL}", "api_base": OLLAMA_BASE_URL}
    return {"model": f"{provider}/{MODEL}", "api_base": BASE_URL, "api_key": API_KEY}


def complete(provider: str, messages: list[Any], streamed: bool = False, **more: Any) -> Any:
    arguments = {**where(provider), "messages": messages, "temperature": 0.0}
    arguments |= {"max_tokens": MAX_TOKENS, **more}
    if not streamed:
        return litellm.completion(**arguments)
    chunks = list(litellm.completion(**arguments, stream=True))
    return litellm.stream_chunk_builder(chunks, messages=messages)


def tools(provider: str, streamed: bool = False) -> tuple[bool, object, dict[str, Any]]:
    """The tools passed and, where the API has tool_choice, the first turn's call named;
    Ollama's API has none, so there a first answer in text is an answer too."""
    forced = not provider.startswith("ollama")
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}} if forced else None
    first = complete(provider, messages, streamed, tools=TOOL_SCHEMAS, tool_choice=choice)
    message = first.choices[0].message
    if not message.tool_calls:
        if forced:
            return False, message, {"stage": "no tool call in the forced answer"}
        return bool(message.content), message.content, {"first_calls": []}
    messages.append(message)
    for call in message.tool_calls:
        result = TOOLS[call.function.name](**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                         "content": result})  # fmt: skip
    final = complete(provider, messages, tools=TOOL_SCHEMAS).choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    return (
        bool(final.content or final.tool_calls),
        final.content or final.tool_calls,
        {"first_calls": calls},
    )


def structured(provider: str) -> tuple[bool, object, dict[str, Any]]:
    messages = [{"role": "user", "content": EXTRACT_PROMPT}]
    answer = complete(provider, messages, response_format=CityInfo)
    city = CityInfo.model_validate_json(answer.choices[0].message.content)
    return True, city, {}


def generate(provider: str) -> tuple[bool, object, dict[str, Any]]:
    answer = complete(provider, [{"role": "user", "content": "Name three colours."}])
    text = answer.choices[0].message.content
    return bool(text), text, {"finish_reason": answer.choices[0].finish_reason}


def embedding(provider: str) -> tuple[bool, object, dict[str, Any]]:
    answer = litellm.embedding(**where(provider), input=["red", "blue"])
    vectors = [item["embedding"] for item in answer.data]
    finished = len(vectors) == 2 and all(len(v) > 0 for v in vectors)
    return finished, [len(v) for v in vectors], {}


if __name__ == "__main__":
    raise SystemExit(
        run_case(
            {
                "openai_tools": lambda: tools("openai"),
                "openai_tools_streamed": lambda: tools("openai", streamed=True),
                "openai_embedding": lambda: embedding("openai"),
                "hosted_vllm_tools": lambda: tools("hosted_vllm"),
                "hosted_vllm_structured": lambda: structured("hosted_vllm"),
                "ollama_chat_tools": lambda: tools("ollama_chat"),
                "ollama_chat_tools_streamed": lambda: tools("ollama_chat", streamed=True),
                "ollama_chat_structured": lambda: structured("ollama_chat"),
                "ollama_generate": lambda: generate("ollama"),
                "ollama_embedding": lambda: embedding("ollama"),
            }
        )
    )
