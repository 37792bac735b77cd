"""A quantized GGUF loads in about its own size (issue 34's bounds): a file of a real model's
layout (Q4_K with Q6_K where llama.cpp's Q4_K_M puts it, ~400 MB) loaded by `LLM` in a child
process, whose high-water mark (VmHWM: imports included) and resident set after the load are
read from /proc:

    peak <= file x 1.2 + KV pool + 0.5 GB,    held <= file x 1.1 + KV pool + 0.3 GB

A dense copy of the projections (bf16: 1.4 GB here) or a second copy of the blocks fails it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve import kernels
from iterserve.bench.shaped_gguf import Shape, q4_k_m_types, write_shaped_gguf

# A ~0.7B-parameter body (12 layers of 2048, 4 kv heads) with the bundled tokenizer.
_BODY = Shape("llama", "a test body", 2048, 5632, 12, 16, 4, 128, 10000.0, 4096, 1e-5)

_CHILD = r"""
import json, re, sys
def status(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
from iterserve.engine.llm import LLM
llm = LLM(sys.argv[1], kv_cache_memory=0.05)
engine = llm.engine
print(json.dumps({"peak": status("VmHWM"), "held": status("VmRSS"), "kv": engine.kv_pool.bytes,
                  "weights": engine.model_plan.weights}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason=f"no C++ kernels: {kernels.why_unavailable()}")
def test_a_quantized_gguf_loads_in_about_its_own_size(tmp_path: Path) -> None:
    path = write_shaped_gguf(tmp_path / "body.Q4_K_M.gguf", _BODY, blocks=q4_k_m_types)
    size = path.stat().st_size
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["weights"] == "Q4_K+Q6_K"  # the file's blocks, as they are
    assert got["peak"] <= 1.2 * size + got["kv"] + 0.5e9, got
    assert got["held"] <= 1.1 * size + got["kv"] + 0.3e9, got
