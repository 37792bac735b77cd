"""The load client against servers that misbehave the way real ones do: keep-alive
connections closed under it, errors with reasons, and the report that tells them apart."""

from __future__ import annotations

import asyncio
import json

import pytest

from iterserve.bench.arrivals import ArrivalSpec
from iterserve.bench.client import ClientConfig, client_report, run_client_async
from iterserve.bench.compare import PolicyRow, rows_to_json
from iterserve.bench.report import format_report, latency_dict
from iterserve.bench.workloads import Workload, WorkloadRequest

STREAM = (
    'data: {"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}\n\n'
    'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
    'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n'
    "data: [DONE]\n\n"
)


async def _read_request(reader: asyncio.StreamReader) -> bool:
    """Read one HTTP request; False when the connection closed first."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return False
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length")),
        0,
    )  # fmt: skip
    body = json.loads(await reader.readexactly(length))
    return bool(body)


def _response(status: int, body: str, content_type: str) -> bytes:
    data = body.encode()
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(data)}\r\nconnection: keep-alive\r\n\r\n"
    ).encode() + data


async def stale_keepalive_server(
    answers: list[tuple[int, str]],
) -> tuple[asyncio.Server, str]:
    """Answers the first request on each connection, keeps it open, and then closes it
    on the next request without a word: a keep-alive timeout racing the client."""
    queue = list(answers)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _read_request(reader)
            status, body = queue.pop(0) if queue else (200, STREAM)
            kind = "text/event-stream" if status == 200 else "application/json"
            writer.write(_response(status, body, kind))
            await writer.drain()
            await _read_request(reader)  # the next request on this connection: hang up
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _workload(n: int) -> Workload:
    return Workload("tiny", [WorkloadRequest([1, 2, 3], 1) for _ in range(n)])


def run_against(answers: list[tuple[int, str]], n: int):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        server, url = await stale_keepalive_server(answers)
        async with server:
            config = ClientConfig(url, model="m", progress=False, num_warmups=0)
            # One at a time, so every request after the first finds a pooled connection.
            return await run_client_async(config, _workload(n), [0.0] * n, max_concurrency=1)

    return asyncio.run(main())


def test_a_request_on_a_closed_keepalive_connection_is_retried_once() -> None:
    result = run_against([], 4)
    assert all(r.success for r in result.records), [r.error for r in result.records]
    # The 2nd and 4th went out on the connection the one before had used; the 3rd on a
    # new one (the pool drops a connection that failed).
    assert [r.retried for r in result.records] == [False, True, False, True]
    assert any("fresh" in note for note in result.notes)


def test_the_report_names_each_failure_reason_with_its_count() -> None:
    overloaded = json.dumps({"error": {"message": "the server is at capacity", "type": "x"}})
    answers = [(429, overloaded), (429, overloaded), (500, "boom"), (200, STREAM)]
    result = run_against(answers, 4)
    report = client_report(result, _workload(4), ArrivalSpec(), {}, "http://x")
    assert report.metrics.failure_reasons == {
        "HTTP 429: the server is at capacity": 2,
        "HTTP 500: boom": 1,
    }
    text = format_report(report)
    assert "2 x HTTP 429: the server is at capacity" in text and "1 x HTTP 500: boom" in text
    saved = report.to_dict()  # without --save-detailed, failed requests keep their errors
    assert sorted(f["error"] for f in saved["failures"]) == [
        "HTTP 429: the server is at capacity",
        "HTTP 429: the server is at capacity",
        "HTTP 500: boom",
    ]


def test_compare_json_has_the_bench_report_s_shape() -> None:
    result = run_against([], 2)
    report = client_report(result, _workload(2), ArrivalSpec(), {}, "http://x")
    entry = rows_to_json([PolicyRow("p", {}, report, 0)], _workload(2), ArrivalSpec())
    policy = entry["policies"][0]
    assert set(policy) >= set(report.to_dict())
    assert policy["latency"] == latency_dict(report.metrics.latency)  # flat p99_ttft_ms names
    assert "p99_ttft_ms" in policy["latency"]


def test_a_server_that_is_not_there_is_named_in_the_error() -> None:
    from iterserve.bench.server_process import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = ClientConfig(url, progress=False, num_warmups=0)
    with pytest.raises(ConnectionError, match=f"cannot reach the server at {url}"):
        asyncio.run(run_client_async(config, _workload(1), [0.0]))


def stream_with_pauses(pauses: list[float]):  # type: ignore[no-untyped-def]
    """One request against a server that sends STREAM's chunks after these pauses."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        for chunk, pause in zip(STREAM.split("\n\n")[:-1], pauses, strict=True):
            await asyncio.sleep(pause)
            writer.write((chunk + "\n\n").encode())
            await writer.drain()
        writer.close()

    async def main():  # type: ignore[no-untyped-def]
        server = await asyncio.start_server(trickle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            config = ClientConfig(url, model="m", progress=False, num_warmups=0, timeout=0.6)
            return await run_client_async(config, _workload(1), [0.0])

    return asyncio.run(main()).records[0]


def test_the_timeout_bounds_each_wait_not_a_whole_stream() -> None:
    """--timeout is per connect and per read (as it was with httpx): a stream that keeps
    sending outlives it; a server that goes quiet for longer does not."""
    record = stream_with_pauses([0.25] * 4)  # 1 s in all, no wait over 0.6 s
    assert record.success, record.error
    record = stream_with_pauses([0.0, 1.0, 0.0, 0.0])  # one silence of 1 s
    assert not record.success and "Timeout" in (record.error or ""), record.error
