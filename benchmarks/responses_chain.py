"""How much of a Responses chain's prompt the prefix cache serves: one conversation of
`--turns` turns on the bundled model, sent two ways to a server started for the run.

  chained    each turn names the previous one (`previous_response_id`): the server starts
             the prompt with the tokens the previous turn ran (prompt and answer)
  resent     the same conversation, each turn sending the whole history as input items
             (stateless, as a client without stored responses does): the server renders
             and encodes the history again; run after /reset_prefix_cache, on the chained
             run's answers (greedy, so the same turns)

Per turn it prints the prompt's tokens and the tokens found in the prefix cache (the
response's usage.input_tokens_details.cached_tokens), and per way the /metrics counters
iterserve:prefix_cache_hits_total / prefix_cache_queries_total over its turns; writes
JSON. Asserts nothing.

    .venv/bin/python benchmarks/responses_chain.py [--turns 10] [--max-output-tokens 64] \
        [--out benchmarks/results/responses_chain.json]
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx
from openai import OpenAI

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.server_process import launch_server, scrape_metrics
from iterserve.config import EngineConfig

QUESTIONS = [
    "Name a country in Europe.",
    "What is its capital?",
    "Name a river that runs through it.",
    "How long is that river, roughly?",
    "Name a famous building in the capital.",
    "When was it built?",
    "Who designed it?",
    "Name another work by that person.",
    "Where is that work?",
    "Summarise our conversation in one sentence.",
    "Name a dish from that country.",
    "What is in it?",
]
HITS, QUERIES = "iterserve:prefix_cache_hits_total", "iterserve:prefix_cache_queries_total"


def counters(base_url: str) -> tuple[float, float]:
    metrics = scrape_metrics(base_url)
    return metrics[HITS], metrics[QUERIES]


def turn_row(response: Any) -> dict[str, int]:
    usage = response.usage
    return {
        "input_tokens": usage.input_tokens,
        "cached_tokens": usage.input_tokens_details.cached_tokens,
        "output_tokens": usage.output_tokens,
    }


def run_chained(client: OpenAI, model: str, turns: int, max_tokens: int) -> list[Any]:
    responses: list[Any] = []
    for question in QUESTIONS[:turns]:
        responses.append(
            client.responses.create(
                model=model,
                input=question,
                previous_response_id=responses[-1].id if responses else None,
                max_output_tokens=max_tokens,
                temperature=0,
            )
        )
    return responses


def run_resent(client: OpenAI, model: str, chained: list[Any], max_tokens: int) -> list[Any]:
    history: list[dict[str, str]] = []
    responses = []
    for question, previous in zip(QUESTIONS, chained, strict=False):
        history.append({"role": "user", "content": question})
        responses.append(
            client.responses.create(
                model=model,
                input=history,  # type: ignore[arg-type]
                max_output_tokens=max_tokens,
                temperature=0,
                store=False,
            )
        )
        history.append({"role": "assistant", "content": previous.output_text})
    return responses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/responses_chain.json")
    args = parser.parse_args()
    if not 1 <= args.turns <= len(QUESTIONS):
        parser.error(f"--turns must be from 1 to {len(QUESTIONS)}")

    results: dict[str, Any] = {"turns": args.turns, "max_output_tokens": args.max_output_tokens}
    with launch_server(EngineConfig(), extra_args=["--responses-store", ":memory:"]) as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        chained: list[Any] = []
        for way in ("chained", "resent"):
            httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=30).raise_for_status()
            hits, queries = counters(server.base_url)
            if way == "chained":
                chained = responses = run_chained(client, model, args.turns, args.max_output_tokens)
            else:
                responses = run_resent(client, model, chained, args.max_output_tokens)
            after_hits, after_queries = counters(server.base_url)
            rows = [turn_row(response) for response in responses]
            results[way] = {
                "per_turn": rows,
                "hits": after_hits - hits,
                "queries": after_queries - queries,
                "hit_rate": (after_hits - hits) / max(1.0, after_queries - queries),
            }

    print(f"{'turn':>4}  {'prompt':>6}  {'chained hit':>11}  {'resent hit':>10}")
    for turn, (a, b) in enumerate(
        zip(results["chained"]["per_turn"], results["resent"]["per_turn"], strict=True), 1
    ):
        print(
            f"{turn:>4}  {a['input_tokens']:>6}  {a['cached_tokens'] / a['input_tokens']:>11.1%}"
            f"  {b['cached_tokens'] / b['input_tokens']:>10.1%}"
        )
    for way in ("chained", "resent"):
        r = results[way]
        print(
            f"{way}: prefix cache {r['hits']:.0f} of {r['queries']:.0f} prompt tokens "
            f"({r['hit_rate']:.1%})"
        )
    write_results(args.out, results)


if __name__ == "__main__":
    main()
