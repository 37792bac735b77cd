"""iterserve's own CPU kernels: C++ in `csrc/`, one source built per instruction set.

The sources are written in a 16-lane vector layer (csrc/simd.h, over torch's `at::vec`)
and compiled once for each ISA variant below, at first use, with that variant's flags; the
build is cached in `cache_dir()`, keyed by the sources' hash, so an edit rebuilds and an
unchanged tree loads in milliseconds. Each variant registers its ops in its own torch library
namespace (`torch.ops.iterserve_avx2`, ...), so several can be loaded in one process and
compared (the tests run every variant this CPU can run against the torch reference).

Which variant runs: the best one this CPU has, or the one named by ITERSERVE_ISA (for
example `ITERSERVE_ISA=avx2` on an AVX-512 machine runs and tests the AVX2 path). Nothing
requires the kernels: without a compiler, on another architecture, or with
ITERSERVE_KERNELS=0, `available()` is False, the engine says why once, and every caller takes
its torch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("iterserve.kernels")

_CSRC = Path(__file__).parent / "csrc"
# The head sizes the attention loops are built for: csrc/attention_plan.h `BuiltHeadDims`
# lists them (and says why these), the op `attention_head_dims` reports them, a test checks
# that this says the same. A model with another attends in torch.
ATTENTION_HEAD_DIMS = (32, 64, 96, 128, 256, 512)


@dataclass(frozen=True)
class Isa:
    """One build of the kernels: what the CPU must have, and how to compile for it."""

    name: str
    machine: str  # platform.machine() it runs on
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags it needs
    capability: str  # at::vec's CPU_CAPABILITY
    cflags: tuple[str, ...]
    # Arithmetic on bf16 values without emulation (bf16 dot products): where it is missing,
    # bf16 weights are widened to fp32 in registers and multiplied there.
    native_bf16: bool = False


_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c")
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c")

# Best first: the first one the CPU runs is the default.
ISAS: tuple[Isa, ...] = (
    Isa(
        "avx512bf16",
        "x86_64",
        (*_AVX512, "avx512_bf16", "avx512_vnni"),
        "AVX512",
        (*_AVX512_FLAGS, "-mavx512bf16", "-mavx512vnni"),
        native_bf16=True,
    ),
    # AVX-512 with integer dot products but no bf16 ones: Intel's Cascade Lake and Ice Lake
    # servers, common in clouds.
    Isa(
        "avx512vnni",
        "x86_64",
        (*_AVX512, "avx512_vnni"),
        "AVX512",
        (*_AVX512_FLAGS, "-mavx512vnni"),
    ),
    Isa("avx512", "x86_64", _AVX512, "AVX512", _AVX512_FLAGS),
    # AVX2 with AVX-VNNI's ymm dot products: Intel's client cores since Alder Lake and its
    # E-core Xeons (Sierra Forest), none of which have AVX-512. The many-row loops run
    # 1.2-2.3x AVX2's (benchmarks/tiles_timing.cpp, 2026-12-02: docs/benchmarks.md).
    Isa(
        "avx2vnni",
        "x86_64",
        ("avx2", "fma", "f16c", "avx_vnni"),
        "AVX2",
        ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
    ),
    Isa("avx2", "x86_64", ("avx2", "fma", "f16c"), "AVX2", ("-mavx2", "-mfma", "-mf16c")),
    Isa("neondot", "aarch64", ("asimd", "asimddp"), "DEFAULT", ("-march=armv8.2-a+dotprod",)),
    Isa("neon", "aarch64", ("asimd",), "DEFAULT", ("-march=armv8-a",)),
    # The same source with no intrinsics at all (what a CPU the list above misses would run);
    # tested on x86 as the stand-in for the paths the Arm build takes.
    Isa("generic", "x86_64", (), "DEFAULT", ()),
)
_BY_NAME = {isa.name: isa for isa in ISAS}


def cache_dir() -> Path:
    """Where built kernels (and compiled graphs) are kept between runs."""
    root = os.environ.get("ITERSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "iterserve"
    )
    return Path(root)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86 "flags", Arm "Features")."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86, Arm
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _machine() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _cpu_runs(isa: Isa) -> bool:
    return _machine() == isa.machine and set(isa.cpu_flags) <= cpu_flags()


def runnable_isas() -> list[str]:
    """The variants this CPU can run, best first."""
    if not sys.platform.startswith("linux"):
        return []
    return [isa.name for isa in ISAS if _cpu_runs(isa)]


# Variants whose build failed here: the choice moves on to the next one the CPU runs (a
# compiler older than a variant's flags, GCC 10 and -mavxvnni say, still builds AVX2).
_FAILED_BUILDS: set[str] = set()


def isa() -> str | None:
    """The variant the engine runs: ITERSERVE_ISA if set, else the best this CPU has (of
    those that built, once `available()` has tried)."""
    forced = os.environ.get("ITERSERVE_ISA")
    if forced:
        return forced
    runnable = [name for name in runnable_isas() if name not in _FAILED_BUILDS]
    return runnable[0] if runnable else None


def describe(name: str | None = None) -> Isa | None:
    """The variant's description (flags, native bf16), or None for an unknown name."""
    return _BY_NAME.get(name or isa() or "")


