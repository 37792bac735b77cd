"""Every script in benchmarks/ still imports and parses its arguments: they are not run by
the tests (they time things), so an API change could otherwise break one unnoticed (one
did: attention_kernel.py imported a name that had moved)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# A leading underscore marks a module the scripts share, not a script. A folder's run.py
# is its script (agent_frameworks/, eval_harness/: what they drive needs its own venv).
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")) + sorted(
    BENCHMARKS.glob("*/run.py")
)


def test_there_are_scripts() -> None:
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize(
    "script", SCRIPTS, ids=[s.relative_to(BENCHMARKS).with_suffix("").as_posix() for s in SCRIPTS]
)
def test_the_script_imports_and_answers_help(
    script: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # scripts import their siblings
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(script), run_name="__main__")
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out
