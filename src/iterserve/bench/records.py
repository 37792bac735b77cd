"""The one per-request record every runner fills in and every metric is computed from.

The HTTP client, the in-process engine runner and any later caller (e.g. a batching-policy
comparison) all produce `RequestRecord`s, so the metric math exists once. Times are seconds
since the run's origin (the moment the runner started dispatching), so records from different
clocks (client wall clock, engine monotonic clock) compare directly.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    expected_output_len: int  # what the workload asked for (max_tokens)
    lane: str = "interactive"
    scheduled_time: float = 0.0  # when the workload said the request arrives
    # When it actually reached the server or engine: later than scheduled_time when a
    # concurrency cap held it back. Every latency below is measured from here.
    arrival_time: float = 0.0
    # The engine first admitted it (offline runner only: a client cannot see this).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # One instant per output token (engine) or per streamed chunk with a token (client);
    # the simulator hands over its requests' float arrays as they are.
    token_times: list[float] | array[float] = field(default_factory=list)
    finish_time: float | None = None
    output_len: int = 0  # tokens actually generated (usage.completion_tokens on a server)
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    # Speculative decoding: draft tokens proposed and accepted (None: not reported).
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    success: bool = False
    error: str = ""
    # Sent a second time, on a fresh connection, after the first got no response at all.
    retried: bool = False

    # ---- per-request metrics (seconds; None when the request cannot define one) ------------

    def _since_arrival(self, instant: float | None) -> float | None:
        return None if instant is None else instant - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Arrival -> first token, queueing included."""
        return self._since_arrival(self.first_token_time)

    @property
    def e2e(self) -> float | None:
        return self._since_arrival(self.finish_time)

    @property
    def queue_time(self) -> float | None:
        return self._since_arrival(self.first_scheduled_time)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive tokens (TBT / ITL)."""
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: the first token's wait is TTFT's business.

        Uses the token count the server reported, not the number of chunks, so a server that
        streams several tokens per chunk is not credited with fewer, slower tokens.
        """
        if self.output_len < 2 or self.first_token_time is None:
            return None
        last = self.token_times[-1] if self.token_times else self.finish_time
        if last is None:
            return None
        return (last - self.first_token_time) / (self.output_len - 1)

    @property
    def max_itl(self) -> float | None:
        gaps = self.itls
        return max(gaps) if gaps else None


@dataclass
class RunResult:
    """What a runner hands back: its records and facts the metrics cannot infer."""

    records: list[RequestRecord]
    model: str = ""
    notes: list[str] = field(default_factory=list)
