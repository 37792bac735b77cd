"""`iterserve serve MODEL`, as `vllm serve MODEL` is typed, names the same model as --model."""

from __future__ import annotations

import pytest

from iterserve.cli import build_parser
from iterserve.cli.serve import take_model_tag
from iterserve.config import engine_config_from_args


def _model_of(argv: list[str]) -> str | None:
    args = build_parser().parse_args(["serve", *argv])
    take_model_tag(args)
    return engine_config_from_args(args).model


def test_a_positional_model_is_the_model() -> None:
    assert _model_of(["./llama-1b.Q4_K_M.gguf", "--port", "8001"]) == "./llama-1b.Q4_K_M.gguf"
    assert _model_of(["--port", "8001", "./my-llama"]) == "./my-llama"


def test_the_flag_alone_and_neither_work_as_before() -> None:
    assert _model_of(["--model", "./my-llama"]) == "./my-llama"
    assert _model_of([]) is None  # the bundled model


def test_the_same_model_twice_is_one_model() -> None:
    assert _model_of(["./my-llama", "--model", "./my-llama"]) == "./my-llama"


def test_two_different_models_are_refused_naming_both() -> None:
    with pytest.raises(SystemExit, match="a.gguf.*b.gguf"):
        _model_of(["a.gguf", "--model", "b.gguf"])
