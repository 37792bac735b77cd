"""A GGUF model in parts, as llama.cpp's `llama-gguf-split` cuts one and hubs publish the
larger ones: opened by its first part (or a directory of its parts), it is the same model as
the whole file, to the bit; a part missing, misnamed or out of place is refused naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from openai import OpenAI

from iterserve.bench.bandwidth import checkpoint_bytes
from iterserve.bench.server_process import launch_server
from iterserve.config import CacheConfig, EngineConfig
from iterserve.engine.llm import LLM
from iterserve.model.bundled import default_model_path
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_loader import read_gguf_header
from iterserve.model.loader import load_model
from iterserve.sampling_params import SamplingParams
from tiny_gguf import split_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
PARTS = 3


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The bundled model (trained weights, Q4_1 and Q8_0 blocks) in three parts."""
    return split_gguf(default_model_path(), tmp_path_factory.mktemp("split"), PARTS)


def _answers(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    return [
        (out.token_ids, [step.logprob for step in out.logprobs or [] if step is not None])
        for out in llm.generate(PROMPTS, params)
    ]


def test_the_parts_are_the_whole_file_to_the_bit(parts: list[Path]) -> None:
    whole = _answers(LLM(None, compile=False))
    split = LLM(str(parts[0]), compile=False)
    assert _answers(split) == whole
    assert split.engine.model_name == "SmolLM2-135M-Instruct"  # no "-00001-of-00003"


def test_every_tensor_is_read_from_its_own_part(parts: list[Path]) -> None:
    _, whole = read_gguf_header(default_model_path())
    metadata, tensors = read_gguf_header(parts[0])
    assert metadata["split.count"] == PARTS
    assert tensors.keys() == whole.keys()
    assert {info.path for info in tensors.values()} == set(parts)
    data = {path: path.read_bytes() for path in [*parts, default_model_path()]}  # once each
    for name, info in tensors.items():
        assert (info.shape, info.qtype, info.nbytes) == (
            whole[name].shape,
            whole[name].qtype,
            whole[name].nbytes,
        )
        assert (
            data[info.path][info.offset : info.offset + 64]
            == data[default_model_path()][whole[name].offset : whole[name].offset + 64]
        )


def test_a_directory_of_parts_is_the_model(parts: list[Path]) -> None:
    assert load_model(parts[0].parent).config == load_model(None).config
    assert checkpoint_bytes(parts[0]) == sum(p.stat().st_size for p in parts)


def test_served_by_its_first_part(parts: list[Path]) -> None:
    """`iterserve serve` on the first part, asked through the openai client."""
    config = EngineConfig(model=str(parts[0]), compile=False, cache=CacheConfig(num_kv_blocks=64))
    with launch_server(config, startup_timeout=120) as running:
        client = OpenAI(base_url=f"{running.base_url}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        answer = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=8, temperature=0
        )
    offline = LLM(None, compile=False).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8)
    )
    assert answer.choices[0].text == offline[0].text


def test_a_later_part_names_the_first(parts: list[Path]) -> None:
    with pytest.raises(ModelLoadError, match=f"part 2 of 3.*by its first part, {parts[0].name}"):
        load_model(parts[1])


def test_a_missing_part_is_named(parts: list[Path], tmp_path: Path) -> None:
    for part in parts[:2]:
        shutil.copy(part, tmp_path / part.name)
    with pytest.raises(ModelLoadError, match=f"part 3, .*{parts[2].name}, is missing"):
        load_model(tmp_path / parts[0].name)


def test_a_renamed_first_part_says_how_parts_are_found(parts: list[Path], tmp_path: Path) -> None:
    renamed = tmp_path / "model.gguf"
    shutil.copy(parts[0], renamed)
    with pytest.raises(ModelLoadError, match="-00001-of-00003.gguf"):
        load_model(renamed)


def test_a_part_out_of_place_is_refused(parts: list[Path], tmp_path: Path) -> None:
    shutil.copy(parts[0], tmp_path / parts[0].name)
    shutil.copy(parts[2], tmp_path / parts[1].name)  # part 3 where part 2 belongs
    shutil.copy(parts[2], tmp_path / parts[2].name)
    with pytest.raises(ModelLoadError, match="says it is part 3 of 3, where .* makes it part 2"):
        load_model(tmp_path / parts[0].name)


def test_a_directory_of_two_models_is_refused(parts: list[Path], tmp_path: Path) -> None:
    for part in parts:
        shutil.copy(part, tmp_path / part.name)
    shutil.copy(default_model_path(), tmp_path / "another.gguf")
    with pytest.raises(ModelLoadError, match="one GGUF model"):
        load_model(tmp_path)
