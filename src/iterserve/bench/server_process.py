"""Start `iterserve serve` as a child process on a free loopback port, for one configuration.

A sweep that compares engine settings through the real HTTP path needs one server per
setting; tests need a live server. Either way: pick a port, start the process with the
settings as CLI flags, wait for /health, and stop it (SIGTERM, then SIGKILL) afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from iterserve.config import SECTIONS, EngineConfig


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_flags(config: EngineConfig) -> list[str]:
    """CLI flags that reproduce `config` (only settings that differ from the defaults)."""
    flags: list[str] = []
    sections: list[tuple[Any, Any]] = [(config, EngineConfig())] + [
        (getattr(config, name), cls()) for name, cls in SECTIONS.items()
    ]
    for obj, default in sections:
        for f in dataclasses.fields(obj):
            if "help" not in f.metadata:  # sub-sections, not settings
                continue
            value = getattr(obj, f.name)
            if value == getattr(default, f.name) or value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag[2:])
            else:
                flags += [flag, str(value)]
    return flags


def scrape_metrics(base_url: str) -> dict[str, float]:
    """Every sample of a server's /metrics as {'name{label="v",...}': value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    # The log is a temporary file of launch_server's own: removed at stop() when the server
    # wrote nothing to it (at --log-level warning, every clean run), so that a test suite
    # leaves no empty files behind; one with something in it stays, to be read.
    temporary_log: bool = False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.temporary_log and self.log_path.exists() and self.log_path.stat().st_size == 0:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def launch_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: list[str] | None = None,
    startup_timeout: float = 300.0,
    log_path: Path | None = None,
) -> ServerProcess:
    """Start a server for `config` and return once /health answers 200."""
    port = port or free_port(host)
    temporary_log = log_path is None
    if log_path is None:
        descriptor, name = tempfile.mkstemp(prefix="iterserve-serve-", suffix=".log")
        os.close(descriptor)
        log_path = Path(name)
    command = [
        sys.executable,
        "-m",
        "iterserve.cli",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *engine_flags(config),
        *(extra_args or []),
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
    server = ServerProcess(process, f"http://{host}:{port}", log_path, temporary_log)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"iterserve serve exited with {process.returncode}:\n{server.log_tail()}"
            )
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise TimeoutError(f"the server did not become healthy in {startup_timeout:.0f}s")
