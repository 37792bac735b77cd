"""Real agent frameworks against `iterserve serve`: does each finish its task, and which
4xx/5xx did the server answer?

    .venv/bin/python benchmarks/agent_frameworks/run.py [--only langchain] [--json PATH]

1. Makes the frameworks' own venv (`.venv-agents` in the repository root, reused when
   its requirements have not changed) and pip-installs requirements.txt there (pinned,
   with constraints.txt fixing every dependency); never into iterserve's .venv.
2. Starts `iterserve serve` (this interpreter's iterserve, the bundled model unless
   --model says otherwise, a free port) and waits for /health.
3. Runs each scenario (scenario_*.py, one process per case, in the frameworks' venv)
   against a recording proxy in front of the server: every request, its status, and
   for a 4xx/5xx the request body and the server's answer. The server's own access log
   (iterserve.access lines) is read too, as a check that the proxy saw every status.
4. Prints a table and writes JSON (default bench_results/agent_frameworks.json).

A case "finishes" when the framework returned its result without an exception and the
result has the expected type (scenario_*.py say what each checks); it passes when it
finished and the server answered no 4xx/5xx (no scenario asks for one). No timing:
the figures are statuses. Needs PyPI only to install the frameworks; the server never
reaches the network.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the modules the scripts share
from _results import write_results  # type: ignore[import-not-found]  # noqa: E402
from _served import (  # type: ignore[import-not-found]  # noqa: E402
    access_statuses,
    ensure_venv,
    free_port,
    get_json,
    installed_versions,
    iterserve_server,
    served_source,
)

RESULT_MARK = "AGENT_RESULT "
RUNNER_PATHS = ("/reset_prefix_cache", "/health")  # the runner's requests, not a case's
# Packages whose versions the results record.
FRAMEWORKS = ("openai-agents", "langchain-openai", "langchain-anthropic", "langchain-ollama",
              "langchain-core", "ollama", "litellm",
              "pydantic-ai-slim", "instructor", "openai", "anthropic", "httpx",
              "pydantic")  # fmt: skip


@dataclass(frozen=True)
class Case:
    framework: str
    script: str
    case: str
    known: str = ""  # why it is expected to fail today, and whose work would change that

    @property
    def name(self) -> str:
        return f"{self.framework}/{self.case}"


CASES = [
    Case("openai-agents", "scenario_openai_agents.py", "responses"),
    Case("openai-agents", "scenario_openai_agents.py", "responses_streamed"),
    Case("openai-agents", "scenario_openai_agents.py", "chat"),
    Case("openai-agents", "scenario_openai_agents.py", "chat_streamed"),
    Case("openai-agents", "scenario_openai_agents.py", "responses_output_type"),
    Case("openai-agents", "scenario_openai_agents.py", "chat_output_type"),
    Case("openai-agents", "scenario_openai_agents.py", "responses_chained"),
    Case("openai-agents", "scenario_openai_agents.py", "responses_conversations_session"),
    Case("openai-agents", "scenario_openai_agents.py", "responses_conversation_id"),
    Case("langchain", "scenario_langchain.py", "bind_tools"),
    Case("langchain", "scenario_langchain.py", "bind_tools_streamed"),
    Case("langchain", "scenario_langchain.py", "responses_api_bind_tools"),
    Case("langchain", "scenario_langchain.py", "structured_json_schema"),
    Case("langchain", "scenario_langchain.py", "structured_function_calling"),
    Case("langchain", "scenario_langchain.py", "anthropic_bind_tools"),
    Case("langchain", "scenario_langchain.py", "anthropic_bind_tools_streamed"),
    Case("langchain", "scenario_langchain.py", "anthropic_structured"),
    Case("langchain", "scenario_langchain.py", "ollama_tools"),
    Case("langchain", "scenario_langchain.py", "ollama_tools_streamed"),
    Case("langchain", "scenario_langchain.py", "ollama_structured"),
    Case("litellm", "scenario_litellm.py", "openai_tools"),
    Case("litellm", "scenario_litellm.py", "openai_tools_streamed"),
    Case("litellm", "scenario_litellm.py", "openai_embedding"),
    Case("litellm", "scenario_litellm.py", "hosted_vllm_tools"),
    Case("litellm", "scenario_litellm.py", "hosted_vllm_structured"),
    Case("litellm", "scenario_litellm.py", "ollama_chat_tools"),
    Case("litellm", "scenario_litellm.py", "ollama_chat_tools_streamed"),
    Case("litellm", "scenario_litellm.py", "ollama_chat_structured"),
    Case("litellm", "scenario_litellm.py", "ollama_generate"),
    Case("litellm", "scenario_litellm.py", "ollama_embedding"),
    Case("pydantic-ai", "scenario_pydantic_ai.py", "tool_output"),
    Case("pydantic-ai", "scenario_pydantic_ai.py", "native_output"),
    Case("pydantic-ai", "scenario_pydantic_ai.py", "tool_output_streamed"),
    Case("pydantic-ai", "scenario_pydantic_ai.py", "responses"),
    Case("pydantic-ai", "scenario_pydantic_ai.py", "anthropic"),
    Case("pydantic-ai", "scenario_pydantic_ai.py", "anthropic_streamed"),
    Case("instructor", "scenario_instructor.py", "default_tools"),
    Case("instructor", "scenario_instructor.py", "json_schema"),
    Case(
        "instructor",
        "scenario_instructor.py",
        "json",
        known="Mode.JSON asks only for some JSON object (response_format json_object), the "
        "schema in the prompt; the bundled 135M model's object has other keys (the model)",
    ),
    Case("instructor", "scenario_instructor.py", "tools_strict"),
    Case("instructor", "scenario_instructor.py", "responses_tools"),
]

# ---- the recording proxy ----------------------------------------------------------------

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
               "proxy-connection", "te", "trailer", "upgrade"}  # fmt: skip


@dataclass
class Recorder:
    """What the proxy saw, by case."""

    current: str = ""
    exchanges: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.exchanges.setdefault(self.current, []).append(entry)


def make_proxy(upstream: str, recorder: Recorder) -> ThreadingHTTPServer:
    """A proxy on a free loopback port that relays every request to `upstream`
    (http://HOST:PORT) and records it."""
    target = urllib.parse.urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0 to the client: a body whose length is not known (a stream) ends when
        # the connection closes, so the proxy relays SSE as it comes, unbuffered.
        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            connection = http.client.HTTPConnection(target.hostname, target.port, timeout=900)
            connection.request(self.command, self.path, body=body or None, headers=headers)
            response = connection.getresponse()
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            if response.getheader("Content-Length"):
                self.send_header("Content-Length", response.getheader("Content-Length") or "")
            self.send_header("Connection", "close")
            self.end_headers()
            answer = bytearray()
            while chunk := response.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
                if response.status >= 400 or len(answer) < 4096:
                    answer += chunk
            connection.close()
            entry: dict[str, Any] = {
                "method": self.command,
                "path": self.path,
                "status": response.status,
                "request": _as_json(body),
            }
            if response.status >= 400:
                entry["response"] = _as_json(bytes(answer))
            recorder.add(entry)

        do_GET = do_POST = do_DELETE = _relay  # noqa: N815 - BaseHTTPRequestHandler's names

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - its signature
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def _as_json(data: bytes) -> Any:
    if not data:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return data[:4096].decode(errors="replace")


# ---- one case ---------------------------------------------------------------------------


def run_case(case: Case, python: Path, base_url: str, model: str, timeout: float) -> dict[str, Any]:
    env = {
        **os.environ,
        "AGENTS_BASE_URL": base_url,
        "AGENTS_MODEL": model,
        "OPENAI_API_KEY": "sk-dummy-key",
        "OPENAI_BASE_URL": base_url,
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    env.pop("PYTHONPATH", None)  # the frameworks' venv sees nothing of iterserve's
    started = time.monotonic()
    try:
        done = subprocess.run(
            [str(python), str(HERE / case.script), "--case", case.case],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as expired:
        stderr = (
            expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else ""
        )
        return {"finished": False, "error": f"timed out after {timeout:.0f} s",
                "stderr_tail": stderr[-3000:]}  # fmt: skip
    result: dict[str, Any] = {"finished": False, "error": "the scenario printed no result"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK) :])
    result["exit_code"] = done.returncode
    result["seconds"] = round(time.monotonic() - started, 1)  # a guide to the wait, not a timing
    if not result["finished"]:
        result["stderr_tail"] = done.stderr[-3000:]
    return result


def summarize_statuses(exchanges: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for entry in exchanges:
        key = f"{entry['method']} {entry['path']} {entry['status']}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def print_table(rows: list[dict[str, Any]]) -> None:
    width = max(len(row["case"]) for row in rows)
    print(f"\n{'case':<{width}}  finished  4xx/5xx  statuses / cause")
    for row in rows:
        errors = [e for e in row["exchanges"] if e["status"] >= 400]
        statuses = ", ".join(f"{k} x{v}" for k, v in row["statuses"].items()) or "-"
        cause = row.get("error") or ""
        if row.get("known") and not row["passed"]:
            cause = f"known: {row['known']}. {cause}"
        print(f"{row['case']:<{width}}  {'yes' if row['finished'] else 'NO':<8}  "
              f"{len(errors):<7}  {statuses}{'  | ' + cause[:160] if cause else ''}")  # fmt: skip
        for error in errors:
            message = error.get("response")
            if isinstance(message, dict):
                message = message.get("error", message)
            print(f"{'':<{width}}    {error['status']} {error['path']}: {str(message)[:200]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-agents",
                        help="the frameworks' venv (made if missing)")  # fmt: skip
    parser.add_argument("--reinstall", action="store_true", help="pip install again")
    parser.add_argument("--model", default=None, help="served model (default: the bundled one)")
    parser.add_argument("--url", default=None,
                        help="use this running server (http://HOST:PORT) instead of starting "
                        "one; its access log is then not read")  # fmt: skip
    parser.add_argument("--server-arg", action="append", default=[],
                        help="one more `iterserve serve` argument (repeatable)")  # fmt: skip
    parser.add_argument("--only", action="append", default=[],
                        help="run the cases whose name contains this (repeatable)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    parser.add_argument("--server-wait", type=float, default=1800.0,
                        help="seconds to wait for /health (a cold start compiles kernels)")  # fmt: skip
    parser.add_argument("--json", default="bench_results/agent_frameworks.json")
    parser.add_argument("--server-log", type=Path, default=Path("bench_results/agent_frameworks_server.log"))  # fmt: skip
    args = parser.parse_args()

    cases = [c for c in CASES if not args.only or any(o in c.name for o in args.only)]
    if not cases:
        parser.error("--only matched no case")
    python = ensure_venv(args.venv.resolve(), HERE, args.reinstall)
    versions = installed_versions(python, FRAMEWORKS)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if args.url:
            upstream = args.url.rstrip("/").removesuffix("/v1")
            log_path = None  # its access log is wherever that server writes it
        else:
            port = free_port()
            log_path = args.server_log
            stack.enter_context(
                iterserve_server(port, args.model, args.server_arg, log_path, args.server_wait)
            )
            upstream = f"http://127.0.0.1:{port}"
        model = get_json(f"{upstream}/v1/models")["data"][0]["id"]
        recorder = Recorder()
        proxy = make_proxy(upstream, recorder)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        stack.callback(proxy.shutdown)
        base_url = f"http://127.0.0.1:{proxy.server_address[1]}/v1"
        log_offset = access_statuses(log_path, 0, RUNNER_PATHS)[1] if log_path else 0
        for case in cases:
            print(f"running {case.name}", flush=True)
            # Each case from a cold prefix cache: a cached prefix changes the attention's
            # split, and so can move a near-tie of greedy decoding (docs/kernels.md).
            reset = urllib.request.Request(f"{upstream}/reset_prefix_cache", method="POST")
            with contextlib.suppress(OSError), urllib.request.urlopen(reset, timeout=30):
                pass
            recorder.current = case.name
            result = run_case(case, python, base_url, model, args.timeout)
            access: list[dict[str, Any]] | None = None
            if log_path:
                time.sleep(1)  # the access line is written as the response ends
                access, log_offset = access_statuses(log_path, log_offset, RUNNER_PATHS)
            exchanges = recorder.exchanges.get(case.name, [])
            errors = [e for e in exchanges if e["status"] >= 400]
            errors += [a for a in access or [] if a["status"] >= 400]
            rows.append({
                "case": case.name,
                "known": case.known or None,
                **result,
                "passed": bool(result["finished"]) and not errors,
                "statuses": summarize_statuses(exchanges),
                "server_access_log": access,
                # The proxy and the server saw the same statuses (None: no log read).
                "access_log_agrees": None if access is None else sorted(
                    (a["path"], a["status"]) for a in access
                ) == sorted((e["path"].split("?")[0], e["status"]) for e in exchanges),
                "exchanges": exchanges,
            })  # fmt: skip
    print_table(rows)
    results = {
        "benchmark": "agent_frameworks",
        "date": datetime.date.today().isoformat(),
        "model": model,
        "server_args": args.server_arg,
        "iterserve": served_source() if not args.url else None,
        "versions": versions,
        "python": sys.version.split()[0],
        "cases": rows,
    }
    if args.json:
        write_results(args.json, results)
    # Fails on a case that failed for a reason not already known.
    return 0 if all(row["passed"] or row["known"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
