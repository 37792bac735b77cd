"""Weights that cannot fit are refused before they are built (engine/weights_fit.py): the
floor it counts is what the network then holds, or a little under; the refusal names both
figures; free swap counts where no cgroup limit binds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iterserve import kernels
from iterserve.bench.shaped_gguf import Shape, q4_k_m_types, write_shaped_gguf
from iterserve.config import CacheConfig, ConfigError, EngineConfig, WeightFormat
from iterserve.engine import available_memory
from iterserve.engine.kv_pool_size import AvailableMemory
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.weights_fit import check_weights_fit, weight_bytes_at_least
from iterserve.model.loader import load_model

MIB = 2**20
_TINY = Shape("llama", "a tiny body", 256, 512, 2, 4, 2, 64, 10000.0, 512, 1e-5)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shaped") / "tiny.Q4_K_M.gguf"
    return write_shaped_gguf(out, _TINY, blocks=q4_k_m_types)


def config(model: Path, weights: WeightFormat = "auto") -> EngineConfig:
    cache = CacheConfig(num_kv_blocks=8)
    return EngineConfig(model=str(model), compile=False, weights=weights, cache=cache)


@pytest.mark.parametrize("weights", ["auto", "int8", "bf16"])
def test_the_floor_is_what_the_network_holds_or_a_little_under(
    q4_k_m: Path, weights: WeightFormat
) -> None:
    engine = LLMEngine(config(q4_k_m, weights), warm_up=False)
    try:
        built = engine.model_plan.weight_bytes
    finally:
        engine.close()
    floor = weight_bytes_at_least(load_model(str(q4_k_m), torch.bfloat16), weights)
    assert floor <= built, (floor, built)
    if kernels.available():  # the kernels' formats: the floor is the network's bytes, nearly
        assert floor >= 0.9 * built, (floor, built)


def test_a_dense_checkpoint_counts_two_bytes_a_weight(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), torch.bfloat16)
    numel = sum(t.numel() for t in loaded.weights.values())
    assert weight_bytes_at_least(loaded, "auto") == 2 * numel


def test_weights_past_what_is_available_are_refused_before_they_are_built(
    q4_k_m: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        available_memory, "host_room", lambda: AvailableMemory(4 * MIB, "cgroup /x")
    )
    built: list[object] = []
    monkeypatch.setattr(LLMEngine, "_network", lambda *args: built.append(args))
    with pytest.raises(ConfigError) as refused:
        LLMEngine(config(q4_k_m))
    message = str(refused.value)
    floor = weight_bytes_at_least(load_model(str(q4_k_m), torch.bfloat16), "auto")
    assert f"needs at least {floor / 2**30:.2f} GiB" in message
    assert "more than the 0.00 GiB available (cgroup /x)" in message
    assert "the file's quantized blocks" in message and built == []


def test_free_swap_counts_where_no_cgroup_binds(
    q4_k_m: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loaded = load_model(str(q4_k_m), torch.bfloat16)
    floor = weight_bytes_at_least(loaded, "auto")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(f"SwapFree: {floor // 1024} kB\n")
    cpu = torch.device("cpu")
    for source in ("MemAvailable", "MemAvailable less 1.00 GiB reserved ...", "cgroup /x"):
        monkeypatch.setattr(available_memory, "host_room", lambda s=source: AvailableMemory(MIB, s))
        if source.startswith("MemAvailable"):
            check_weights_fit(loaded, "auto", cpu, root=tmp_path)  # RAM and swap hold it
        else:
            with pytest.raises(ConfigError, match="more than the 0.00 GiB available"):
                check_weights_fit(loaded, "auto", cpu, root=tmp_path)
