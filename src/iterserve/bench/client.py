"""Async streaming load client for any OpenAI-compatible server (iterserve, vLLM, llama.cpp).

Each request is a streamed `/v1/completions` call with `stream_options.include_usage`, so
the server's own token count arrives in the last chunk; TTFT and the gaps between chunks
are measured here, on the client, which is what a user of the server experiences.

The transport is aiohttp, as in vLLM's and SGLang's serving benchmarks: the client shares
this machine's two cores with the server it measures, and per streamed token aiohttp costs
0.24-0.28 ms of CPU where httpx (pure-Python HTTP parsing) cost 0.51-0.61
(`benchmarks/served_overhead.py` prints the client's CPU per token).

Prompts are sent as token-id lists by default (exact lengths whatever the server's text
handling; the completions API accepts them); a workload built with prompt_format="text"
sends text that re-tokenizes to the same ids.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
from tqdm import tqdm

from iterserve.bench.arrivals import ArrivalSpec
from iterserve.bench.metrics import compute_metrics
from iterserve.bench.records import RequestRecord, RunResult
from iterserve.bench.report import BenchReport
from iterserve.bench.workloads import Workload, WorkloadRequest


@dataclass
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str | None = None  # None: the first model the server lists
    ignore_eos: bool = True  # exact output lengths (a vLLM/iterserve extension field)
    temperature: float = 0.0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    # Request field that carries a non-interactive lane; None never sends one.
    lane_field: str | None = "lane"
    timeout: float = 600.0
    num_warmups: int = 1
    progress: bool = True

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def api_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else root + "/v1"


async def resolve_model(client: aiohttp.ClientSession, config: ClientConfig) -> str:
    if config.model:
        return config.model
    try:
        async with client.get(f"{config.api_root}/models") as response:
            response.raise_for_status()
            models = (await response.json()).get("data") or []
    except aiohttp.ClientConnectionError as err:
        raise ConnectionError(f"cannot reach the server at {config.base_url}: {err}") from None
    if not models:
        raise ValueError(f"{config.api_root}/models lists no model; pass --model")
    return models[0]["id"]


def request_body(config: ClientConfig, model: str, request: WorkloadRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        # Decoding past EOS produces special tokens, which a server drops from the text and
        # may then not stream at all: the client would see one long gap where there were many
        # short ones. Asking for them as text keeps one chunk per token.
        body["ignore_eos"] = True
        body["skip_special_tokens"] = False
    if config.lane_field and request.lane != "interactive":
        body[config.lane_field] = request.lane
    return body | config.extra_body


def parse_sse_line(line: str | bytes) -> dict[str, Any] | None:
    """One `data: {...}` line -> its JSON; None for comments, events and `[DONE]`."""
    if isinstance(line, bytes):
        line = line.decode()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def _session(config: ClientConfig, **connector: Any) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        # Per connect and per read, as before with httpx: a long stream is not cut short.
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=config.timeout, sock_read=config.timeout
        ),
        headers=config.headers,
        connector=aiohttp.TCPConnector(limit=0, **connector),
        read_bufsize=1 << 20,  # one SSE line can carry many logprobs
    )


# Raised while sending, before any response: on a pooled keep-alive connection this is
# the server having closed it meanwhile ("Server disconnected").
_NEVER_ANSWERED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


class _NeverAnsweredError(Exception):
    """The request got no response at all; it may be sent again."""


async def stream_request(
    client: aiohttp.ClientSession,
    config: ClientConfig,
    model: str,
    request: WorkloadRequest,
    record: RequestRecord,
    origin: float,
) -> bool:
    """Send one request and fill `record` in; returns whether the server reported usage.

    A request that got no response at all, because the pooled connection it went out on
    had been closed by the server, is sent once more on a fresh connection: nothing was
    generated for it, so nothing is counted twice. Its latency counts from the first try.
    """
    body = request_body(config, model, request)
    try:
        return await _send(client, config, body, record, origin)
    except _NeverAnsweredError:
        record.retried = True
    async with _session(config, force_close=True) as fresh:
        try:
            return await _send(fresh, config, body, record, origin)
        except _NeverAnsweredError as err:
            cause = err.__cause__
            record.error = f"{type(cause).__name__}: {cause} (retried on a fresh connection)"[:300]
            return False


async def _send(
    client: aiohttp.ClientSession,
    config: ClientConfig,
    body: dict[str, Any],
    record: RequestRecord,
    origin: float,
) -> bool:
    try:
        try:
            resp = await client.post(f"{config.api_root}/completions", json=body)
        except _NEVER_ANSWERED as err:
            raise _NeverAnsweredError from err
        async with resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                record.error = f"HTTP {resp.status}: {_error_message(text)}"[:300]
                return False
            return await _read_stream(resp, record, origin)
    except (aiohttp.ClientError, json.JSONDecodeError, OSError, TimeoutError) as err:
        record.error = f"{type(err).__name__}: {err}"[:300]
        return False


def _error_message(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself."""
    try:
        error = json.loads(text)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return text.strip()


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord, origin: float) -> bool:
    got_usage = False
    async for line in resp.content:
        chunk = parse_sse_line(line)
        if chunk is None:
            continue
        now = time.perf_counter() - origin
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            record.error = f"error in the stream: {message}"[:300]
            return got_usage
        choices = chunk.get("choices") or []
        # A chunk carries a token unless it is only a finish marker after others: an
        # empty-text chunk mid-stream is a token whose bytes the server held back (half
        # a UTF-8 character), and its gap still belongs to TBT; a lone finish chunk is
        # the first output the client sees at all.
        if choices and (
            choices[0].get("text")
            or choices[0].get("finish_reason") is None
            or record.first_token_time is None
        ):
            if record.first_token_time is None:
                record.first_token_time = now
            record.token_times.append(now)
        usage = chunk.get("usage")
        if usage:
            got_usage = True
            record.output_len = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                record.num_cached_tokens = int(details["cached_tokens"])
            predicted = usage.get("completion_tokens_details") or {}
            if predicted.get("accepted_prediction_tokens") is not None:
                accepted = int(predicted["accepted_prediction_tokens"])
                record.num_accepted_tokens = accepted
                record.num_draft_tokens = accepted + int(
                    predicted.get("rejected_prediction_tokens") or 0
                )
    record.finish_time = time.perf_counter() - origin
    if not got_usage:
        record.output_len = len(record.token_times)
    record.success = record.first_token_time is not None
    if not record.success:
        record.error = "the stream ended without a token"
    return got_usage


