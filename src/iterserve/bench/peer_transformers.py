"""`--peer transformers`: the same workload through `transformers` `generate`, for the ratio.

This is how most people run a model without a serving engine: static batches in arrival
order, prompts left-padded to the longest, every sequence decoding until the batch's longest
output is done. Only the tokens each request asked for count as output; the rest is the
padding waste that iteration-level scheduling exists to remove.

The batch size is the peer's best: each candidate is probed on one batch of the workload,
and the whole workload then runs at the fastest. Arrival times are ignored (generate has no
notion of them), so the ratio means most when the main run also saturates the engine
(rate inf or a closed loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from iterserve.bench.metrics import compute_metrics
from iterserve.bench.records import RequestRecord
from iterserve.bench.report import PeerResult
from iterserve.bench.workloads import Workload, WorkloadRequest

PEERS = ("transformers",)


@dataclass
class PeerOptions:
    model: str | None = None  # HF directory or GGUF file; None: the bundled model
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    dtype: str = "bfloat16"


def load_transformers_model(path: str | None, dtype: str) -> tuple[Any, int]:
    """(transformers model, pad token id) for an HF directory or a GGUF file, local files only.

    Any family transformers has a class for: an HF directory through
    AutoModelForCausalLM; a GGUF file read with iterserve's loader and its weights put into
    its family's transformers class (bench/transformers_checkpoint.py), so both engines run
    bit-identical weights and transformers' own GGUF path (which needs `accelerate`) is not
    required.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from iterserve.bench.transformers_checkpoint import from_loaded
    from iterserve.model.loader import load_model
    from iterserve.model.model_source import find_model

    location = find_model(path).path
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    if location.is_dir() and (location / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(
            str(location), dtype=torch_dtype, local_files_only=True
        )
    else:
        loaded = load_model(location, torch_dtype)
        model = from_loaded(loaded.config, loaded.weights, torch_dtype)
    model.eval()
    generation = model.generation_config
    pad = generation.pad_token_id if generation.pad_token_id is not None else None
    if pad is None:
        pad = generation.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    return model, int(pad if pad is not None else 0)


def generate_batch(model: Any, batch: list[WorkloadRequest], pad_id: int) -> None:
    """One static batch: left-padded prompts, greedy, every row to the longest output."""
    import torch

    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, request in enumerate(batch):
        ids[row, width - request.prompt_len :] = torch.tensor(list(request.prompt_token_ids))
        mask[row, width - request.prompt_len :] = 1
    steps = max(r.output_len for r in batch)
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,  # the same lengths as the main run, which ignores EOS
            pad_token_id=pad_id,
        )


def run_static(
    model: Any, requests: list[WorkloadRequest], batch_size: int, pad_id: int
) -> list[RequestRecord]:
    """All requests in arrival-order batches; a request finishes when its batch does."""
    records = []
    origin = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        began = time.perf_counter() - origin
        generate_batch(model, batch, pad_id)
        ended = time.perf_counter() - origin
        for i, request in enumerate(batch):
            record = RequestRecord(
                f"peer-{start + i}", request.prompt_len, request.output_len, request.lane
            )
            record.arrival_time = began
            record.finish_time = ended
            record.output_len = request.output_len
            record.success = True
            records.append(record)
    return records


def run_transformers_peer(workload: Workload, options: PeerOptions | None = None) -> PeerResult:
    options = options or PeerOptions()
    requests = workload.requests
    model, pad_id = load_transformers_model(options.model, options.dtype)
    if workload.warmup is not None:
        generate_batch(model, [workload.warmup], pad_id)  # first-call costs stay out of probes

    sizes = sorted({max(1, min(b, len(requests))) for b in options.batch_sizes})
    probes: dict[int, float] = {}
    probe_records: dict[int, list[RequestRecord]] = {}
    for size in sizes:
        records = run_static(model, requests[:size], size, pad_id)
        probe_records[size] = records
        probes[size] = compute_metrics(records).throughput.output_throughput
    best = max(probes, key=lambda b: probes[b])
    # A probe that covered the whole workload already is the full run.
    full = probe_records[best] if best >= len(requests) else None
    records = full or run_static(model, requests, best, pad_id)
    return PeerResult(
        name=f"transformers generate ({type(model).__name__}), static batching",
        batch_size=best,
        throughput=compute_metrics(records).throughput,
        probes=probes,
    )
