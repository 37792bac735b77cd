"""The kernels' vector layer on every ISA: simd_check.cpp (each primitive of csrc/simd.h
against a scalar reference) built and run for each variant this CPU runs, and for Arm64 with
a cross compiler under qemu-user; the block formats' kernels (blocks_check.cpp) for Arm64
under qemu, and for AVX2 with AVX-VNNI where the CPU has it; and the kernel sources
themselves built for Arm64.

The Arm tools come from Debian (`g++-aarch64-linux-gnu`, `qemu-user`); .ci/run installs
them. Without them the Arm tests skip, saying so, except under CI, where they fail.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch.utils import cpp_extension

from iterserve import kernels
from iterserve.model import block_formats as bf
from tiny_gguf import gguf_blocks

CHECK = Path(__file__).parent / "simd_check.cpp"
CSRC = Path(kernels.__file__).parent / "csrc"
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


def _includes() -> list[str]:
    return [f"-I{CSRC}", *(f"-I{p}" for p in cpp_extension.include_paths())]


def _build(
    compiler: str,
    isa: kernels.Isa,
    source: Path,
    out: Path | None,
    *extra: str,
    opt: str = "-O3",
) -> None:
    """Compile `source` to `out` (None: only check that it compiles, -fsyntax-only), or
    take an identical earlier compile's output: same compiler, command, source and kernel
    headers (the kernels' own cache rule, for these check programs, which take minutes of
    cross compiling from cold)."""
    flags = [opt if f == "-O3" else f for f in kernels.compile_flags(isa) if f != "-fopenmp"]
    command = [compiler, "-std=c++17", *flags, *_includes(), str(source), *extra]
    if out is None:
        command.append("-fsyntax-only")
    cached = _check_cache(compiler, command, source) / (out.name if out else "compiles")
    if not cached.exists():
        building = cached.with_suffix(f".{os.getpid()}.tmp")
        output = ["-o", str(building)] if out else []
        done = subprocess.run([*command, *output], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        if out is None:
            building.touch()
        building.replace(cached)  # whole or absent, whoever else builds it at once
    if out:
        shutil.copy2(cached, out)


def _check_cache(compiler: str, command: list[str], source: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([version, *command]).encode())
    for path in [source, *sorted(CSRC.iterdir())]:
        digest.update(path.name.encode() + path.read_bytes())
    where = kernels.cache_dir() / "checks" / digest.hexdigest()[:24]
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.mark.parametrize("name", [isa.name for isa in kernels.ISAS if isa.machine == "x86_64"])
def test_vector_layer_on_each_x86_variant(name: str, tmp_path: Path) -> None:
    if name not in kernels.runnable_isas():
        pytest.skip(f"this CPU does not run {name}")
    binary = tmp_path / f"simd_check_{name}"
    _build("c++", kernels.describe(name), CHECK, binary)  # type: ignore[arg-type]
    done = subprocess.run([str(binary)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert done.stdout.split()[:2] == ["ok", name]


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        why = f"{tool} is not installed (apt-get install g++-aarch64-linux-gnu qemu-user)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


@pytest.mark.parametrize("name", ["neon", "neondot"])
def test_vector_layer_on_arm64_under_qemu(name: str, tmp_path: Path) -> None:
    """neondot: the int8 and 4-bit dot products on `sdot` (qemu's default CPU has it)."""
    _need(CROSS)
    _need(QEMU)
    binary = tmp_path / f"simd_check_{name}"
    _build(CROSS, kernels.describe(name), CHECK, binary, "-static")  # type: ignore[arg-type]
    done = subprocess.run([QEMU, str(binary)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert done.stdout.split() == ["ok", name, "4"]  # at::vec's NEON floats: 4 lanes


def _build_all(builds: list[tuple[str, Path, Path | None, tuple[str, ...], str]]) -> None:
    """Cross builds (variant, source, output, extra flags, optimization), two at a time: a
    compiler is one thread, and these are minutes of a CI run on two cores."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = [
            pool.submit(_build, CROSS, kernels.describe(name), source, out, *extra, opt=opt)  # type: ignore[arg-type]
            for name, source, out, extra, opt in builds
        ]
        for future in done:
            future.result()


@pytest.mark.slow
def test_kernels_build_for_arm64(tmp_path: Path) -> None:
    """Each kernel source compiles for Arm64 with the flags of the neondot variant, in the
    units the builds compile (the neon one differs only in simd.h, which the qemu tests cover
    both ways; linking needs an Arm64 torch, which this machine has not)."""
    _need(CROSS)
    # Whether it compiles, not what code it makes: -fsyntax-only still instantiates every
    # template the sources use, and took a CI run's 12 sources from 92 s at -O0 (228 s for
    # paged_attention.cpp alone at -O3) to 47-50 s alone (2026-12-04, AVX2 Zen 3). The code made for Arm64 is what the qemu
    # tests run (simd_check.cpp, blocks_check.cpp: simd.h, blocks.h and tiles.h at -O3 / -O0).
    sources = kernels.sources()  # the longest compiles first, as the variants' builds
    assert {p.name for p in sources} >= {
        "layer.cpp",
        "linear.cpp",
        "paged_attention.cpp",
        "attention_bf16.cpp",
    }
    units = kernels.compile_units(kernels.cache_dir() / "checks")  # a path the cache keeps
    _build_all([("neondot", p, None, ("-fPIC",), "-O3") for p in units])


# The block formats' kernels on Arm64: every GGUF type, decoded and multiplied by the very code
# the kernels run (blocks_check.cpp), checked as test_block_formats.py checks the x86 builds.
BLOCKS_CHECK = Path(__file__).parent / "blocks_check.cpp"


def _block_cases() -> tuple[bytes, list[tuple[str, int, int, int, np.ndarray, torch.Tensor]]]:
    """Every block format: (name, N, K, M, GGUF bytes, bf16 activations), and them as stdin."""
    cases = []
    for i, (name, fmt) in enumerate(sorted(bf.BLOCK_FORMATS.items())):
        n, k, m = 24, 2 * max(fmt.inputs, 64), 6  # 24 rows: a padded tile; 6 rows: the sweep
        rng = np.random.default_rng(i)
        raw = gguf_blocks(name, rng.standard_normal((n, k)) * 0.05, seed=i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i)).bfloat16()
        x[0, :32] = 0  # an all-zero block
        cases.append((name, n, k, m, raw, x))
    stdin = struct.pack("<i", len(cases))
    for name, n, k, m, raw, x in cases:
        stdin += struct.pack("<4i", bf.BLOCK_FORMATS[name].code, n, k, m)
        stdin += raw.tobytes() + x.view(torch.int16).numpy().tobytes()
    return stdin, cases


@pytest.mark.slow
def test_block_formats_on_arm64_under_qemu(tmp_path: Path) -> None:
    """Both Arm64 variants (neon: widening multiplies; neondot: `sdot`), built side by side."""
    _need(CROSS)
    _need(QEMU)
    variants = ["neon", "neondot"]
    binaries = {name: tmp_path / f"blocks_check_{name}" for name in variants}
    # -O0: this checks the loops' arithmetic on Arm's instructions (simd.h's wrappers are
    # always inlined, so the same instructions run); the -O3 build of the same loops runs on
    # x86 (test_block_formats.py). -O3 took 147 s a variant here, -O1 45, -O0 20.
    _build_all([(name, BLOCKS_CHECK, binaries[name], ("-static",), "-O0") for name in variants])
    stdin, cases = _block_cases()
    for name in variants:
        _check_block_formats(name, binaries[name], stdin, cases)


@pytest.mark.skipif(
    "avx2vnni" not in kernels.runnable_isas(), reason="this CPU has no AVX-VNNI (avx_vnni)"
)
def test_block_formats_with_avx_vnni_give_avx2s_bits(tmp_path: Path) -> None:
    """AVX2 with AVX-VNNI (`vpdpbusd` on ymm, signed weights stored + 128) makes the same
    exact integer sums as AVX2's `vpmaddubsw` + `vpmaddwd`: every format decoded as `gguf`
    decodes it, its products right, and the same bits as the AVX2 build's. Standalone, at
    -O1, where the CPU's best variant is another (else the kernels' own tests run it)."""
    variants = ["avx2vnni", "avx2"]
    binaries = {name: tmp_path / f"blocks_check_{name}" for name in variants}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [
            pool.submit(_build, "c++", kernels.describe(name), BLOCKS_CHECK, out, opt="-O1")  # type: ignore[arg-type]
            for name, out in binaries.items()
        ]:
            future.result()
    stdin, cases = _block_cases()
    outputs = {
        name: _check_block_formats(name, binaries[name], stdin, cases, runner=[])
        for name in variants
    }
    np.testing.assert_array_equal(outputs["avx2vnni"], outputs["avx2"])


def _check_block_formats(
    name: str,
    binary: Path,
    stdin: bytes,
    cases: list[tuple[str, int, int, int, np.ndarray, torch.Tensor]],
    runner: list[str] | None = None,
) -> np.ndarray:
    """Runs `binary` (under qemu unless `runner` says otherwise) on the cases, checks what it
    wrote, and returns it."""
    command = [QEMU] if runner is None else runner
    done = subprocess.run([*command, str(binary)], input=stdin, capture_output=True)
    assert done.returncode == 0, (name, done.stderr[-3000:])
    out = np.frombuffer(done.stdout, dtype=np.float32)
    at = 0
    for qtype, n, k, m, raw, x in cases:
        padded = -(-n // 16) * 16
        decoded = out[at : at + n * k].reshape(n, k)
        together = out[at + n * k : at + n * k + m * padded].reshape(m, padded)
        alone = out[at + n * k + m * padded : at + n * k + 2 * m * padded].reshape(m, padded)
        at += n * k + 2 * m * padded
        weights = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k)
        np.testing.assert_array_equal(decoded, weights, err_msg=f"{name} {qtype}")
        rounded = bf.activations_as_quantized(x, bf.BLOCK_FORMATS[qtype].activation_unit)
        want = (rounded @ torch.from_numpy(weights).double().T).numpy()
        np.testing.assert_allclose(
            together[:, :n], want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=f"{name} {qtype}"
        )
        np.testing.assert_array_equal(alone, together, err_msg=f"{name} {qtype}")  # alone too
    assert at == out.size
    return out