async def run_client_async(
    config: ClientConfig,
    workload: Workload,
    offsets: list[float],
    max_concurrency: int | None = None,
) -> RunResult:
    async with _session(config) as client:
        model = await resolve_model(client, config)
        if workload.warmup is not None and config.num_warmups > 0:
            await _warm_up(client, config, model, workload.warmup)

        records = [
            RequestRecord(f"bench-{i}", r.prompt_len, r.output_len, r.lane, offsets[i])
            for i, r in enumerate(workload.requests)
        ]
        bar = tqdm(total=len(records), desc="requests", unit="req", disable=not config.progress)
        seats = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        usage_seen: dict[str, bool] = {}

        async def one(request: WorkloadRequest, record: RequestRecord, origin: float) -> None:
            try:
                usage_seen[record.request_id] = await stream_request(
                    client, config, model, request, record, origin
                )
            finally:
                if seats is not None:
                    seats.release()
                bar.update(1)

        origin = time.perf_counter()
        tasks = []
        for request, record in zip(workload.requests, records, strict=True):
            delay = origin + record.scheduled_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if seats is not None:
                await seats.acquire()  # in arrival order: a capped request waits its turn
            record.arrival_time = time.perf_counter() - origin
            tasks.append(asyncio.create_task(one(request, record, origin)))
        await asyncio.gather(*tasks)
        bar.close()
    return RunResult(records, model, _notes(records, usage_seen))


async def _warm_up(
    client: aiohttp.ClientSession, config: ClientConfig, model: str, request: WorkloadRequest
) -> None:
    # Sent together: a static-batching server starts nothing until a batch is full.
    warm = [RequestRecord("warmup", 16, 4) for _ in range(config.num_warmups)]
    await asyncio.gather(*(stream_request(client, config, model, request, w, 0.0) for w in warm))
    failed = [w.error for w in warm if not w.success]
    if failed:
        raise RuntimeError(f"warmup request failed: {failed[0]}")


def _notes(records: list[RequestRecord], usage_seen: dict[str, bool]) -> list[str]:
    """What the report should say about how the figures were counted."""
    notes = []
    retried = sum(r.retried for r in records)
    if retried:
        notes.append(
            f"{retried} requests got no response on a pooled connection the server had closed "
            "and were sent once more on a fresh one (their latency counts from the first try)"
        )
    if any(r.success and not usage_seen.get(r.request_id) for r in records):
        notes.append(
            "the server sent no usage for some requests: their output tokens were counted "
            "as streamed chunks"
        )
    return notes


def run_client(
    config: ClientConfig,
    workload: Workload,
    offsets: list[float],
    max_concurrency: int | None = None,
) -> RunResult:
    return asyncio.run(run_client_async(config, workload, offsets, max_concurrency))


def reset_prefix_cache(config: ClientConfig) -> bool:
    """Ask the server to drop its prefix cache (vLLM's endpoint), so sweep points start cold.

    Servers without it simply answer 404; the benchmark then notes that points may share
    cached prefixes. It sits behind the API key like the rest of the API.
    """
    root = config.base_url.rstrip("/").removesuffix("/v1")
    try:
        response = httpx.post(f"{root}/reset_prefix_cache", headers=config.headers, timeout=10)
        return response.status_code < 300
    except httpx.HTTPError:
        return False


def client_report(
    result: RunResult,
    workload: Workload,
    arrival: ArrivalSpec,
    slos: dict[str, float],
    base_url: str,
    label: str | None = None,
) -> BenchReport:
    return BenchReport(
        label=label or f"{result.model} at {base_url}",
        backend="serve",
        target=base_url,
        workload=workload.summary(),
        arrivals=arrival.describe(),
        metrics=compute_metrics(result.records, slos=slos),
        notes=result.notes,
        records=result.records,
    )
