"""When each request arrives: Poisson, gamma (bursty), closed loop, or the trace's own clock.

An arrival schedule is a list of offsets in seconds from the run's start, plus an optional
concurrency cap that both runners enforce the same way: a request due while the cap is full
waits for a seat, and its latencies are measured from when it got one (what a client sees).

  poisson  exponential gaps at `request_rate` (rate inf: everything at t=0)
  gamma    gamma gaps with shape `burstiness` and the same mean rate; burstiness < 1 is
           burstier than Poisson, > 1 more regular, 1 is Poisson (`vllm bench serve`)
  closed   everything due at t=0 and `max_concurrency` in flight: a new request the moment
           one finishes
  trace    the offsets the workload carries (azure-conv)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARRIVAL_PROCESSES = ("poisson", "gamma", "closed", "trace")


@dataclass
class ArrivalSpec:
    process: str = "poisson"
    request_rate: float = math.inf  # req/s (poisson, gamma)
    burstiness: float = 1.0  # gamma shape
    max_concurrency: int | None = None  # cap on requests in flight (required for closed)

    def validate(self) -> ArrivalSpec:
        if self.process not in ARRIVAL_PROCESSES:
            raise ValueError(f"arrival process must be one of {ARRIVAL_PROCESSES}")
        if self.request_rate <= 0:
            raise ValueError(f"--request-rate must be positive, got {self.request_rate}")
        if self.burstiness <= 0:
            raise ValueError(f"--burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.process == "closed" and self.max_concurrency is None:
            raise ValueError("a closed loop needs --max-concurrency N")
        return self

    def describe(self) -> str:
        cap = f", at most {self.max_concurrency} in flight" if self.max_concurrency else ""
        if self.process == "closed":
            return f"closed loop, concurrency {self.max_concurrency}"
        if self.process == "trace":
            return f"trace timestamps{cap}"
        if math.isinf(self.request_rate):
            return f"all at once (rate inf){cap}"
        kind = "poisson" if self.process == "poisson" else f"gamma(burstiness={self.burstiness:g})"
        return f"{kind} at {self.request_rate:g} req/s{cap}"


def arrival_offsets(
    spec: ArrivalSpec,
    num_requests: int,
    seed: int = 0,
    trace_offsets: list[float] | None = None,
) -> list[float]:
    """Seconds from the start at which each request is due; non-decreasing, first at 0."""
    spec.validate()
    if spec.process == "trace":
        if trace_offsets is None or len(trace_offsets) != num_requests:
            raise ValueError(
                "--arrival trace needs a workload with arrival times (azure-conv); "
                "use poisson, gamma or closed for the others"
            )
        return list(trace_offsets)
    if spec.process == "closed" or math.isinf(spec.request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    shape = 1.0 if spec.process == "poisson" else spec.burstiness
    # Mean gap 1/rate whatever the shape: scale = 1 / (rate * shape).
    gaps = rng.gamma(shape, 1.0 / (spec.request_rate * shape), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
