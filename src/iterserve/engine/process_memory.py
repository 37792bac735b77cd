"""A process's memory as the kernel counts it: resident now, and the most it ever held.

What /metrics reports beside the weights and the KV pool (engine/metrics.py), and what the
benchmarks report beside tok/s (benchmarks/big_models.py): a model served on a CPU shares the
machine's memory with everything else on it, so the figure that matters is the process's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FIELD = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB$", re.MULTILINE)


@dataclass(frozen=True)
class ProcessMemory:
    resident: int  # bytes resident now (VmRSS)
    peak: int  # the most bytes resident at once since the process started (VmHWM)


def process_memory(pid: int | str = "self") -> ProcessMemory | None:
    """The memory of process `pid` (this one by default), from /proc/PID/status; None where
    there is no such file (the process has ended, or the system is not Linux)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = {name: int(kib) * 1024 for name, kib in _FIELD.findall(status)}
    if "VmRSS" not in fields or "VmHWM" not in fields:  # a kernel thread, a zombie
        return None
    return ProcessMemory(resident=fields["VmRSS"], peak=fields["VmHWM"])
