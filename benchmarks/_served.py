"""What the scripts that run real clients against `iterserve serve` share
(agent_frameworks/run.py, eval_harness/run.py, open_webui/run.py): the clients' own venv,
pinned by a folder's requirements.txt and constraints.txt; an `iterserve serve` process on a
free port, and waiting for a process's health; and the statuses its access log recorded.
Nothing here imports iterserve (that would load torch in a script that only drives
processes)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

ACCESS_MARK = "iterserve.access: "

# ---- the clients' venv ------------------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, pins: Path, reinstall: bool) -> Path:
    """`venv` with `pins`/requirements.txt installed under `pins`/constraints.txt (every
    dependency pinned); a stamp of their hash skips pip when nothing changed. Its python."""
    requirements, constraints = pins / "requirements.txt", pins / "constraints.txt"
    wanted = hashlib.sha256(requirements.read_bytes() + constraints.read_bytes()).hexdigest()
    stamp = venv / ".iterserve-requirements"
    python = venv_python(venv)
    if not python.exists():
        print(f"making {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if reinstall or not stamp.exists() or stamp.read_text() != wanted:
        print(f"installing {requirements} into {venv}", flush=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "-r", str(requirements), "-c", str(constraints)],
            check=True,
        )  # fmt: skip
        stamp.write_text(wanted)
    return python


def installed_versions(python: Path, names: Collection[str]) -> dict[str, str | None]:
    """The installed version of each named distribution in `python`'s environment."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: out[name] = None\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [str(python), "-c", code, *names], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout)


def served_source() -> dict[str, str | None]:
    """Which iterserve the server runs: this interpreter's (PYTHONPATH included), and its
    checkout's commit, found without importing it."""
    spec = importlib.util.find_spec("iterserve")
    where = Path(spec.origin).parent if spec and spec.origin else None
    commit = None
    if where is not None:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            commit = subprocess.run(
                ["git", "-C", str(where), "rev-parse", "HEAD"],
                check=True, capture_output=True, text=True,
            ).stdout.strip()  # fmt: skip
    return {"package": None if where is None else str(where), "commit": commit}


# ---- the server -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def iterserve_server(
    port: int, model: str | None, extra: list[str], log_path: Path, wait_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    """`iterserve serve` (this interpreter's) on `port`, its output in `log_path`, from
    healthy to stopped."""
    command = [sys.executable, "-m", "iterserve.cli", "serve", "--port", str(port)]
    if model:
        command += ["--model", model]
    command += extra
    print("starting:", " ".join(command), flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}/health", wait_s, log_path)
        yield server
    finally:
        stop(server)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, and SIGKILL if it has not ended within a minute."""
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_healthy(process: subprocess.Popen[bytes], url: str, wait_s: float, log_path: Path) -> None:
    """Wait until `url` answers a health status (`"ok"`, or Open WebUI's `true`); raise if
    `process` exits first or `wait_s` passes."""
    deadline = time.monotonic() + wait_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited ({process.returncode}): see {log_path}")
        with contextlib.suppress(OSError, ValueError):
            if get_json(url).get("status") in ("ok", True):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} was not healthy within {wait_s:.0f} s: see {log_path}")
        time.sleep(2)


def access_statuses(
    log_path: Path, start: int, ignored: Collection[str] = ()
) -> tuple[list[dict[str, Any]], int]:
    """The server's access-log lines (method, path, status) written since byte `start`,
    but for the paths in `ignored`, and the new end."""
    with open(log_path, "rb") as log:
        log.seek(start)
        data = log.read()
    complete = data[: data.rfind(b"\n") + 1]
    lines = []
    for line in complete.decode(errors="replace").splitlines():
        _, mark, payload = line.partition(ACCESS_MARK)
        if mark:
            with contextlib.suppress(ValueError):
                entry = json.loads(payload)
                if entry.get("path") not in ignored:
                    lines.append({k: entry.get(k) for k in ("method", "path", "status")})
    return lines, start + len(complete)
