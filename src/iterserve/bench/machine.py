"""The machine a measurement ran on, as every benchmark prints it: the CPU's vector
extensions and the kernels' ISA variant (figures from different ISAs are not comparable)."""

from __future__ import annotations

import platform

from iterserve import kernels

# The extensions that decide which kernels run, in the order they are printed.
_EXTENSIONS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "asimd", "asimddp")


def cpu_line() -> str:
    """e.g. 'cpu x86_64 avx2 fma f16c avx512f avx512_vnni avx512_bf16; kernels avx2 (forced)'."""
    flags = kernels.cpu_flags()
    have = " ".join(flag for flag in _EXTENSIONS if flag in flags) or "no vector extensions"
    runnable = kernels.runnable_isas()
    chosen = kernels.isa()
    how = "forced by ITERSERVE_ISA" if runnable and chosen != runnable[0] else "best here"
    variant = f"{chosen} ({how})" if kernels.available() else f"off ({kernels.why_unavailable()})"
    return f"cpu {platform.machine()} {have}; kernels {variant}"
