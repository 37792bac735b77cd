"""What crosses the wire between a data-parallel front end and its replicas (Ray actors).

Small dataclasses, pickled by Ray. Errors travel as data, not as exceptions: the
engine's exceptions carry extra constructor arguments that pickling would lose, and a
refusal (400, 429, 503) must reach the client as the same error a single engine gives.
Torch-free and Ray-free, so both sides import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from iterserve.engine.metrics import EngineSnapshot
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.request_stream import (
    EngineOverloadedError,
    EngineStoppedError,
    RequestFailedError,
)
from iterserve.sampling_params import InvalidRequestError

RefusalKind = Literal["invalid", "overloaded", "stopped"]


@dataclass(frozen=True)
class Refusal:
    """A replica did not take a group: the client's mistake, a full queue, or shutdown."""

    kind: RefusalKind
    message: str
    param: str | None = None
    retry_after: float = 1.0
    code: str | None = None  # InvalidRequestError's

    @classmethod
    def of(cls, error: InvalidRequestError | EngineOverloadedError | EngineStoppedError) -> Refusal:
        if isinstance(error, InvalidRequestError):
            return cls("invalid", str(error), error.param, code=error.code)
        if isinstance(error, EngineOverloadedError):
            return cls("overloaded", str(error), retry_after=error.retry_after)
        return cls("stopped", str(error))

    def error(self) -> Exception:
        """The exception a single engine would have raised."""
        if self.kind == "invalid":
            return InvalidRequestError(self.message, self.param, self.code)
        if self.kind == "overloaded":
            return EngineOverloadedError(self.message, self.retry_after)
        return EngineStoppedError(self.message)


@dataclass(frozen=True)
class ReplicaFailure:
    """The replica's engine failed this request (RequestFailedError there)."""

    message: str
    output: RequestOutput | None = None

    def error(self) -> RequestFailedError:
        return RequestFailedError(self.message, self.output)


@dataclass
class ReplicaEvent:
    """One batch of a group's stream: every output the replica had for it when it sent
    this (several steps' worth if the front end fell behind), by index in the group."""

    deliveries: list[tuple[int, RequestOutput | ReplicaFailure]] = field(default_factory=list)
    num_waiting: int = 0  # the replica's queue as it sent this: the front end's 429 check
    refused: Refusal | None = None  # the first event only: the group was not taken
    # The last event when the replica's engine died (its loop stopped; the process lives):
    # why. The group's unfinished requests are the front end's to run elsewhere or fail,
    # as when the whole process dies.
    died: str | None = None


@dataclass(frozen=True)
class ReplicaStatus:
    ready: bool  # warmed up
    healthy: bool  # its engine loop runs
    snapshot: EngineSnapshot
    failure: str | None = None  # why the engine loop stopped, once it has
