"""`iterserve run-batch -i requests.jsonl -o answers.jsonl [MODEL]`: answer a file of OpenAI
batch requests offline, as vLLM's `run-batch` does: chat, completions, embeddings, Responses
and scores, one answer a line (server/batch_lines.py says the format).

Each line goes through the server's own app, in this process and without a socket
(httpx's ASGI transport), so a line is checked, rendered, sampled and answered exactly as
`iterserve serve` would answer it, 4xx included. Lines are sent while earlier ones run, at
most `2 x --max-num-seqs` (times the replicas) at once, so the engine's batches stay full
without the whole file waiting in memory; each answer is written as it finishes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from iterserve.cli import serve as server_cli
from iterserve.server.batch_lines import BatchLine, answered, not_sent, parse_line

if TYPE_CHECKING:
    from fastapi import FastAPI

_MOST_WAIT_S = 5.0  # the longest a 429's Retry-After holds a line back


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run-batch",
        help="answer a JSONL file of OpenAI batch requests offline (vLLM's run-batch)",
        description="Answer a file of OpenAI batch requests (one JSON object a line: "
        "custom_id, method, url, body), writing one answer a line, as vLLM's run-batch.",
    )
    p.add_argument(
        "-i", "--input-file", required=True, help="the requests, a JSONL file (- : stdin)"
    )
    p.add_argument("-o", "--output-file", required=True, help="where the answers go (- : stdout)")
    server_cli.add_model_args(p, "to answer with")
    p.set_defaults(func=run_batch)


@dataclass
class BatchCounts:
    """What a run did, for its closing line."""

    lines: int = 0
    answered: int = 0  # 2xx
    refused: int = 0  # answered with a 4xx or 5xx
    not_sent: int = 0  # lines that could not be sent
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, record: dict[str, Any]) -> None:
        self.lines += 1
        response = record["response"]
        if response is None:
            self.not_sent += 1
            return
        if response["status_code"] >= 400:
            self.refused += 1
            return
        self.answered += 1
        usage = response["body"].get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
        self.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0


def run_batch(args: argparse.Namespace) -> int:
    from iterserve.server.app import ServerSettings, create_app
    from iterserve.server.response_store import IN_MEMORY

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":  # a line each would bury the progress and the summary
        logging.getLogger("iterserve.access").setLevel(logging.WARNING)
    in_flight = 2 * args.max_num_seqs * args.data_parallel_size
    # What launch_engine queues at most: room for every line in flight and for as many
    # more, since a line's answer can be out before the engine has let its request go.
    args.max_waiting_requests = 2 * in_flight
    with _opened(args.input_file, "r") as source, _opened(args.output_file, "w") as out:
        async_engine = server_cli.launch_engine(args)
        settings = ServerSettings(responses_store=IN_MEMORY, **server_cli.answer_settings(args))
        app = create_app(async_engine, settings)
        start = time.monotonic()
        try:
            counts = asyncio.run(_answer_all(app, _lines(source), out, in_flight))
        finally:
            async_engine.close()
    seconds = time.monotonic() - start
    print(
        f"run-batch: {counts.lines} lines: {counts.answered} answered, {counts.refused} "
        f"refused (4xx/5xx), {counts.not_sent} not sent; {counts.prompt_tokens} prompt and "
        f"{counts.completion_tokens} generated tokens in {seconds:.1f} s "
        f"({counts.completion_tokens / max(seconds, 1e-9):.1f} generated tok/s)",
        file=sys.stderr,
    )
    return 0


@contextlib.contextmanager
def _opened(name: str, mode: str) -> Iterator[IO[str]]:
    if name == "-":
        yield sys.stdin if mode == "r" else sys.stdout
        return
    try:
        with open(name, mode, encoding="utf-8") as handle:
            yield handle
    except OSError as error:
        raise SystemExit(f"iterserve run-batch: {error}") from None


def _lines(source: IO[str]) -> Iterator[tuple[int, str]]:
    """The input's non-blank lines, numbered from 1 as an editor counts them."""
    for number, text in enumerate(source, 1):
        if text.strip():
            yield number, text


async def _answer_all(
    app: FastAPI, lines: Iterator[tuple[int, str]], out: IO[str], in_flight: int
) -> BatchCounts:
    """Send every line through `app` (at most `in_flight` at once), writing each answer as
    it finishes; the engine starts and stops with the app's own lifespan."""
    import httpx
    from tqdm import tqdm

    counts = BatchCounts()
    slots = asyncio.Semaphore(in_flight)
    seen: set[str] = set()
    running: set[asyncio.Task[None]] = set()
    progress = tqdm(desc="run-batch", unit=" lines", file=sys.stderr, disable=None)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client,
    ):

        async def answer(line: BatchLine) -> None:
            try:
                record = not_sent(line) if line.problem else await send_line(client, line)
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                counts.add(record)
                progress.update()
            finally:
                slots.release()

        for number, text in lines:
            await slots.acquire()
            task = asyncio.create_task(answer(parse_line(number, text, seen)))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)
    progress.close()
    return counts


def _retry_after(header: str | None) -> float:
    """Seconds to wait by a Retry-After header (seconds; another form: one second)."""
    try:
        return min(max(float(header or 1), 0.0), _MOST_WAIT_S)
    except ValueError:
        return 1.0


async def send_line(client: Any, line: BatchLine) -> dict[str, Any]:
    """The line's answer; a 429 (the engine's queue full for a moment) is asked again after
    the Retry-After it names, as a client of the server would: a batch loses no line to it."""
    while (response := await client.post(line.url, json=line.body)).status_code == 429:
        await asyncio.sleep(_retry_after(response.headers.get("retry-after")))
    try:
        body = response.json()
    except ValueError:  # not JSON (a 500 from outside the app's handlers): its text
        body = {"error": {"message": response.text, "type": "server_error"}}
    return answered(line, response.status_code, body)
