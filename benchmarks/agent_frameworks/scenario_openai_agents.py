"""OpenAI Agents SDK: one agent with two function tools over a conversation of two
turns, each turn a forced tool call (the SDK's `ModelSettings.tool_choice`, reset to
auto after the call by the SDK's default `reset_tool_choice`), the tool's result, then
the agent's answer. Run with the Responses model class and the chat completions model
class, streamed or not; then an agent with a typed output (`output_type`) on each, the
conversation chained by `previous_response_id`, and kept on the server by the
Conversations API (an OpenAIConversationsSession, and a run given `conversation_id`).
Tracing is off (it would upload to OpenAI)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from _scenario import (
    API_KEY,
    BASE_URL,
    CALLS,
    EXTRACT_PROMPT,
    MAX_TOKENS,
    MODEL,
    CityInfo,
    get_time,
    get_weather,
    run_case,
)
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIConversationsSession,
    OpenAIResponsesModel,
    Runner,
    RunResult,
    RunResultStreaming,
    function_tool,
    set_tracing_disabled,
)
from agents.models.interface import Model
from openai import AsyncOpenAI

set_tracing_disabled(True)

TURNS = [
    ("What is the weather in Paris?", "get_weather"),
    ("And what time is it in Tokyo?", "get_time"),
]


def city_agent(model: Model) -> Agent:
    return Agent(
        name="assistant",
        instructions="You answer questions about cities. Use the tools.",
        model=model,
        tools=[function_tool(get_weather), function_tool(get_time)],
    )


def settings(tool: str) -> ModelSettings:
    return ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS, tool_choice=tool)


async def conversation(model: Model, streamed: bool) -> tuple[bool, object, dict[str, Any]]:
    agent = city_agent(model)
    history: list[Any] = []
    answers: list[object] = []
    for question, tool in TURNS:
        turn_agent = agent.clone(model_settings=settings(tool))
        run_input = [*history, {"role": "user", "content": question}]
        result: RunResult | RunResultStreaming
        if streamed:
            result = Runner.run_streamed(turn_agent, run_input, max_turns=4)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(turn_agent, run_input, max_turns=4)
        answers.append(result.final_output)
        history = result.to_input_list()
    called = [name for name, _ in CALLS]
    finished = (
        all(isinstance(answer, str) and answer.strip() for answer in answers)
        and "get_weather" in called
        and "get_time" in called
    )
    return finished, answers, {"history_items": len(history)}


async def typed_output(model: Model) -> tuple[bool, object, dict[str, Any]]:
    """An agent whose final output is a pydantic model (the SDK asks for a JSON schema
    format: Responses' `text.format`, chat's `response_format`)."""
    agent = Agent(
        name="extractor",
        instructions="Extract the city and its country.",
        model=model,
        output_type=CityInfo,
        model_settings=ModelSettings(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    result = await Runner.run(agent, EXTRACT_PROMPT)
    return isinstance(result.final_output, CityInfo), result.final_output, {}


async def chained(model: Model) -> tuple[bool, object, dict[str, Any]]:
    """The conversation of `conversation`, but each turn after the first sends only the new
    input and `previous_response_id` (the SDK's server-side chaining, asked for here; by
    default the SDK sends the whole history and no `store`)."""
    answers = await run_turns(
        model,
        lambda last: {
            "previous_response_id": last.last_response_id if last else None,
            "auto_previous_response_id": True,
        },
    )
    return both_answered(answers), answers, {}


async def kept(model: Model, session: bool) -> tuple[bool, object, dict[str, Any]]:
    """The conversation of `conversation`, its turns kept on the server by the
    Conversations API: in an OpenAIConversationsSession (the SDK reads and adds the items),
    or in a conversation a run names by `conversation_id` (the server reads and adds them)."""
    api = client()
    memory = OpenAIConversationsSession(openai_client=api) if session else None
    conversation_id = None if memory else (await api.conversations.create()).id
    answers = await run_turns(
        model, lambda _: {"session": memory, "conversation_id": conversation_id}
    )
    kept_id = memory.session_id if memory else conversation_id
    items = [item async for item in api.conversations.items.list(str(kept_id), order="asc")]
    roles = [getattr(item, "role", item.type) for item in items]
    finished = both_answered(answers) and roles.count("user") == len(TURNS)
    return finished, answers, {"items": roles}


async def run_turns(
    model: Model, options: Callable[[RunResult | None], dict[str, Any]]
) -> list[object]:
    """TURNS on the city agent, each with its tool forced and `options(the last turn's
    result)` (how the server keeps the history): the answers."""
    agent = city_agent(model)
    answers: list[object] = []
    last: RunResult | None = None
    for question, tool in TURNS:
        last = await Runner.run(
            agent.clone(model_settings=settings(tool)), question, max_turns=4, **options(last)
        )
        answers.append(last.final_output)
    return answers


def both_answered(answers: list[object]) -> bool:
    """Every turn ended in a text answer, and both tools ran."""
    finished = all(isinstance(answer, str) and answer.strip() for answer in answers)
    return finished and {"get_weather", "get_time"} <= {n for n, _ in CALLS}


def client() -> AsyncOpenAI:
    return AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY)


def responses() -> tuple[bool, object, dict[str, Any]]:
    return asyncio.run(conversation(OpenAIResponsesModel(MODEL, client()), streamed=False))


def responses_streamed() -> tuple[bool, object, dict[str, Any]]:
    return asyncio.run(conversation(OpenAIResponsesModel(MODEL, client()), streamed=True))


def chat() -> tuple[bool, object, dict[str, Any]]:
    return asyncio.run(conversation(OpenAIChatCompletionsModel(MODEL, client()), streamed=False))


def chat_streamed() -> tuple[bool, object, dict[str, Any]]:
    return asyncio.run(conversation(OpenAIChatCompletionsModel(MODEL, client()), streamed=True))


def responses_output_type() -> tuple[bool, object, dict[str, Any]]:
    return asyncio.run(typed_output(OpenAIResponsesModel(MODEL, client())))


def chat_output_type() -> tuple[bool, object, dict[str, Any]]:
    return asyncio.run(typed_output(OpenAIChatCompletionsModel(MODEL, client())))


def responses_chained() -> tuple[bool, object, dict[str, Any]]:
    return asyncio.run(chained(OpenAIResponsesModel(MODEL, client())))


def responses_conversations_session() -> tuple[bool, object, dict[str, Any]]:
    return asyncio.run(kept(OpenAIResponsesModel(MODEL, client()), session=True))


def responses_conversation_id() -> tuple[bool, object, dict[str, Any]]:
    return asyncio.run(kept(OpenAIResponsesModel(MODEL, client()), session=False))


if __name__ == "__main__":
    raise SystemExit(
        run_case(
            {
                "responses": responses,
                "responses_streamed": responses_streamed,
                "chat": chat,
                "chat_streamed": chat_streamed,
                "responses_output_type": responses_output_type,
                "chat_output_type": chat_output_type,
                "responses_chained": responses_chained,
                "responses_conversations_session": responses_conversations_session,
                "responses_conversation_id": responses_conversation_id,
            }
        )
    )
