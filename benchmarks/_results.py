"""Where a benchmark's figures go: one JSON file (its folder made if need be), named on
the console so a run's log says where its numbers are."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(path: str | Path, results: object) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return out
