"""Tensor parallelism (--tensor-parallel-size): TP=2 over gloo gives TP=1's greedy tokens on
tiny random Llama and Qwen2 checkpoints (fp32), refuses what it cannot shard, and leaves no
worker process behind (closed, served, or its engine killed)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from conftest import _save_tiny
from iterserve.bench.server_process import launch_server
from iterserve.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig, engine_config
from iterserve.engine.llm import LLM
from iterserve.model.tensor_parallel import shard_weights
from iterserve.sampling_params import SamplingParams
from tiny_checkpoints import model_config_of, tiny_hf_model

pytestmark = pytest.mark.slow  # processes of their own, or the bundled model

# Prompts of different lengths, prefilled in chunks of 16 tokens over blocks of 4, then
# decoded across several more blocks, all batched together.
PROMPTS = [
    "Hello there, how are",
    "The capital of France is a city with many bridges, museums and old streets: " * 2,
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "A",
]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SETTINGS = dict(
    dtype="float32",
    device="cpu",
    compile=False,
    block_size=4,
    num_kv_blocks=256,
    max_model_len=256,
    max_num_batched_tokens=16,
    max_num_seqs=4,
)


def _checkpoint(kind: str, out: Path, tokenizer_dir: Path) -> Path:
    # Every weight drawn afresh (biases, norms too: Llama's o_proj bias is added by rank 0
    # only), so greedy text is varied rather than one token repeated.
    return _save_tiny(
        kind,
        out,
        tokenizer_dir,
        weight_std=0.15,
        attention_bias=True,
        tie_word_embeddings=kind == "llama",
    )


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Path:
    return _checkpoint(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    """One process's greedy tokens (T=1: today's path)."""
    tokens, _ = _greedy(checkpoint, 1)
    assert all(len(set(t)) > 3 for t in tokens), "degenerate text would prove little"
    return tokens


def _greedy(model: Path, size: int, **settings: object) -> tuple[list[list[int]], list[int]]:
    """Greedy token ids of every prompt, and the engine's worker pids (closed by now)."""
    with LLM(str(model), tensor_parallel_size=size, **{**SETTINGS, **settings}) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        network = llm.engine.executor.network
        pids = list(getattr(network, "worker_pids", []))
    return [o.token_ids for o in outputs], pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a parent outside this test) counts as gone.
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(") ")[-1].startswith("Z"))


def _wait_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def test_tp2_greedy_output_is_tp1s(checkpoint: Path, reference: list[list[int]]) -> None:
    got, pids = _greedy(checkpoint, 2)
    assert got == reference
    assert len(pids) == 1 and _wait_gone(pids) == []
    assert multiprocessing.active_children() == []


# One architecture is enough: the guesses only change the step plan.
@pytest.mark.parametrize("checkpoint", ["llama"], indirect=True)
def test_tp2_verifies_ngram_guesses_as_tp1_decodes(
    checkpoint: Path, reference: list[list[int]]
) -> None:
    with LLM(
        str(checkpoint), tensor_parallel_size=2, speculative_method="ngram", **SETTINGS
    ) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert sum(o.num_accepted_tokens for o in outputs) > 0  # some steps verified guesses
    assert [o.token_ids for o in outputs] == reference


