"""The command line starts without torch or transformers: `iterserve --help`, and a
benchmark client that needs only a tokenizer, do not pay seconds to import them."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_and_the_benchmark_client_import_no_torch() -> None:
    code = (
        "import sys, iterserve.cli.main, iterserve.bench.tokenizer, iterserve.bench.client\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
