"""The engine loop in a background thread, feeding per-request async streams (request_stream.py).

`LLMEngine` is synchronous and not thread-safe, so exactly one thread (the
loop below) ever touches it. asyncio code talks to that thread through an
inbox of commands (add, abort, call) that the loop applies between steps, and gets
each step's outputs back through `loop.call_soon_threadsafe`, one callback per
step for all requests. Tokenization also happens on the loop thread, so the
tokenizer is never used from two threads at once.

Backpressure: at most `max_waiting_requests` requests wait (queued in the
engine or in the inbox); beyond that `add` raises EngineOverloadedError and
the server answers 429 instead of growing a queue without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from iterserve.engine.engine_core import StepFailedError
from iterserve.engine.images import ImageInputs, ImagesInput, ImagesPrompt
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.metrics import EngineSnapshot, snapshot_engine
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompt_embeds import EmbedsPrompt
from iterserve.engine.prompts import Prompt
from iterserve.engine.request_stream import (
    EngineDiedError,
    EngineOverloadedError,
    EngineStoppedError,
    GenerationRequest,
    RequestFailedError,
    RequestStream,
    accepted_stream,
    check_group_size,
    check_room,
    expand_n,
)
from iterserve.engine.serving_engine import FinishedCallback, ReplicaState, ServedModel
from iterserve.engine.startup_heap import freeze_startup_heap
from iterserve.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineOverloadedError",
    "EngineStoppedError",
    "GenerationRequest",
    "RequestFailedError",
    "RequestStream",
    "expand_n",
]

logger = logging.getLogger("iterserve.engine")

T = TypeVar("T")

# How long the loop naps after a step that scheduled nothing (e.g. dynamic
# batching waiting for its batch to fill), so it does not spin on a core.
_IDLE_STEP_NAP = 0.002
# Longest the engine waits for an event loop to handle a step's outputs before it starts the
# next step anyway (a busy loop must not stall generation for everyone).
_HANDOFF_TIMEOUT = 0.02


@dataclass
class _Add:
    stream: RequestStream
    requests: list[GenerationRequest]
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """Run `fn(engine)` on the loop thread between steps; its result settles `done`."""

    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future[Any]


_Command = _Add | _Abort | _Call


def _future_of(command: _Add | _Call) -> asyncio.Future[Any]:
    return command.accepted if isinstance(command, _Add) else command.done


def _set(future: asyncio.Future[Any], error: Exception | None, result: Any) -> None:
    if future.done():  # the caller gave up (an add's abort is queued)
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


# (stream, index within it, output or the error that ended it)
_Delivery = tuple[RequestStream, int, RequestOutput | BaseException]


class AsyncEngine:
    """One engine in this process, for the server (a ServingEngine)."""

    replica_labels: tuple[str, ...] = ()

    def __init__(
        self,
        engine: LLMEngine | None,
        max_waiting_requests: int = 256,
        retry_after: float = 1.0,
        on_finished: FinishedCallback | None = None,
        stop_on_step_error: bool = False,
    ) -> None:
        """`engine`: a built, warmed-up engine; None only from `launch`, which builds one.

        `stop_on_step_error`: a step that fails where no request can be blamed (planning
        it raised) stops the loop, failing every request with EngineDiedError, instead of
        failing them all and serving on. A data-parallel replica is launched so: its fleet
        replaces it with a fresh engine, whose block pool is known to be whole, and runs
        again elsewhere what had not started; a single engine has nobody to replace it."""
        if max_waiting_requests < 1:  # checked here only: launch builds this object first
            raise ValueError(
                f"--max-waiting-requests must be at least 1, got {max_waiting_requests}"
            )
        self.engine: LLMEngine = engine  # type: ignore[assignment]  # set by launch otherwise
        self._ready = engine is not None  # warmed up: /health says ok
        self.max_waiting_requests = max_waiting_requests
        self.retry_after = retry_after
        self.on_finished = on_finished
        self.num_step_errors = 0
        self.stop_on_step_error = stop_on_step_error
        self._wake = threading.Condition()
        self._inbox: list[_Command] = []  # guarded by _wake
        self._stop = False  # guarded by _wake
        self._closed = False  # guarded by _wake: the loop has exited, the inbox is dead
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._dead: BaseException | None = None
        # Requests handed to the inbox and not yet accepted (event loop side).
        self._pending = 0
        # Written by the loop thread, read anywhere: a whole object swapped atomically.
        # (launch sets it on the loop thread before anyone outside can see this object)
        self.snapshot: EngineSnapshot
        if engine is not None:
            self.snapshot = snapshot_engine(engine)
        # Loop thread only: which stream each live request's outputs go to, and answers
        # to adds and calls not sent yet.
        self._routes: dict[str, tuple[RequestStream, int]] = {}
        self._answers: list[tuple[asyncio.Future[Any], Exception | None, Any]] = []

    # ---- lifecycle ---------------------------------------------------------------

    @classmethod
    def launch(
        cls, build: Callable[[], LLMEngine], freeze_heap: bool = False, **options: Any
    ) -> AsyncEngine:
        """Start the loop thread and build the engine on it: load, warm up, then serve.

        Everything torch runs on that one thread. OpenMP keeps a pool of worker threads for
        each thread that starts parallel work, so an engine built on the main thread and
        stepped on the loop thread has two pools contending for the cores: one stream's step
        took 14 ms instead of 8 (bundled model, 2 cores; measured once, no script). Returns
        once the weights and the tokenizer are in (raising what the build raised);
        `is_ready` turns true, and /health says ok, once warm-up (compiling) is done too.

        `freeze_heap`: once warm, take what this process holds out of the garbage
        collector's full passes (engine/startup_heap.py): for a process that serves this
        engine until it exits.
        """
        async_engine = cls(None, **options)
        loaded = threading.Event()
        async_engine._thread = threading.Thread(
            target=async_engine._build_then_run,
            args=(build, loaded, freeze_heap),
            name="iterserve-engine",
            daemon=True,
        )
        async_engine._thread.start()
        loaded.wait()
        if async_engine._dead is not None:
            raise async_engine._dead
        return async_engine

    def _build_then_run(
        self, build: Callable[[], LLMEngine], loaded: threading.Event, freeze_heap: bool
    ) -> None:
        try:
            self.engine = build()
            self.snapshot = snapshot_engine(self.engine)
        except BaseException as error:  # noqa: BLE001 - re-raised by launch
            self._dead = error
            self._close()
            return
        finally:
            loaded.set()
        try:
            self.engine.warm_up()
        except BaseException as error:  # noqa: BLE001 - the server reports it as dead
            logger.exception("warming up the engine failed")
            self._dead = error
            self._close()
            return
        if freeze_heap:
            freeze_startup_heap()
        self._ready = True
        self._run()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
            self._thread.start()

    @property
    def is_ready(self) -> bool:
        """Warmed up and serving (requests sent before are queued, not refused)."""
        return self._ready and self.is_healthy

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the loop stopped, if it died ("RuntimeError: ..."), for a fleet's log."""
        dead = self._dead
        return None if dead is None else f"{type(dead).__name__}: {dead}"

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_healthy

    @property
    def served_model(self) -> ServedModel:
        engine = self.engine
        return ServedModel(
            engine.model_name,
            engine.tokenizer,
            engine.chat_template,
            engine.max_model_len,
            {
                **engine.model_plan.describe(),
                **engine.kv_pool.as_dict(),
                "tasks": engine.pooling.describe(),
            },
            tuple(engine.loras.by_name.values()),
            engine.loras.enabled,
            engine.pooling.embed,
            engine.pooling.score,
            engine.pair_prompts.template,
            engine.pooling.labels,
            engine.sampling_defaults,
            engine.eos_token_ids,
            engine.model_facts,
        )

    def replica_states(self) -> list[ReplicaState]:
        return []

    @property
    def image_inputs(self) -> ImageInputs | None:
        return self.engine.images

    def snapshots(self) -> list[EngineSnapshot]:
        return [self.snapshot]

    def stop_accepting(self) -> None:
        """New requests get EngineStoppedError from now on; running ones go on."""
        self._accepting = False

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to `timeout`
        seconds, abort the rest and stop the loop thread."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.is_healthy and time.monotonic() < deadline and self._has_requests():
            await asyncio.sleep(0.05)
        if self._has_requests():
            logger.warning("shutdown deadline reached: aborting %d requests", self._num_live())
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    def close(self) -> None:
        """Release the engine's worker processes, if any (after shutdown)."""
        if self.engine is not None:
            self.engine.close()

    def _has_requests(self) -> bool:
        return self._num_live() > 0

    def _num_live(self) -> int:
        snap = self.snapshot
        return self._pending + snap.num_running + snap.num_waiting

    # ---- requests (event loop side) -------------------------------------------------

    def num_waiting_estimate(self) -> int:
        return self._pending + self.snapshot.num_waiting

    def check_group_size(self, count: int) -> None:
        check_group_size(count, self.max_waiting_requests)

    async def add(self, requests: list[GenerationRequest]) -> RequestStream:
        """Queue a group of requests, all or none; returns once the engine accepted them.

        Raises InvalidRequestError (bad input), EngineOverloadedError (queue full)
        or EngineStoppedError (shutting down).
        """
        if not self.is_accepting:
            raise EngineStoppedError(
                "the server is shutting down" if self._dead is None else "the engine has stopped"
            )
        self.check_group_size(len(requests))
        check_room(
            self.num_waiting_estimate(), len(requests), self.max_waiting_requests, self.retry_after
        )
        await self._compile_grammars(requests)
        requests = await self._encode_images(requests)
        stream = RequestStream([r.request_id for r in requests], self.abort)
        accepted: asyncio.Future[None] = stream.loop.create_future()
        self._pending += len(requests)
        try:
            self._post(_Add(stream, requests, accepted))
            return await accepted_stream(stream, accepted)
        finally:
            self._pending -= len(requests)

    async def _compile_grammars(self, requests: list[GenerationRequest]) -> None:
        """Compile the group's output constraints on worker threads (cached by constraint),
        so the engine thread never waits for a grammar; a bad one raises
        InvalidRequestError before anything is queued."""
        specs = {
            id(spec): spec
            for request in requests
            if (spec := request.params.structured_output) is not None and spec.compiled is None
        }
        for spec in specs.values():
            await asyncio.to_thread(self.engine.grammars.attach, spec)

    async def _encode_images(self, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """The group's images encoded on a worker thread, so the engine's thread, which steps
        every other request, never waits for a vision tower (seconds an image on a CPU)."""
        images = self.engine.images
        ready = []
        for request in requests:
            prompt = request.prompt
            if isinstance(prompt, ImagesPrompt) and images is not None and prompt.encoded is None:
                encoded = await asyncio.to_thread(images.encode, prompt.images)
                request = replace(request, prompt=replace(prompt, encoded=encoded))
            ready.append(request)
        return ready

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        lane: str = "interactive",
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """One request's outputs as it runs; closing or cancelling the iterator aborts it."""
        request = GenerationRequest(prompt, params, request_id, lane, priority, time.monotonic())
        async with await self.add([request]) as stream:
            async for _, output in stream:
                yield output

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (thread-safe, returns at once); their KV blocks are freed
        before the next step. Unknown or finished ids are ignored."""
        if request_ids:
            self._post(_Abort(list(request_ids)))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` run on the loop thread between two steps, where touching the
        engine is safe; its result or exception comes back here."""
        if not self.is_healthy:
            raise EngineStoppedError("the engine has stopped")
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._post(_Call(fn, done))
        return await done

    async def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's unused blocks; returns how many were dropped."""
        return await self.call(lambda engine: engine.reset_prefix_cache())

    def _post(self, command: _Command) -> None:
        with self._wake:
            if self._closed:  # nobody would ever read it
                if not isinstance(command, _Abort):
                    raise EngineStoppedError("the engine has stopped")
                return
            self._inbox.append(command)
            self._wake.notify()

    def _deliver(self, deliveries: list[_Delivery]) -> None:
        """On the event loop: hand outputs to their streams, report finished requests."""
        for stream, index, item in deliveries:
            stream._push(index, item)
            if self.on_finished is None:
                continue
            try:
                if isinstance(item, RequestFailedError):
                    self.on_finished(item.output, "error", 0)
                elif isinstance(item, RequestOutput) and item.finished:
                    self.on_finished(item, item.finish_reason or "stop", 0)
            except Exception:  # a metrics bug must not lose outputs
                logger.exception("on_finished callback failed")

    # ---- the loop thread --------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self._stop and not engine.has_unfinished():
                        self._wake.wait()
                    commands, self._inbox = self._inbox, []
                    stop = self._stop
                deliveries: list[_Delivery] = []
                for command in commands:
                    self._apply(command, deliveries)
                if commands:
                    # Callers hear back only once the snapshot counts what they added, or
                    # the queue check of the next add would miss it (and overfill).
                    self.snapshot = snapshot_engine(engine)
                    self._answer()
                if stop:
                    self._abort_all(deliveries)
                    self._finish_iteration(deliveries)
                    self._close()
                    return
                if engine.has_unfinished() and not self._step(deliveries):
                    time.sleep(_IDLE_STEP_NAP)
                self._finish_iteration(deliveries)
        except BaseException as error:  # noqa: BLE001 - reported to every waiting client
            logger.exception("the engine loop died")
            self._dead = error
            deliveries = []
            message = f"the engine loop stopped ({self.failure})"
            self._fail_routes(list(self._routes), message, deliveries, EngineDiedError)
            self._send(deliveries)
            self._close()

    def _close(self) -> None:
        """Refuse further commands, and answer the adds that came in too late."""
        with self._wake:
            self._closed = True
            leftover, self._inbox = self._inbox, []
        for command in leftover:
            if not isinstance(command, _Abort):
                self._settle(_future_of(command), EngineStoppedError("the engine has stopped"))
        self._answer()

    def _finish_iteration(self, deliveries: list[_Delivery]) -> None:
        self.snapshot = snapshot_engine(self.engine)
        self._send(deliveries)

    def _apply(self, command: _Command, deliveries: list[_Delivery]) -> None:
        if isinstance(command, _Call):
            try:
                result = command.fn(self.engine)
            except Exception as error:
                self._settle(command.done, error)
            else:
                self._settle(command.done, None, result)
            return
        if isinstance(command, _Abort):
            for request_id in command.request_ids:
                output = self.engine.abort_request(request_id)
                route = self._routes.pop(request_id, None)
                if route is not None and output is not None:
                    deliveries.append((*route, output))
            return
        added: list[str] = []
        try:
            for index, request in enumerate(command.requests):
                self._add_one(request)
                added.append(request.request_id)
                self._routes[request.request_id] = (command.stream, index)
        except Exception as error:
            for request_id in added:  # all or nothing
                self.engine.abort_request(request_id)
                self._routes.pop(request_id, None)
            self._settle(command.accepted, error)
            return
        self._settle(command.accepted, None)

    def _add_one(self, request: GenerationRequest) -> None:
        engine = self.engine
        if request.pooling is not None:  # an embedding: its input is checked as `input`
            engine.add_request(
                request.prompt,
                request_id=request.request_id,
                priority=request.priority,
                arrival_time=request.arrival_time,
                pooling=request.pooling,
                lora_request=request.lora,
            )
            return
        # Tokenized here, on the engine's thread (a prompt of input rows has its length).
        # A prompt's images were encoded ahead (`_encode_images`); its text is tokenized here.
        prompt = request.prompt
        if isinstance(prompt, ImagesPrompt):
            prompt = engine.image_input(prompt)
        elif not isinstance(prompt, EmbedsPrompt):
            prompt = engine.tokenize(prompt)
        params = request.params
        if request.fill_context:
            length = (
                prompt.num_rows
                if isinstance(prompt, EmbedsPrompt)
                else len(prompt.token_ids)
                if isinstance(prompt, ImagesInput)
                else len(prompt)
            )
            room = engine.max_request_tokens() - length
            params = replace(params, max_tokens=max(1, min(params.max_tokens, room)))
        engine.add_request(
            prompt,
            params,
            request_id=request.request_id,
            lane=request.lane,
            priority=request.priority,
            arrival_time=request.arrival_time,
            lora_request=request.lora,
        )

    def _settle(
        self, future: asyncio.Future[Any], error: Exception | None, result: Any = None
    ) -> None:
        """Queue the answer to a waiting caller; `_answer` sends it."""
        self._answers.append((future, error, result))

    def _answer(self) -> None:
        """Answer the callers queued by `_settle`, each on its own event loop."""
        answers, self._answers = self._answers, []
        for future, error, result in answers:
            self._call_soon(future.get_loop(), functools.partial(_set, future, error, result))

    def _step(self, deliveries: list[_Delivery]) -> bool:
        """One engine step, its outputs routed; whether it computed anything (a step that
        failed did not: the loop naps before the next, as after an idle one)."""
        try:
            step = self.engine.step()
        except StepFailedError as error:
            # Exactly the step's requests fail; the rest of the engine is untouched.
            self.num_step_errors += 1
            logger.error(
                "an engine step failed; failing the %d requests it ran: %s",
                len(error.request_ids), ", ".join(error.request_ids),
                exc_info=error.cause,
            )  # fmt: skip
            self._fail_routes(
                error.request_ids, "the engine failed while running this request", deliveries
            )
            return False
        except Exception:
            # Planning the step failed: which requests it touched is unknown, so every
            # request fails (freeing its blocks) and the engine serves new ones; or, for
            # a fleet's replica, the loop stops and the fleet replaces the engine.
            self.num_step_errors += 1
            if self.stop_on_step_error:
                raise
            logger.exception("scheduling a step failed; failing every request")
            victims = self.engine.unfinished_request_ids() + list(self._routes)
            self._fail_routes(victims, "the engine failed while running this request", deliveries)
            return False
        for output in step.outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            deliveries.append((*route, output))
            if output.finished:
                del self._routes[output.request_id]
        return step.did_work

    def _fail_routes(
        self,
        request_ids: list[str],
        message: str,
        deliveries: list[_Delivery],
        error: type[RequestFailedError] = RequestFailedError,
    ) -> None:
        for request_id in dict.fromkeys(request_ids):
            try:
                output = self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort %s after a failure", request_id)
                output = None
            route = self._routes.pop(request_id, None)
            if route is not None:
                deliveries.append((*route, error(message, output)))

    def _abort_all(self, deliveries: list[_Delivery]) -> None:
        self._apply(_Abort(list(self._routes)), deliveries)
        for request_id in self.engine.unfinished_request_ids():  # added outside the server
            self.engine.abort_request(request_id)

    def _send(self, deliveries: list[_Delivery]) -> None:
        """Hand a step's outputs to their event loops, and wait (briefly) until each loop
        has run the requests' handlers on them.

        The wait is the point: the handlers (SSE encoding, socket writes) need the GIL and
        a core, and the next step's forward wants both cores for its kernels. Run side by
        side, the loop thread preempts a kernel thread mid-barrier and the forward stalls:
        one stream's time per token went from 7.5 ms offline to 17 ms served. Run one after
        the other, the handlers' fraction of a millisecond is all the server adds (both
        measured once, no script).
        """
        if not deliveries:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        for delivery in deliveries:
            by_loop.setdefault(delivery[0].loop, []).append(delivery)
        handled: list[threading.Event] = []
        for loop, batch in by_loop.items():
            done = threading.Event()
            handled.append(done)
            self._call_soon(loop, functools.partial(self._deliver_then_signal, loop, batch, done))
        deadline = time.monotonic() + _HANDOFF_TIMEOUT
        for done in handled:
            done.wait(max(0.0, deadline - time.monotonic()))

    def _deliver_then_signal(
        self, loop: asyncio.AbstractEventLoop, batch: list[_Delivery], done: threading.Event
    ) -> None:
        self._deliver(batch)
        # Two turns of the loop: the handlers woken above run in the first, and anything
        # they chained (a merged n > 1 stream) in the second.
        loop.call_soon(loop.call_soon, done.set)

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback)
