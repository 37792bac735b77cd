"""What the server talks to: one engine in this process (AsyncEngine) or a fleet of
replicas behind a router (DataParallelEngine). Both satisfy `ServingEngine`, so the
HTTP layer never knows how many engines answer it.

Torch-free and Ray-free: the server imports this, and a front end over Ray replicas
runs no model itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from iterserve.core.lora import LoRARequest
from iterserve.engine.metrics import EngineSnapshot
from iterserve.engine.model_facts import ModelFacts
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.request_stream import GenerationRequest, RequestStream
from iterserve.sampling_defaults import SamplingDefaults

if TYPE_CHECKING:
    from iterserve.engine.images import ImageInputs

# Called on the event loop for every engine request that ends: (last output, reason,
# replica index). The reason is the finish reason, or "error" when the engine failed it;
# the index is 0 for a single engine.
FinishedCallback = Callable[[RequestOutput | None, str, int], None]

# What /health reports of one replica: serving (or warming up after the server's start,
# taking requests into its queue meanwhile), being restarted after a death, or given up
# for good (out of restarts, or the server shut it down).
REPLICA_OK, REPLICA_WARMING = "ok", "warming up"
REPLICA_RESTARTING, REPLICA_GIVEN_UP = "restarting", "given up"


@dataclass(frozen=True)
class ReplicaState:
    """One replica of a fleet as /health and /metrics show it."""

    state: str  # REPLICA_OK, REPLICA_WARMING, REPLICA_RESTARTING or REPLICA_GIVEN_UP
    restarts: int = 0  # new processes started for it since the server started
    rerouted: int = 0  # requests sent to another when it died (not taken, or no token yet)
    last_death: str | None = None  # why it last died (Ray's account, or the exception)

    @property
    def serving(self) -> bool:
        return self.state in (REPLICA_OK, REPLICA_WARMING)


@dataclass(frozen=True)
class ServedModel:
    """What the API needs of the model, beside generating: its name, the tokenizer and chat
    template to render prompts and decode logprobs with, and its context length."""

    name: str
    tokenizer: Any
    chat_template: str | None
    max_model_len: int
    # How the model computes (dtype and why, kernels and their ISA, weights, step) and how
    # big its KV cache is and why, for /health (a data-parallel front end reports its first
    # replica's).
    compute: dict[str, str] = field(default_factory=dict)
    # The LoRA adapters it serves from the start (--lora-modules), and whether it takes more.
    loras: tuple[LoRARequest, ...] = ()
    lora_enabled: bool = False
    # Whether it embeds (/v1/embeddings) and scores by a reranker's head (/v1/rerank), and
    # the prompt a reranker's (query, document) pair goes into (engine/score_prompts.py).
    embeds: bool = False
    scores: bool = False
    rerank_template: str | None = None
    # A classifier head's labels, where it serves /classify.
    labels: tuple[str, ...] = ()
    # What a request's unset sampling fields take (--generation-config).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    eos_token_ids: tuple[int, ...] = ()  # the tokens that end an answer
    facts: ModelFacts = field(default_factory=ModelFacts)


class ServingEngine(Protocol):
    on_finished: FinishedCallback | None
    # Label values of the engines behind this one, for metrics: () for a single engine
    # (its series carry no `replica` label, as before data parallelism).
    replica_labels: tuple[str, ...]

    @property
    def served_model(self) -> ServedModel: ...

    @property
    def is_ready(self) -> bool:
        """Warmed up and serving."""
        ...

    @property
    def is_healthy(self) -> bool:
        """At least one engine can still run requests."""
        ...

    @property
    def is_accepting(self) -> bool: ...

    def replica_states(self) -> list[ReplicaState]:
        """Each replica's state, in `replica_labels` order; [] for a single engine."""
        ...

    def snapshots(self) -> list[EngineSnapshot]:
        """Latest gauges of each engine, in `replica_labels` order (one for a single engine)."""
        ...

    def start(self) -> None: ...

    def stop_accepting(self) -> None: ...

    async def shutdown(self, timeout: float = 30.0) -> None: ...

    def close(self) -> None:
        """After shutdown: release what outlives the engine loop (tensor-parallel worker
        processes). Blocking and idempotent."""
        ...

    def check_group_size(self, count: int) -> None: ...

    @property
    def image_inputs(self) -> ImageInputs | None:
        """The model's images where this process holds its tower, to count a prompt's
        tokens by (None: a text model, or a fleet whose replicas hold the towers)."""
        ...

    def num_waiting_estimate(self) -> int: ...

    async def add(self, requests: list[GenerationRequest]) -> RequestStream: ...

    async def reset_prefix_cache(self) -> int: ...
