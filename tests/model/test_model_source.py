"""A model named by its repository, found in the local Hugging Face cache (never downloaded):
vLLM's `vllm serve OWNER/NAME` and llama.cpp's `-hf OWNER/NAME:Q4_K_M` forms. Names only
here; a server and LLM loading a model so named: tests/server/test_hub_cache_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants

from hub_cache import cache_repo
from iterserve.model.errors import ModelLoadError
from iterserve.model.model_source import ModelSource, find_model, quant_tag

GGUF_FILES = [
    "Tiny-1B-Instruct-Q4_K_M.gguf",
    "Tiny-1B-Instruct-q8_0.gguf",
    "Tiny-1B-Instruct-UD-Q4_K_XL.gguf",
    "mmproj-Tiny-1B-F16.gguf",  # a vision projector, not a model
    "mmproj-Tiny-1B-F32.gguf",
    "BF16/Tiny-1B-Instruct-BF16-00001-of-00002.gguf",
    "BF16/Tiny-1B-Instruct-BF16-00002-of-00002.gguf",
    "README.md",
]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


@pytest.fixture
def gguf_repo(cache: Path, tmp_path: Path) -> Path:
    files = {}
    for name in GGUF_FILES:
        files[name] = tmp_path / "files" / name
        files[name].parent.mkdir(parents=True, exist_ok=True)
        files[name].write_bytes(b"GGUF")
    return cache_repo(cache, "acme/Tiny-1B-GGUF", files)


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("Llama-3.2-1B-Instruct.Q4_0.gguf", "Q4_0"),
        ("qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf", "q4_k_m"),
        ("Qwen3-8B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
        ("gemma-3-4b-it-IQ4_XS.gguf", "IQ4_XS"),
        ("Mistral-7B-Instruct-v0.3.BF16.gguf", "BF16"),
        ("phi-2.F16.gguf", "F16"),
        ("my-model.gguf", None),
    ],
)
def test_a_gguf_names_its_quantization_as_hubs_write_it(name: str, tag: str | None) -> None:
    assert quant_tag(Path(name)) == tag


def test_a_tag_picks_its_gguf_whatever_its_case_or_folder(gguf_repo: Path) -> None:
    def found(spec: str) -> ModelSource:
        return find_model(spec)

    # The repository's vision projector comes with any of its models (F16 before F32).
    assert found("acme/Tiny-1B-GGUF:Q8_0") == ModelSource(
        gguf_repo / "Tiny-1B-Instruct-q8_0.gguf",
        "acme/Tiny-1B-GGUF:Q8_0",
        projector=gguf_repo / "mmproj-Tiny-1B-F16.gguf",
    )
    assert found("acme/Tiny-1B-GGUF:ud-q4_k_xl").path.name == "Tiny-1B-Instruct-UD-Q4_K_XL.gguf"
    # A split model by its first part, in the folder hubs give large quantizations.
    assert found("acme/Tiny-1B-GGUF:BF16").path == (
        gguf_repo / "BF16" / "Tiny-1B-Instruct-BF16-00001-of-00002.gguf"
    )
    # No tag: llama.cpp's default, Q4_K_M; the path stays the snapshot's link, whose name the
    # loader reads (and a split model's other parts are found by).
    source = found("acme/Tiny-1B-GGUF")
    assert source.path == gguf_repo / "Tiny-1B-Instruct-Q4_K_M.gguf" and source.path.is_symlink()


def test_a_tag_the_snapshot_lacks_is_refused_naming_those_it_has(gguf_repo: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no GGUF model tagged Q5_K_M") as error:
        find_model("acme/Tiny-1B-GGUF:Q5_K_M")
    message = str(error.value)
    assert "BF16, Q4_K_M, UD-Q4_K_XL, q8_0" in message and "acme/Tiny-1B-GGUF:TAG" in message
    assert "mmproj" not in message


def test_an_hf_repository_is_its_snapshot_directory(cache: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    snapshot = cache_repo(cache, "acme/tiny", {"config.json": tmp_path / "config.json"})
    assert find_model("acme/tiny") == ModelSource(snapshot, "acme/tiny")


def test_without_refs_main_the_only_snapshot_is_taken_and_several_are_refused(
    cache: Path, tmp_path: Path
) -> None:
    (tmp_path / "a.Q4_0.gguf").write_bytes(b"GGUF")
    files = {"a.Q4_0.gguf": tmp_path / "a.Q4_0.gguf"}
    first = cache_repo(cache, "acme/a", files, commit="1" * 40, ref=False)
    assert find_model("acme/a").path == first / "a.Q4_0.gguf"
    cache_repo(cache, "acme/a", files, commit="2" * 40, ref=False)
    with pytest.raises(ModelLoadError, match="2 snapshots of acme/a"):
        find_model("acme/a")


def test_a_repository_not_in_the_cache_says_how_to_fetch_it(cache: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"never downloads.*hf download acme/none"):
        find_model("acme/none:Q4_K_M")
    # Neither a path nor a repository's name.
    with pytest.raises(ModelLoadError, match="does not exist"):
        find_model("./nope/x.gguf")


def test_a_path_and_none_are_what_they_were(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert find_model(tmp_path / "m.gguf") == ModelSource(tmp_path / "m.gguf")
    assert find_model(None).path.name.endswith(".gguf")  # the bundled model


def test_a_revision_is_a_ref_or_a_commit_the_cache_holds(cache: Path, tmp_path: Path) -> None:
    (tmp_path / "a.Q4_0.gguf").write_bytes(b"GGUF")
    files = {"a.Q4_0.gguf": tmp_path / "a.Q4_0.gguf"}
    old, new = "1" * 40, "2" * 40
    cache_repo(cache, "acme/a", files, commit=old, ref=False)
    cache_repo(cache, "acme/a", files, commit=new)  # main
    (cache / "models--acme--a" / "refs" / "v1.0").write_text(old)
    assert find_model("acme/a").path.parent.name == new
    assert find_model("acme/a", "v1.0").path.parent.name == old
    assert find_model("acme/a", old).path.parent.name == old
    with pytest.raises(ModelLoadError, match=r"refs main, v1.0 .*--revision v2.0"):
        find_model("acme/a", "v2.0")
