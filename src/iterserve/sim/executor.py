"""An executor with no model: a cost model says how long each step takes and a
virtual clock advances by that much. The scheduler is the real one, so the
simulator answers "what if" (a bigger GPU, a longer trace, another policy)
with exactly the decisions the engine would make.

Tokens are placeholders: simulated requests run to `max_tokens` (ignore_eos).
Speculation is modelled too: the n-gram proposer always finds the placeholders
repeating, so a speculating request drafts its full k tokens; the step costs their
query tokens, and each draft is accepted with `acceptance_rate` (independently, up to
the first rejection), so `iterserve simulate` can say whether speculation pays.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

from iterserve.core.outputs import ModelOutput, SampledToken, ScheduledSeq, SchedulerOutput
from iterserve.sim.decode_cohort import SteadyDecodes, steady_part


class CostModel(ABC):
    """Seconds a step takes: RooflineCostModel below, or ProfiledCostModel
    (cost_profile.py), which interpolates steps measured on real hardware. A model prices
    a step in one place, `price`; the two entry points only say what the step holds."""

    def step_time(self, scheduled: SchedulerOutput) -> float:
        if scheduled.num_batched_tokens == 0:
            return 0.0
        return self.price(steady_part(scheduled), scheduled.seqs)

    def steady_step_time(self, steady: SteadyDecodes) -> float:
        """A step of these steady decodes alone, as step_time prices it, without building
        its SchedulerOutput (the fleet prices ~8 such steps a request ahead)."""
        return self.price(steady, ()) if steady.num_seqs else 0.0

    @abstractmethod
    def price(self, steady: SteadyDecodes | None, seqs: Sequence[ScheduledSeq]) -> float:
        """A step of the cohort's decodes (`steady`) and the listed sequences, not empty."""


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # sustained dense matmul FLOP/s in the serving dtype
    bandwidth: float  # sustained memory read bytes/s
    step_overhead: float  # seconds per step that no FLOP or byte explains (launches, Python)
    memory_bytes: float  # for weights + KV cache
    # The KV pool is sized as iterserve's own engine sizes it (--kv-cache-memory: GiB, or
    # auto's share of memory_bytes less the weights), not from the device's memory as a GPU
    # serving engine does: the preset of this machine, so a simulation of it admits and
    # preempts as `iterserve serve` here would.
    kv_cache_from_config: bool = False
    # For a CPU preset, the kernels' ISA variant it describes (kernels/__init__.py): a
    # profile measured with another one prices steps of another machine, and the report
    # says so.
    isa: str | None = None
    # Whether the host's work (scheduling, sampling bookkeeping, detokenizing) runs beside
    # the forward rather than on the cores the forward computes with: a GPU's host CPU.
    # Only then can asynchronous scheduling hide it (a step costs the longer of the two,
    # not their sum); a CPU's forward uses every core (docs/async_scheduling.md).
    host_beside_device: bool = True

    @property
    def device_type(self) -> str:
        """ "cpu" or "cuda": which device's defaults (async scheduling) the engine takes."""
        return "cuda" if self.host_beside_device else "cpu"


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_params: float  # parameters touched per token (lm head included)
    weight_bytes: float
    kv_bytes_per_token: float  # K and V, all layers, in bf16
    attn_flops_per_pair: float  # FLOPs per (query token, context token) pair, all layers
    head_dim: int

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> ModelShape:
        """The shape with K/V stored as --kv-cache-dtype says: int8 rows are head_dim bytes
        and a 4-byte scale where bf16 ones are 2 * head_dim (model/kv_cache_format.py)."""
        if kv_cache_dtype == "auto":
            return self
        if kv_cache_dtype != "int8":
            raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}")
        ratio = (self.head_dim + 4) / (2 * self.head_dim)
        return replace(self, kv_bytes_per_token=self.kv_bytes_per_token * ratio)


def _datasheet(
    name: str, peak_flops: float, peak_bandwidth: float, step_overhead: float, memory_bytes: float
) -> Hardware:
    """Datasheet peaks derated to what serving engines sustain."""
    return Hardware(name, 0.6 * peak_flops, 0.8 * peak_bandwidth, step_overhead, memory_bytes)


def _this_machine(name: str, flops: float, isa: str) -> Hardware:
    """This project's 2-core machine (~31 GB/s) with one of the kernels' ISA variants; its
    KV pool sized as `iterserve serve` sizes it here."""
    return Hardware(
        name,
        flops=flops,
        bandwidth=31e9,
        step_overhead=8e-3,
        memory_bytes=24 * 2**30,
        kv_cache_from_config=True,
        isa=isa,
        host_beside_device=False,
    )


