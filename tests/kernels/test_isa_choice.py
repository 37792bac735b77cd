"""Which kernel variant runs: the best the CPU has, and where its build fails (a compiler
older than its flags: GCC 10 knows no -mavxvnni), the next one, said once; a variant forced
by ITERSERVE_ISA is not replaced. In a child process: the choice is the process's."""

from __future__ import annotations

import os
import subprocess
import sys

CHOOSE = """
from iterserve import kernels

kernels.cpu_flags = lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"})
kernels._machine = lambda: "x86_64"
kernels.shutil.which = lambda name: "/usr/bin/" + name  # a compiler is there
built = []

def build_and_load(variant):
    if variant.name == "avx2vnni":
        raise RuntimeError("c++: error: unrecognized command-line option '-mavxvnni'")
    built.append(variant.name)

kernels._build_and_load = build_and_load
before = kernels.isa()
print(before, kernels.available(), kernels.isa(), built)
"""


def _choose(forced: str | None = None) -> list[str]:
    """What the child chose before and after `available()`, whether that was True, what it
    built, and its log."""
    env = {k: v for k, v in os.environ.items() if k != "ITERSERVE_ISA"}
    if forced:
        env["ITERSERVE_ISA"] = forced
    done = subprocess.run(
        [sys.executable, "-c", CHOOSE], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [*done.stdout.split(), done.stderr]


def test_a_variant_that_fails_to_build_gives_way_to_the_next() -> None:
    before, available, after, built, log = _choose()
    assert (before, available, after, built) == ("avx2vnni", "True", "avx2", "['avx2']")
    assert "-mavxvnni" in log  # the failure is said, and what runs instead
    assert "the engine takes avx2 instead" in log


def test_a_forced_variant_is_not_replaced() -> None:
    before, available, after, built, *_ = _choose("avx2vnni")
    assert (before, available, after, built) == ("avx2vnni", "False", "avx2vnni", "[]")
