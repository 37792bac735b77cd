"""The machine a measurement ran on, as every benchmark prints it: the CPU's model, its
vector extensions and the kernels' ISA variant (figures from different ISAs are not
comparable, and neither are two cores with the same extensions: a Zen 5 takes two AVX-512
dot products a cycle where a Zen 4 takes one; docs/benchmarks.md)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from iterserve import kernels

# The extensions that decide which kernels run, in the order they are printed.
_EXTENSIONS = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "asimd",
    "asimddp",
)


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first processor's model as /proc/cpuinfo names it, with its family and model
    numbers on x86 (a VM's name may say only "AMD EPYC": family 25 is Zen 3 or 4, 26 Zen 5),
    or Arm's implementer and part; "" where there is no such file."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block only
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "cpu family" in fields:
        name = fields.get("model name", "x86")
        return f"{name} (family {fields['cpu family']}, model {fields.get('model', '?')})"
    if "CPU implementer" in fields:
        return f"Arm implementer {fields['CPU implementer']} part {fields.get('CPU part', '?')}"
    return fields.get("model name", "")


def cpu_line() -> str:
    """e.g. 'cpu x86_64 AMD EPYC (family 26, model 2) avx2 fma f16c avx512f avx512_vnni
    avx512_bf16; kernels avx2 (forced by ITERSERVE_ISA)'."""
    flags = kernels.cpu_flags()
    have = " ".join(flag for flag in _EXTENSIONS if flag in flags) or "no vector extensions"
    runnable = kernels.runnable_isas()
    on = kernels.available()  # first: a variant that fails to build gives way to the next
    chosen = kernels.isa()
    if os.environ.get("ITERSERVE_ISA"):
        how = "forced by ITERSERVE_ISA"
    else:
        how = "best here" if runnable and chosen == runnable[0] else "best that built here"
    variant = f"{chosen} ({how})" if on else f"off ({kernels.why_unavailable()})"
    model = cpu_model()
    return f"cpu {platform.machine()}{f' {model}' if model else ''} {have}; kernels {variant}"
