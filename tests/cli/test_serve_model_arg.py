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


def test_llama_servers_command_line_starts_the_same_server() -> None:
    """llama-server's names for the same settings (-m, -hf, -c, -np, -t, -a, --jinja)."""
    argv = ["serve", "-m", "./qwen-coder.Q8_0.gguf", "-c", "8192", "-np", "4", "-t", "2",
            "-a", "coder", "--jinja", "--host", "0.0.0.0", "--port", "8012"]  # fmt: skip
    args = build_parser().parse_args(argv)
    take_model_tag(args)
    config = engine_config_from_args(args)
    assert config.model == "./qwen-coder.Q8_0.gguf" and config.num_threads == 2
    assert config.scheduler.max_model_len == 8192 and config.scheduler.max_num_seqs == 4
    assert args.served_model_name == ["coder"] and (args.host, args.port) == ("0.0.0.0", 8012)
    assert _model_of(["-hf", "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"]) == (
        "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"
    )
    zero = build_parser().parse_args(["serve", "-c", "0"])  # llama-server's "the model's own"
    assert engine_config_from_args(zero).scheduler.max_model_len is None
