"""Whether a model's weights can fit in the memory this process could still take, asked
before they are built: a load past it is ended part way by the kernel's OOM killer (SIGKILL:
no message, often after a minute of reading), where this says why at once.

What is counted is a floor of what the built network holds: a GGUF's quantized projections
as their own blocks (the kernels run them as they are; `--weights int8` makes them Q8_0, 34
bytes a 32 weights, `--weights bf16` 2 bytes a weight), every other tensor at 2 bytes a
weight (16-bit; more where the dtype is fp32). It is weighed against what is available
(engine/available_memory.py: MemAvailable or the cgroup's headroom, less what other engines'
KV pools have reserved and not written) and, where no cgroup limit binds, free swap: past
that the load cannot finish.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from iterserve.config import ConfigError, WeightFormat
from iterserve.engine import available_memory
from iterserve.model.lazy_weights import shape_of
from iterserve.model.loaded import LoadedModel

_GIB = 2**30


def weight_bytes_at_least(loaded: LoadedModel, weights: WeightFormat) -> int:
    """The fewest bytes the network built from `loaded` under `--weights` can hold."""
    total = 0
    for name in loaded.weights:
        numel = math.prod(shape_of(loaded.weights, name))
        blocks = loaded.quantized.get(name)
        if blocks is None or weights == "bf16":
            total += 2 * numel
        elif weights == "int8":
            total += numel * 34 // 32
        else:
            total += blocks.nbytes
    return total


def check_weights_fit(
    loaded: LoadedModel, weights: WeightFormat, device: torch.device, root: Path = Path("/")
) -> None:
    """Raise ConfigError when the weights cannot fit, naming both figures; `root` is where
    /proc is (a fake tree in tests)."""
    if device.type != "cpu":
        return  # a device's own allocator says so, with a message, when it runs out
    need = weight_bytes_at_least(loaded, weights)
    room = available_memory.host_room()
    # Swap helps only where no cgroup limit binds (the reading is MemAvailable's, perhaps
    # less other engines' pools).
    unbound = room.source.startswith("MemAvailable")
    swap = (available_memory.meminfo_bytes("SwapFree", root) or 0) if unbound else 0
    if need <= room.bytes + swap:
        return
    with_swap = f" and {swap / _GIB:.2f} GiB of free swap" if swap else ""
    raise ConfigError(
        f"{loaded.name} needs at least {need / _GIB:.2f} GiB for its weights "
        f"({_how(loaded, weights)}), more than the {room.bytes / _GIB:.2f} GiB available "
        f"({room.source}){with_swap}: loading it would be killed for memory. Free memory, "
        "or serve a smaller quantization of it (Q4_K_M: ~0.6 GB a billion weights)"
    )


def _how(loaded: LoadedModel, weights: WeightFormat) -> str:
    if not loaded.quantized or weights == "bf16":
        return "2 bytes a weight"
    if weights == "int8":
        return "Q8_0 for the quantized projections, 2 bytes a weight for the rest"
    return "the file's quantized blocks, 2 bytes a weight for the rest"
