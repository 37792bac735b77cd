"""The Ray processes a test started, for the fleet tests: the cluster's daemons, and which
of some pids still run."""

from __future__ import annotations

import subprocess
from pathlib import Path


def ray_daemons(parent: int) -> set[int]:
    """Pids of the Ray cluster processes (GCS, raylet) that `parent` started: ray.init
    starts them as its children. (Other users' Ray clusters on this machine are not ours
    to count.)"""
    out = subprocess.run(
        ["pgrep", "-P", str(parent), "-f", "raylet|gcs_server"],
        capture_output=True,
        text=True,
        check=False,
    )
    return {int(pid) for pid in out.stdout.split()}


def running(pids: set[int]) -> set[int]:
    """Those of `pids` still running (an exited child not yet reaped is a zombie: gone)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive
