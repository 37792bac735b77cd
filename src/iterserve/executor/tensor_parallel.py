"""Tensor-parallel execution over torch.distributed: rank 0 is the engine, the other ranks
are worker processes that run their shard of every forward.

The engine process runs the one scheduler, the sampler and rank 0's shard. Ranks 1..T-1 are
started by torch's own multiprocessing launcher (spawn) and meet rank 0 through torch's
file store in a temporary directory. Each step rank 0 broadcasts the step plan (the
`ForwardSeq`s, over a gloo group: small Python objects, whatever the device) and every rank
runs its shard; the layers' all-reduces (gloo on CPU, NCCL on CUDA) keep the ranks' hidden
states equal. Since the block pool is rank 0's alone and every rank's cache has the same
blocks, the same block ids index each rank's share of the KV heads.

A shard runs the torch projections and torch attention, eager: the C++ fused layer adds the
residual inside one op (no point to all-reduce at) and compiled graphs would have to trace
the collectives. See model/tensor_parallel.py for what each rank holds.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from iterserve.config import EngineConfig
from iterserve.executor.paged_model import ForwardSeq, PagedModel
from iterserve.model.attention import allocate_kv_caches
from iterserve.model.builder import ModelPlan
from iterserve.model.config import ModelConfig
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loaded import LoadedModel
from iterserve.model.tensor_parallel import TensorParallel, shard_config, shard_weights

logger = logging.getLogger("iterserve.engine")

# Rendezvous and each all-reduce: long enough for a slow rank's share of a big step.
_COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# Workers wait for the next step plan as long as the engine idles (a server may idle for
# days); a dead engine is noticed at once anyway (gloo sees the connection close).
_PLAN_TIMEOUT = timedelta(days=3650)
_JOIN_SECONDS = 10.0


@dataclass(frozen=True)
class StepPlan:
    """What rank 0 broadcasts each step: the sequences' forward inputs."""

    seqs: tuple[ForwardSeq, ...]


@dataclass(frozen=True)
class Shutdown:
    """Ends the workers' loop."""


@dataclass(frozen=True)
class ShardSpec:
    """Everything a rank needs to build its network; workers get theirs at spawn."""

    config: ModelConfig  # the whole model's shape
    weights: dict[str, torch.Tensor]  # this rank's share (CPU; shared memory in transit)
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV pool's: dtype, or int8 (model/kv_cache_format.py)
    device_type: str  # "cpu" or "cuda"
    num_blocks: int
    block_size: int
    size: int
    store_path: str
    num_threads: int


def threads_per_rank(num_threads: int | None, size: int) -> int:
    """--num-threads for each rank, else an equal share of this process's cores, so the
    ranks do not fight over them."""
    if num_threads:
        return num_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // size)


def _rank_device(device_type: str, rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _join_group(
    spec: ShardSpec, rank: int, workers: Sequence[multiprocessing.process.BaseProcess] = ()
) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Meet the other ranks; returns the all-reduce group and the plan-broadcast group.
    Rank 0 passes the worker processes, to notice one that dies before it joins."""
    store = dist.FileStore(spec.store_path, spec.size)
    if rank:
        store.set(f"up/{rank}", "1")
    else:
        _await_workers(store, workers)
    dist.init_process_group(
        "nccl" if spec.device_type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=spec.size,
        timeout=_COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=_PLAN_TIMEOUT)
    return TensorParallel(rank, spec.size), control


def _await_workers(
    store: dist.Store, workers: Sequence[multiprocessing.process.BaseProcess]
) -> None:
    """Wait for every worker to be up (started, weights in hand), failing as soon as one
    exits: the rendezvous itself would only give up after its timeout."""
    deadline = time.monotonic() + _COLLECTIVE_TIMEOUT.total_seconds()
    for rank, process in enumerate(workers, 1):
        while not store.check([f"up/{rank}"]):
            if not process.is_alive():
                raise RuntimeError(
                    f"tensor-parallel rank {rank} exited (code {process.exitcode}) before "
                    "joining; its error is above"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel rank {rank} did not start in time")
            time.sleep(0.05)


def _build_shard(spec: ShardSpec, tp: TensorParallel, device: torch.device) -> PagedModel:
    config = shard_config(spec.config, spec.size)
    model = LlamaForCausalLM(config, spec.dtype, device, tp)
    model.load(spec.weights)
    caches = allocate_kv_caches(config, spec.num_blocks, spec.block_size, spec.kv_dtype, device)
    return PagedModel(model, caches, spec.block_size, device)


# ---- rank 0: the engine's network --------------------------------------------------------


class TensorParallelModel(PagedModel):
    """Rank 0's shard, which first hands every forward's plan to the workers."""

    def __init__(
        self,
        spec: ShardSpec,
        workers: list[multiprocessing.process.BaseProcess],
        tp: TensorParallel,
        control: dist.ProcessGroup,
        device: torch.device,
        threads_before: int,
    ) -> None:
        network = _build_shard(spec, tp, device)
        super().__init__(network.model, network.kv_caches, spec.block_size, device)
        self.size = spec.size
        self._workers = workers
        self._control = control
        self._store_dir = os.path.dirname(spec.store_path)
        self._closed = False
        self._threads_before = threads_before  # the process's own, given back on close
        atexit.register(self.close)

    @torch.inference_mode()
    def forward(self, seqs: Sequence[ForwardSeq]) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("the tensor-parallel workers are closed")
        try:
            dist.broadcast_object_list([StepPlan(tuple(seqs))], src=0, group=self._control)
            return super().forward(seqs)
        except BaseException:
            # A rank that failed or missed a collective leaves the ranks out of step: no
            # later step could be trusted, so the workers go now.
            self.close(graceful=False)
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers if p.pid is not None]

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (a Shutdown message, then a kill after a grace period) and
        leave the process group; idempotent, and run at exit if nobody called it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        processes = self._workers
        # Only while every worker lives: a broadcast to a dead rank could wait.
        if graceful and all(p.is_alive() for p in processes):
            try:
                dist.broadcast_object_list([Shutdown()], src=0, group=self._control)
            except RuntimeError as error:
                logger.warning("telling the tensor-parallel workers to stop failed: %s", error)
        for process in processes:
            process.join(_JOIN_SECONDS if graceful else 0.5)
            if process.is_alive():
                process.kill()
                process.join()
        dist.destroy_process_group()
        shutil.rmtree(self._store_dir, ignore_errors=True)
        torch.set_num_threads(self._threads_before)
        logger.info(
            "tensor-parallel workers stopped (exit codes %s)", [p.exitcode for p in processes]
        )


def launch_tensor_parallel(
    config: EngineConfig,
    loaded: LoadedModel,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    num_blocks: int,
) -> tuple[TensorParallelModel, ModelPlan]:
    """Start ranks 1..T-1, join them as rank 0, and build rank 0's shard. On CUDA rank r
    runs on GPU r (whatever index `device` names)."""
    size = config.tensor_parallel_size
    _refuse_what_cannot_run(loaded.config, size, device.type)
    threads, threads_before = threads_per_rank(config.num_threads, size), torch.get_num_threads()
    torch.set_num_threads(threads)
    store_dir = tempfile.mkdtemp(prefix="iterserve-tp-")
    spec = ShardSpec(
        config=loaded.config,
        weights={},
        dtype=dtype,
        kv_dtype=kv_dtype,
        device_type=device.type,
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        size=size,
        store_path=os.path.join(store_dir, "store"),
        num_threads=threads,
    )
    network = _start_ranks(spec, loaded, store_dir, threads_before)
    plan = ModelPlan(
        backend="torch",
        paged_attention_kernel=False,
        batch_invariant=False,
        weights=str(dtype).removeprefix("torch."),
        step="eager",
        linears=network.model.describe_linears(),
        weight_bytes=network.model.weight_bytes(),  # rank 0's shard
    )
    logger.info(
        "model %s: tensor parallel over %d ranks (%s, %d threads each): torch linears, torch "
        "attention, eager (iterserve's kernels and compiled graphs are not sharded)",
        loaded.name,
        size,
        "nccl" if device.type == "cuda" else "gloo",
        threads,
    )
    return network, plan


def _refuse_what_cannot_run(model_config: ModelConfig, size: int, device_type: str) -> None:
    """Before anything starts: shapes that do not split, a second group, too few GPUs."""
    shard_config(model_config, size)
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one tensor-parallel "
            "engine per process (close the other first)"
        )
    if device_type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"--tensor-parallel-size {size} needs {size} GPUs, found {torch.cuda.device_count()}"
        )


def _start_ranks(
    spec: ShardSpec, loaded: LoadedModel, store_dir: str, threads_before: int
) -> TensorParallelModel:
    """Ranks 1..T-1 in processes of their own, each with its shard, joined by rank 0 (this
    process); on any failure nothing started is left running."""

    def share(rank: int) -> ShardSpec:
        return dataclasses.replace(
            spec, weights=shard_weights(loaded.weights, spec.config, rank, spec.size)
        )

    # torch's multiprocessing moves each rank's weights into shared memory on the way.
    # Daemonic: multiprocessing ends them if this process exits without closing them.
    context = torch_mp.get_context("spawn")
    workers = [
        context.Process(
            target=_worker_main, args=(rank, share(rank)), name=f"iterserve-tp{rank}", daemon=True
        )
        for rank in range(1, spec.size)
    ]
    try:
        for process in workers:
            process.start()
        rank_device = _rank_device(spec.device_type, 0)  # NCCL wants the device before joining
        tp, control = _join_group(spec, 0, workers)
        return TensorParallelModel(share(0), workers, tp, control, rank_device, threads_before)
    except BaseException:
        torch.set_num_threads(threads_before)
        for process in workers:
            if process.is_alive():
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(store_dir, ignore_errors=True)
        raise


# ---- ranks 1..T-1 -------------------------------------------------------------------------


def _exit_with_parent(store_dir: str) -> None:
    """End this worker when the engine process dies, however it dies (even SIGKILL, which
    leaves it no chance to send Shutdown or remove the store)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        shutil.rmtree(store_dir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="iterserve-tp-parent-watch", daemon=True).start()


def _worker_main(rank: int, spec: ShardSpec) -> None:
    """Rank `rank`: build the shard, then run every broadcast plan until Shutdown."""
    _exit_with_parent(os.path.dirname(spec.store_path))
    torch.set_num_threads(spec.num_threads)
    device = _rank_device(spec.device_type, rank)
    tp, control = _join_group(spec, rank)
    try:
        network = _build_shard(spec, tp, device)
        # The network copied the weights into its own tensors: let the shared memory go
        # (the Process object still holds `spec`).
        spec.weights.clear()
        with torch.inference_mode():
            while True:
                message: list[StepPlan | Shutdown | None] = [None]
                dist.broadcast_object_list(message, src=0, group=control)
                plan = message[0]
                if not isinstance(plan, StepPlan):
                    break
                # Only rank 0 samples: no logits here, so the LM head runs on no rows.
                network.forward([dataclasses.replace(s, num_logits=0) for s in plan.seqs])
    finally:
        dist.destroy_process_group()