@pytest.mark.parametrize("checkpoint", ["llama"], indirect=True)
def test_tp2_sizes_an_auto_pool_from_an_estimate(
    checkpoint: Path, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers allocate their shares as they start: the pool is sized before any shard
    exists, from what is available less the checkpoint's bytes, then capped as ever."""
    from iterserve.engine import available_memory
    from iterserve.engine.kv_pool_size import AvailableMemory

    gib = 2**30
    monkeypatch.setattr(available_memory, "measure", lambda device: AvailableMemory(gib, "fake"))
    auto = {**SETTINGS, "num_kv_blocks": None, "max_model_len": None}
    with LLM(str(checkpoint), tensor_parallel_size=2, **auto) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        pool = llm.engine.kv_pool
        shard_bytes = llm.engine.model_plan.weight_bytes  # rank 0's, as /metrics reports it
    weight_bytes = 4 * sum(t.numel() for t in load_file(checkpoint / "model.safetensors").values())
    assert 0 < shard_bytes < weight_bytes
    assert pool.available == AvailableMemory(
        gib - weight_bytes, f"estimate: fake less the checkpoint's {weight_bytes / gib:.2f} GiB"
    )
    assert pool.capped and pool.num_blocks == 4 * 512 // 4  # 4 sequences of 512 tokens
    assert [o.token_ids for o in outputs] == reference


def test_shards_put_back_together_are_the_weights() -> None:
    hf = tiny_hf_model(vocab_size=64, weight_std=0.1, attention_bias=True)
    config, weights = model_config_of(hf), hf.state_dict()
    shards = [shard_weights(weights, config, rank, 2) for rank in range(2)]
    p = "model.layers.0."
    for name, dim in [("self_attn.q_proj.weight", 0), ("mlp.down_proj.weight", 1)]:
        whole = torch.cat([shard[p + name] for shard in shards], dim)
        torch.testing.assert_close(whole, weights[p + name], rtol=0, atol=0)
    # k/v: rank r holds KV head r of 2, whose query heads (2r, 2r+1) it also holds.
    assert shards[1][p + "self_attn.k_proj.weight"].shape == (config.head_dim, config.hidden_size)
    torch.testing.assert_close(
        shards[0][p + "self_attn.o_proj.bias"], weights[p + "self_attn.o_proj.bias"]
    )
    assert not shards[1][p + "self_attn.o_proj.bias"].any()  # added once, by rank 0


@pytest.mark.parametrize("size", [3, 4])
def test_indivisible_head_counts_are_refused(tiny_llama_dir: Path, size: int) -> None:
    # 4 attention heads, 2 KV heads: 3 divides neither, 4 not the KV heads.
    with pytest.raises(ConfigError, match=f"--tensor-parallel-size {size} does not divide"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=size, **SETTINGS)
    assert multiprocessing.active_children() == []  # refused before any worker started


def test_settings_tensor_parallelism_cannot_run_are_refused() -> None:
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be at least 1"):
        engine_config({"tensor_parallel_size": 0})
    for setting in ({"weights": "int8"}, {"batch_invariant": True}):
        with pytest.raises(ConfigError, match="not supported with --tensor-parallel-size 2"):
            engine_config({"tensor_parallel_size": 2, **setting})


@pytest.fixture
def qwen2_checkpoint(tmp_path: Path, tokenizer_dir: Path) -> Path:
    return _checkpoint("qwen2", tmp_path / "qwen2", tokenizer_dir)


def test_served_with_tp2_over_http_then_workers_end(qwen2_checkpoint: Path) -> None:
    config = EngineConfig(
        model=str(qwen2_checkpoint),
        dtype="float32",
        compile=False,
        tensor_parallel_size=2,
        cache=CacheConfig(num_kv_blocks=256),
        scheduler=SchedulerConfig(max_model_len=256),
    )
    with launch_server(config, startup_timeout=120) as server:
        workers = _children(server.process.pid)
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
        server.stop()  # SIGTERM: the server closes its workers on the way out
        assert server.process.returncode in (0, -signal.SIGTERM), server.log_tail()
    assert workers and _wait_gone(workers) == []
    with LLM(str(qwen2_checkpoint), **{**SETTINGS, "block_size": 16}) as llm:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        assert llm.generate(PROMPTS[1], params, use_tqdm=False)[0].text == text


@pytest.fixture
def killed_engine(tiny_llama_dir: Path) -> Iterator[subprocess.Popen[str]]:
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from iterserve.engine.llm import LLM
        if __name__ == "__main__":
            llm = LLM({str(tiny_llama_dir)!r}, tensor_parallel_size=2, **{SETTINGS!r})
            print(*llm.engine.executor.network.worker_pids, flush=True)
            time.sleep(120)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    yield process
    process.kill()
    process.wait()


def test_workers_exit_when_the_engine_process_is_killed(
    killed_engine: subprocess.Popen[str],
) -> None:
    assert killed_engine.stdout is not None
    workers = [int(pid) for pid in killed_engine.stdout.readline().split()]
    assert workers and all(_alive(pid) for pid in workers)  # running while the engine lives
    killed_engine.send_signal(signal.SIGKILL)  # no chance to say Shutdown
    killed_engine.wait()
    assert _wait_gone(workers) == []
