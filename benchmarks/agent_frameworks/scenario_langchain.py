"""LangChain's `ChatOpenAI` pointed at the server: `bind_tools` with a forced call
(`tool_choice` naming the tool), the tool run and its result fed back for the answer;
and `with_structured_output(CityInfo)` by `json_schema` (response_format) and by
`function_calling` (a forced tool call). The tool case runs streamed too (the chunks
added up, with `stream_usage`), and through the Responses API (`use_responses_api`).
`ChatAnthropic` (langchain-anthropic, Anthropic's Messages API) runs the tool case,
streamed and not, and structured output (a forced tool). `ChatOllama` (langchain-ollama,
Ollama's /api/chat) runs structured output by `json_schema` (Ollama's `format`) and a chat
with the tools bound, streamed and not (Ollama's API has no tool_choice: the model decides
whether it calls; its calls, if any, are run and fed back)."""

from __future__ import annotations

from typing import Any

from _scenario import (
    ANTHROPIC_BASE_URL,
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
from langchain_anthropic import ChatAnthropic
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI


def llm(**options: Any) -> BaseChatModel:
    if options.pop("ollama", False):
        return ChatOllama(
            model=MODEL, base_url=OLLAMA_BASE_URL, temperature=0.0, num_predict=MAX_TOKENS
        )
    if options.pop("anthropic", False):
        return ChatAnthropic(
            model_name=MODEL,
            base_url=ANTHROPIC_BASE_URL,
            api_key=API_KEY,
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            **options,
        )
    return ChatOpenAI(
        model=MODEL,
        base_url=BASE_URL,
        api_key=API_KEY,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        **options,
    )


def bind_tools(
    streamed: bool = False, forced: bool = True, **options: Any
) -> tuple[bool, object, dict[str, Any]]:
    """The tools bound and (`forced`) the first turn's call named: the call run, its result
    fed back for the answer. Unforced (Ollama's API has no tool_choice), a first answer in
    text is an answer too."""
    tools = {t.name: t for t in (tool(get_weather), tool(get_time))}
    messages: list[BaseMessage] = [HumanMessage("What is the weather in Paris?")]
    bound = llm(**options).bind_tools(list(tools.values()))
    first_turn = (
        llm(**options).bind_tools(list(tools.values()), tool_choice="get_weather")
        if forced
        else bound
    )
    if streamed:
        chunks = list(first_turn.stream(messages))
        first: BaseMessage = chunks[0]
        for chunk in chunks[1:]:
            first = first + chunk  # type: ignore[operator]
    else:
        first = first_turn.invoke(messages)
    assert isinstance(first, AIMessage)
    if not first.tool_calls:
        if forced:
            return False, first, {"stage": "no tool call in the forced answer"}
        return bool(first.content), first.content, {"first_calls": []}
    messages.append(first)
    for call in first.tool_calls:
        result = tools[call["name"]].invoke(call["args"])
        messages.append(ToolMessage(result, tool_call_id=call["id"]))
    final = bound.invoke(messages)
    finished = isinstance(final, AIMessage) and bool(final.content or final.tool_calls)
    return finished, final.content or final.tool_calls, {"first_calls": first.tool_calls}


def structured(method: str, **options: Any) -> tuple[bool, object, dict[str, Any]]:
    model = llm(**options).with_structured_output(CityInfo, method=method)  # type: ignore[arg-type]
    answer = model.invoke(EXTRACT_PROMPT)
    return isinstance(answer, CityInfo), answer, {}


if __name__ == "__main__":
    raise SystemExit(
        run_case(
            {
                "bind_tools": bind_tools,
                "bind_tools_streamed": lambda: bind_tools(streamed=True, stream_usage=True),
                "responses_api_bind_tools": lambda: bind_tools(use_responses_api=True),
                "structured_json_schema": lambda: structured("json_schema"),
                "structured_function_calling": lambda: structured("function_calling"),
                "anthropic_bind_tools": lambda: bind_tools(anthropic=True),
                "anthropic_bind_tools_streamed": lambda: bind_tools(streamed=True, anthropic=True),
                "anthropic_structured": lambda: structured("function_calling", anthropic=True),
                "ollama_tools": lambda: bind_tools(forced=False, ollama=True),
                "ollama_tools_streamed": lambda: bind_tools(True, forced=False, ollama=True),
                "ollama_structured": lambda: structured("json_schema", ollama=True),
            }
        )
    )
