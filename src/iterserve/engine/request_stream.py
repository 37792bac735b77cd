"""What a caller of the async engine holds: the request it submits and the
stream of outputs it gets back, plus the errors submitting can raise.

Kept apart from the loop (async_engine.py) because these are the event-loop
side only: nothing here touches the engine or its thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from iterserve.core.lora import LoRARequest
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import Prompt
from iterserve.pooling_params import PoolingParams
from iterserve.sampling_params import InvalidRequestError, SamplingParams


class EngineOverloadedError(Exception):
    """The waiting queue is full; the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or its loop died: no new requests."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (not the client's fault)."""

    def __init__(self, message: str, output: RequestOutput | None = None) -> None:
        super().__init__(message)
        self.output = output


class EngineDiedError(RequestFailedError):
    """The request failed because its whole engine stopped (its loop died), not because of
    anything about the request: a fleet can run it again elsewhere if it had not started."""


class ReplicaLostError(RequestFailedError):
    """A data-parallel replica died with this request on it after it had produced tokens,
    so it cannot be moved to another replica unseen: the client may retry (a 503)."""

    retry_after = 1.0


def check_group_size(count: int, max_waiting_requests: int) -> None:
    """Refuse a group that could never be queued whole (n choices x prompts)."""
    if count > max_waiting_requests:
        raise InvalidRequestError(
            f"this request asks for {count} sequences but the server queues at most "
            f"{max_waiting_requests}; lower n or send fewer prompts",
            "n",
        )


def check_room(num_waiting: int, count: int, max_waiting_requests: int, retry_after: float) -> None:
    """Backpressure: a group that would take the waiting queue past its bound gets
    EngineOverloadedError (a 429), rather than a queue that grows without bound."""
    if num_waiting + count > max_waiting_requests:
        raise EngineOverloadedError(
            f"the server is at capacity ({max_waiting_requests} requests waiting); retry later",
            retry_after,
        )


# The max_tokens of a request that asked for no limit (with fill_context): all the context
# leaves, however long the context.
ALL_THE_CONTEXT = 2**31 - 1


@dataclass
class GenerationRequest:
    prompt: Prompt
    params: SamplingParams
    request_id: str
    lane: str = "interactive"
    priority: int = 0
    arrival_time: float | None = None
    # `params.max_tokens` is only an upper bound, cut to what the context leaves once the
    # prompt is tokenized on the loop thread: OpenAI's "no max_tokens" (then the bound is
    # ALL_THE_CONTEXT), and Anthropic's max_tokens, which the context window may cut.
    fill_context: bool = False
    # An embedding request (`params` unused): pooled, not sampled (LLMEngine.add_request).
    pooling: PoolingParams | None = None
    lora: LoRARequest | None = None  # the LoRA adapter it runs (None: the base model)


def expand_n(
    prompt: Prompt, params: SamplingParams, request_id: str, **kwargs: object
) -> list[GenerationRequest]:
    """n choices as n requests (SamplingParams.per_choice), ids `{request_id}-{i}`."""
    return [
        GenerationRequest(prompt, child, f"{request_id}-{i}", **kwargs)  # type: ignore[arg-type]
        for i, child in enumerate(params.per_choice())
    ]


async def accepted_stream(stream: RequestStream, accepted: asyncio.Future[None]) -> RequestStream:
    """`stream` once its engine took the group (raising what the engine refused it with);
    a caller that gives up meanwhile aborts the group (the abort is queued after the add:
    harmless if the add failed)."""
    try:
        await accepted
    except asyncio.CancelledError:
        stream.abort()
        raise
    return stream


class RequestStream:
    """Outputs of one admitted group of requests (n choices, several prompts),
    as `(index, RequestOutput)` in the order they were produced.

    Use it as an async context manager: leaving it early (an exception, a
    cancelled task, a client gone) aborts whatever is unfinished.
    """

    def __init__(self, request_ids: list[str], abort: Callable[[list[str]], None]) -> None:
        self._abort = abort  # thread-safe: posts an abort to the engine loop
        self.request_ids = request_ids
        self.loop = asyncio.get_running_loop()  # where the loop thread delivers outputs
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def wants(self, index: int) -> bool:
        """Whether request `index` is still awaited: neither read to its end nor aborted
        (a fleet sends again only what is)."""
        return index in self._unfinished

    def _push(self, index: int, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait((index, item))

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        index, item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.discard(index)
            raise item
        if item.finished:
            self._unfinished.discard(index)
        return index, item

    async def next_batch(self) -> list[tuple[int, RequestOutput | BaseException]]:
        """Every item delivered so far, waiting for the first: errors come as items here,
        not raised, for a caller that relays them (a data-parallel replica)."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for index, item in items:
            if isinstance(item, BaseException) or item.finished:
                self._unfinished.discard(index)
        return items

    def abort_request(self, index: int) -> None:
        """Stop request `index` alone (a stop condition of the client's own was met); the
        group's others go on, and what it still delivers is the caller's to ignore."""
        if index in self._unfinished:
            self._abort([self.request_ids[index]])
            self._unfinished.discard(index)

    def abort(self) -> None:
        if self._unfinished:
            self._abort([self.request_ids[i] for i in sorted(self._unfinished)])
            self._unfinished.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()
