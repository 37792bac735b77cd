"""docs/flags.md is what `iterserve flags` prints now: the flag list cannot drift."""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve.cli import main
from iterserve.cli.flags_doc import REGENERATE, render_markdown
from iterserve.config import SECTIONS, EngineConfig, _leaf_fields

FLAGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def test_flags_doc_is_current() -> None:
    assert FLAGS_DOC.read_text() == render_markdown(), f"stale: run `{REGENERATE}`"


def test_every_engine_setting_and_server_flag_is_listed() -> None:
    # Independent of the renderer: the config's own fields and the flags named in the issue.
    text = FLAGS_DOC.read_text()
    for cls in (EngineConfig, *SECTIONS.values()):
        for f in _leaf_fields(cls):
            name = f.name.replace("_", "-")
            assert f"`--{name}`" in text or f"`--[no-]{name}`" in text, f.name
    for flag in ("--served-model-name", "--tool-call-parser", "--reasoning-parser", "--port"):
        assert f"`{flag}`" in text


def test_the_cli_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["flags"]) == 0
    assert capsys.readouterr().out == render_markdown()
