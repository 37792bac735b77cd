"""A request trace on disk (arrival time, prompt length, output length per row) -> TraceRows.

The default is the Azure LLM inference trace (conversation, 2023), shipped inside the
package in bench/traces/ with its MIT licence beside it (LICENSE.vidur); any CSV with the
columns `arrived_at`, `num_prefill_tokens`, `num_decode_tokens` can be given instead. The full trace (~5.5 req/s of ~1k-token prompts)
would swamp a CPU, so it is cut to fit: the first `num_requests` rows (keeping the trace's
own bursts), lengths clipped, and time stretched or squeezed.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

TRACE_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
AZURE_CONV_FILE = "azure_conv_2023.csv"
TRACES_DIR = Path(__file__).resolve().with_name("traces")


@dataclass(frozen=True)
class TraceRow:
    arrival: float  # seconds after the first kept row, already time-scaled
    prompt_len: int
    output_len: int


def default_trace_path() -> Path:
    """The Azure conversation trace shipped with the package (package data, so a wheel or a
    non-editable install has it too)."""
    path = TRACES_DIR / AZURE_CONV_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"no {AZURE_CONV_FILE} at {path} (a broken install?); pass --trace PATH to a CSV "
            "with columns " + ", ".join(TRACE_COLUMNS)
        )
    return path


def load_trace(
    path: str | Path | None = None,
    num_requests: int | None = None,
    time_scale: float = 1.0,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
) -> list[TraceRow]:
    """Read a trace, keep its first `num_requests` rows, clip lengths and scale time.

    `time_scale` multiplies every gap: 2.0 replays at half the rate, 0.1 at ten times it.
    Lengths are clipped (not dropped) so the arrival pattern stays the trace's own.
    """
    if time_scale <= 0:
        raise ValueError(f"--time-scale must be positive, got {time_scale}")
    path = Path(path) if path is not None else default_trace_path()
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"trace {path} lacks column(s) {', '.join(missing)}")
        for line in reader:
            rows.append(
                (
                    float(line["arrived_at"]),
                    int(float(line["num_prefill_tokens"])),
                    int(float(line["num_decode_tokens"])),
                )
            )
            if num_requests is not None and len(rows) >= num_requests:
                break
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    rows.sort(key=lambda row: row[0])
    start = rows[0][0]

    def clip(n: int, cap: int | None) -> int:
        return max(1, min(n, cap) if cap is not None else n)

    return [
        TraceRow((t - start) * time_scale, clip(p, max_prompt_len), clip(o, max_output_len))
        for t, p, o in rows
    ]