def why_unavailable(name: str | None = None) -> str | None:
    """None when the (selected) variant can be built and run here, else why it cannot."""
    if os.environ.get("ITERSERVE_KERNELS", "1") == "0":
        return "turned off by ITERSERVE_KERNELS=0"
    name = name or isa()
    if name is None:
        return f"no kernel build for this CPU ({platform.machine()} {sys.platform})"
    variant = _BY_NAME.get(name)
    if variant is None:
        return f"ITERSERVE_ISA={name} is not one of {', '.join(_BY_NAME)}"
    if not _cpu_runs(variant):
        missing = sorted(set(variant.cpu_flags) - cpu_flags())
        what = f"lacks {', '.join(missing)}" if missing else f"is not {variant.machine}"
        return f"the {name} kernels cannot run here: the CPU {what}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH"
    return None


def available(name: str | None = None) -> bool:
    """Build (first time) and load the (selected) variant; False, said once, if it cannot run.
    Unnamed and not forced, a variant whose build fails gives way to the next one."""
    if name or os.environ.get("ITERSERVE_ISA"):
        return _load(name or isa() or "") is not None
    while (chosen := isa()) is not None:
        if _load(chosen) is not None:
            return True
        if chosen not in _FAILED_BUILDS:
            return False  # not a build's failure (no compiler, turned off): none would do
    return False


def ops(name: str | None = None) -> Any:
    """The ops of the (selected) variant: `ops().tiled_linear(...)`. Call `available()` first."""
    name = name or isa() or ""
    if _load(name) is None:
        raise RuntimeError(f"iterserve kernels unavailable: {why_unavailable(name)}")
    return getattr(torch.ops, _namespace(name))


def _namespace(name: str) -> str:
    return f"iterserve_{name}"


@functools.cache
def _load(name: str) -> str | None:
    reason = why_unavailable(name)
    if reason is None:
        try:
            _build_and_load(_BY_NAME[name])
        except Exception as error:  # a failed build must never stop the engine
            reason = f"the {name} build failed: {str(error).strip().splitlines()[-1:]}"
            _FAILED_BUILDS.add(name)
    if reason is None:
        return name
    if name in _FAILED_BUILDS and not os.environ.get("ITERSERVE_ISA") and isa() is not None:
        # Said where the build fails, whoever asked: the engine's `available()` goes on to
        # the next variant; a caller that named this one (a test) gets None.
        logger.warning("iterserve C++ kernels: %s; the engine takes %s instead", reason, isa())
    else:
        logger.warning("iterserve C++ kernels are off (%s); using the torch paths", reason)
    return None


def _ensure_ninja_on_path() -> None:
    # The venv's `ninja` (a pip dependency) is not on PATH when the venv is not activated.
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def compile_flags(variant: Isa) -> list[str]:
    """Everything the variant's sources are compiled with (also used by the cross-build test)."""
    return [
        "-O3",
        f"-DCPU_CAPABILITY={variant.capability}",
        f"-DCPU_CAPABILITY_{variant.capability}",
        f"-DITERSERVE_OPS={_namespace(variant.name)}",
        # Each variant's copies of at::vec's inline functions stay its own.
        "-fvisibility=hidden",
        # GCC 12 at -O3 (Debian 12's compiler) read ivopts' rewritten addresses in
        # a loop decoding Q5_K tiles (csrc/tiles.h, since rewritten) as a NULL dereference,
        # found the function free of side effects and deleted its calls: its output kept zeros
        # (AVX2 and AVX-512 builds, reproduced outside the kernels;
        # -fdump-tree-local-pure-const2 says "NULL memory access; terminating BB"). Not
        # inferring what a call touches costs nothing here: the loops that matter are inlined.
        "-fno-ipa-pure-const",
        "-fno-ipa-modref",
        "-fopenmp",
        *variant.cflags,
    ]


# Written once a build has loaded: the directory's library is whole, and later loads take it
# as it is.
_BUILT = "built.ok"


