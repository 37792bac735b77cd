"""iterserve's own CPU kernels: C++ in `csrc/`, built at first use and cached.

Nothing requires them. `available()` says whether they run here: the CPU must have
AVX-512 with BF16 and VNNI dot products (checked at run time, not at build time), a C++ compiler
must be present, and the build must succeed. Otherwise the engine says why, once, and
every caller takes its torch path. The build lands in `cache_dir()`, keyed by the sources'
hash, so an edit rebuilds and an unchanged tree loads in milliseconds.

Set ITERSERVE_KERNELS=0 to turn them off (the torch reference paths then run everywhere).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
from pathlib import Path

import torch

logger = logging.getLogger("iterserve.kernels")

_CSRC = Path(__file__).parent / "csrc"
# The instruction sets the sources are compiled for; `available()` checks the CPU has them.
_CPU_FLAGS = (
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "avx512_vnni",
    "f16c",
    "fma",
)
_CFLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mavx512vnni",
    "-mf16c",
    "-mfma",
    "-fopenmp",
]


def cache_dir() -> Path:
    """Where built kernels (and compiled graphs) are kept between runs."""
    root = os.environ.get("ITERSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "iterserve"
    )
    return Path(root)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def why_unavailable() -> str | None:
    """None when the kernels can be built and run here, else the reason they cannot."""
    if os.environ.get("ITERSERVE_KERNELS", "1") == "0":
        return "turned off by ITERSERVE_KERNELS=0"
    if platform.machine() not in ("x86_64", "AMD64") or not sys.platform.startswith("linux"):
        return f"built for x86-64 Linux only (this is {platform.machine()} {sys.platform})"
    missing = [flag for flag in _CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH"
    return None


def _ensure_ninja_on_path() -> None:
    # The venv's `ninja` (a pip dependency) is not on PATH when the venv is not activated.
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def available() -> bool:
    """Build (first time) and load the kernels; False, said once, if they cannot run here."""
    reason = why_unavailable()
    if reason is None:
        try:
            _build_and_load()
        except Exception as error:  # a failed build must never stop the engine
            reason = f"the build failed: {str(error).strip().splitlines()[-1:]}"
    if reason is not None:
        logger.warning("iterserve C++ kernels are off (%s); using the torch paths", reason)
        return False
    return True


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    sources = sorted(str(p) for p in _CSRC.glob("*.cpp"))
    # Keyed by every source and header byte: an edit builds afresh, an unchanged tree loads.
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    build_dir = cache_dir() / "kernels" / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name="iterserve_kernels",
        sources=sources,
        extra_cflags=_CFLAGS,
        extra_include_paths=[str(_CSRC)],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=os.environ.get("ITERSERVE_KERNELS_VERBOSE") == "1",
    )
    from iterserve.kernels import fake  # noqa: F401  shapes for torch.compile