HARDWARE = {
    # This project's 2-core machine: bf16 ~380 GFLOP/s, ~31 GB/s, the rates the linear
    # layers reach at many rows and at one (benchmarks/linear_kernels.py prints both).
    "cpu-2core": _this_machine("cpu-2core", flops=380e9, isa="avx512bf16"),
    # The same machine running the kernels' AVX2 variant (ITERSERVE_ISA=avx2), as its shipped
    # profile was measured: the 4-bit layers on int8 dot products reach ~270 GOP/s at 64
    # rows (benchmarks/linear_kernels.py with ITERSERVE_ISA=avx2).
    "cpu-2core-avx2": _this_machine("cpu-2core-avx2", flops=270e9, isa="avx2"),
    "a100-80g": _datasheet("a100-80g", 312e12, 2.0e12, step_overhead=4e-3, memory_bytes=80e9),
    "h100-80g": _datasheet("h100-80g", 989e12, 3.35e12, step_overhead=3e-3, memory_bytes=80e9),
}


def _decoder(
    name: str, num_params: float, layers: int, heads: int, kv_heads: int, head_dim: int
) -> ModelShape:
    """A dense decoder's shape from its architecture, weights and KV in bf16: a token's K
    and V are `kv_heads` rows of `head_dim` a layer; each (query, context) pair costs a
    multiply-add per head dimension for QK^T and another for PV, per query head and layer."""
    return ModelShape(
        name,
        num_params=num_params,
        weight_bytes=2 * num_params,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * 2,
        attn_flops_per_pair=4 * layers * heads * head_dim,
        head_dim=head_dim,
    )


MODELS = {
    "smollm2-135m": _decoder("smollm2-135m", 135e6, layers=30, heads=9, kv_heads=3, head_dim=64),
    "llama3-8b": _decoder("llama3-8b", 8.0e9, layers=32, heads=32, kv_heads=8, head_dim=128),
}


class RooflineCostModel(CostModel):
    """Step time = overhead + max(compute time, memory time).

    Compute: 2 FLOPs per parameter per token, plus attention's query x context
    pairs. Memory: the weights once per step, plus every context token's KV.
    A step is as slow as whichever roof it hits: small decode batches are
    memory-bound, prefill-heavy steps compute-bound. With asynchronous scheduling on a
    device beside its host, the overhead overlaps the roofline time instead of adding to it.
    """

    def __init__(
        self, hardware: Hardware, model: ModelShape, async_scheduling: bool = False
    ) -> None:
        self.hardware = hardware
        self.model = model
        # The step overhead hides behind the forward (Hardware.host_beside_device).
        self.overlap = async_scheduling and hardware.host_beside_device

    def price(self, steady: SteadyDecodes | None, seqs: Sequence[ScheduledSeq]) -> float:
        # A steady decode's single query sees its context, its own token included.
        tokens = steady.num_seqs if steady else 0
        pairs = kv_tokens = steady.total_context if steady else 0
        for seq in seqs:
            tokens += seq.num_new_tokens
            context = seq.num_computed_tokens + seq.num_new_tokens
            kv_tokens += context
            # Causal chunk: query i sees the cached prefix and i + 1 of its own tokens.
            pairs += seq.num_new_tokens * seq.num_computed_tokens
            pairs += seq.num_new_tokens * (seq.num_new_tokens + 1) // 2
        return self._time(tokens, pairs, kv_tokens)

    def _time(self, tokens: int, pairs: int, kv_tokens: int) -> float:
        # Locals and comparisons, not max(): the fleet prices ~10 steps a request ahead
        # (sim/fleet.py), and a builtin call costs more than the arithmetic.
        model, hw = self.model, self.hardware
        compute = (2 * model.num_params * tokens + model.attn_flops_per_pair * pairs) / hw.flops
        memory = (model.weight_bytes + model.kv_bytes_per_token * kv_tokens) / hw.bandwidth
        device = memory if memory > compute else compute
        if self.overlap:
            return device if device > hw.step_overhead else hw.step_overhead
        return hw.step_overhead + device


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


class SimulatedExecutor:
    PLACEHOLDER_TOKEN = 0

    def __init__(
        self,
        cost_model: CostModel,
        clock: VirtualClock,
        acceptance_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
        self.cost_model = cost_model
        self.clock = clock
        self.acceptance_rate = acceptance_rate
        self.busy_time = 0.0
        self._rng = random.Random(seed)

    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        elapsed = self.cost_model.step_time(scheduled)
        self.clock.now += elapsed
        self.busy_time += elapsed
        return ModelOutput(
            {
                seq.request_id: [
                    SampledToken(self.PLACEHOLDER_TOKEN)
                    for _ in range(1 + self._accepted(len(seq.draft_token_ids)))
                ]
                for seq in scheduled.seqs
                if seq.sample
            }
        )

    def _accepted(self, num_drafts: int) -> int:
        accepted = 0
        while accepted < num_drafts and self._rng.random() < self.acceptance_rate:
            accepted += 1
        return accepted
