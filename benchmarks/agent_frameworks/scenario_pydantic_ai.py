"""pydantic-ai: an `Agent` with `output_type=CityInfo` on the OpenAI provider pointed at
the server: the default output (a forced output tool), `NativeOutput` (response_format
json_schema), the default output streamed (`run_stream`), and the default output through
the Responses model class; and on the Anthropic provider (Anthropic's Messages API), the
default output, whole and streamed."""

from __future__ import annotations

import asyncio
from typing import Any

from _scenario import (
    ANTHROPIC_BASE_URL,
    API_KEY,
    BASE_URL,
    EXTRACT_PROMPT,
    MAX_TOKENS,
    MODEL,
    CityInfo,
    run_case,
)
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models import Model
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings


def provider() -> OpenAIProvider:
    return OpenAIProvider(base_url=BASE_URL, api_key=API_KEY)


def anthropic() -> AnthropicModel:
    return AnthropicModel(
        MODEL, provider=AnthropicProvider(base_url=ANTHROPIC_BASE_URL, api_key=API_KEY)
    )


def run(model: Model, output_type: Any) -> tuple[bool, object, dict[str, Any]]:
    agent = Agent(
        model,
        output_type=output_type,
        model_settings=ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    result = agent.run_sync(EXTRACT_PROMPT)
    return isinstance(result.output, CityInfo), result.output, {}


async def streamed(model: Model) -> tuple[bool, object, dict[str, Any]]:
    agent = Agent(
        model,
        output_type=CityInfo,
        model_settings=ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    async with agent.run_stream(EXTRACT_PROMPT) as result:
        output = await result.get_output()
    return isinstance(output, CityInfo), output, {}


if __name__ == "__main__":
    raise SystemExit(
        run_case(
            {
                "tool_output": lambda: run(OpenAIChatModel(MODEL, provider=provider()), CityInfo),
                "native_output": lambda: run(
                    OpenAIChatModel(MODEL, provider=provider()), NativeOutput(CityInfo)
                ),
                "tool_output_streamed": lambda: asyncio.run(
                    streamed(OpenAIChatModel(MODEL, provider=provider()))
                ),
                "responses": lambda: run(
                    OpenAIResponsesModel(MODEL, provider=provider()), CityInfo
                ),
                "anthropic": lambda: run(anthropic(), CityInfo),
                "anthropic_streamed": lambda: asyncio.run(streamed(anthropic())),
            }
        )
    )