def build_directory(variant: Isa) -> Path:
    """Where a variant's kernels are built and cached. Keyed by every source and header
    byte and the flags: an edit builds afresh, an unchanged tree loads, from any checkout of
    it (a built library is loaded as it is; ninja, whose build file names the sources by
    path, runs only to build)."""
    digest = hashlib.sha256(" ".join(compile_flags(variant)).encode())
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    tag = f"{variant.name}-torch-{torch.__version__}-{digest.hexdigest()[:16]}"
    return cache_dir() / "kernels" / tag


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (blocking); released on exit or when the process dies."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load_built(name: str, build_dir: Path) -> bool:
    """Load a finished build of `name` from `build_dir` as it is; False if there is none."""
    if not (build_dir / _BUILT).exists():
        return False
    torch.ops.load_library(str(build_dir / f"{name}.so"))
    return True


def build_and_load_library(
    name: str, sources: list[str], cflags: list[str], build_dir: Path, includes: list[str]
) -> None:
    """Load the shared library `name` from `build_dir`, building it first unless a finished
    build is there. Safe against other processes building it at once and against a build
    killed part-way (tests/kernels/test_build_cache.py)."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    if _load_built(name, build_dir):
        return
    with _exclusive(build_dir / "iterserve.lock"):
        if _load_built(name, build_dir):  # another process built it while this one waited
            return
        # A first start is otherwise silent for the length of a build (~1.5 min on 2 cores).
        logger.info("building %s (once for this source tree; cached in %s)", name, build_dir)
        start = time.monotonic()
        # torch's own baton is a plain file: a process killed mid-build leaves it behind and
        # every later load waits for it for ever. Under this lock, which the OS lets go when
        # its holder dies, no build of ours is running, so a baton left there is stale.
        (build_dir / "lock").unlink(missing_ok=True)
        _ensure_ninja_on_path()
        cpp_extension.load(  # builds what is not built yet (ninja), then loads
            name=name,
            sources=sources,
            extra_cflags=cflags,
            extra_include_paths=includes,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=os.environ.get("ITERSERVE_KERNELS_VERBOSE") == "1",
        )
        (build_dir / _BUILT).touch()
        logger.info("built %s in %.0f s", name, time.monotonic() - start)


# The sources with the longest compiles, longest first (AVX2 flags, one at a time: 40, 31 and
# 27 s of ~160). ninja starts a build's compiles in the order given; in name order the
# attention loops (then one file of 67 s) started last, and a core idled for most of their
# compile.
_LONGEST_COMPILES = ("attention_bf16.cpp", "attention_f32.cpp", "linear.cpp")

# The file that compiles every other source as one unit, written into the build's directory.
_OTHERS_UNIT = "other_sources.cpp"


def sources() -> list[Path]:
    """The kernels' C++ sources, the longest compiles first, then by name."""

    def order(source: Path) -> tuple[int, str]:
        if source.name in _LONGEST_COMPILES:
            return _LONGEST_COMPILES.index(source.name), source.name
        return len(_LONGEST_COMPILES), source.name

    return sorted(_CSRC.glob("*.cpp"), key=order)


def compile_units(directory: Path) -> list[Path]:
    """What a build compiles, longest first: each of the longest sources on its own, and
    the others as one unit (a file in `directory` that includes them, found through the
    include path `_CSRC`). A source's own code is a few seconds; ATen's headers are ~4-5 s
    of every compile, so nine small files took 70 s of compiler time apart and 19 s as one
    unit (AVX2 flags, AMD Zen 4, 2026-12-06). Their file-local names therefore share one
    anonymous namespace: two alike are a compile error, so each file's helpers keep names
    of their own (an overload another file could pick up would not be an error)."""
    ordered = sources()
    own, rest = ordered[: len(_LONGEST_COMPILES)], ordered[len(_LONGEST_COMPILES) :]
    text = "".join(f'#include "{p.name}"\n' for p in rest)
    directory.mkdir(parents=True, exist_ok=True)
    unit = directory / _OTHERS_UNIT
    if not unit.exists() or unit.read_text() != text:  # unchanged: ninja sees no change
        # Whole or not at all, for a build another process may be starting from it.
        partial = directory / f"{_OTHERS_UNIT}.{os.getpid()}"
        partial.write_text(text)
        partial.replace(unit)
    return [*own, unit]


def _build_and_load(variant: Isa) -> None:
    build_dir = build_directory(variant)
    build_and_load_library(
        f"iterserve_kernels_{variant.name}",
        [str(p) for p in compile_units(build_dir)],
        compile_flags(variant),
        build_dir,
        [str(_CSRC)],
    )
    from iterserve.kernels.fake import register_fakes

    register_fakes(_namespace(variant.name))
