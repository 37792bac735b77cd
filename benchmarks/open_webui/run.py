"""Open WebUI in front of `iterserve serve`, as its users connect it: to Ollama's API, and to
an OpenAI API. Does each thing Open WebUI asks of its model server work?

    .venv/bin/python benchmarks/open_webui/run.py [--only ollama] [--json PATH]

1. Makes Open WebUI's own venv (`.venv-open-webui` in the repository root, reused when its
   pins have not changed; ~2 GB) from requirements.txt under constraints.txt.
2. Starts `iterserve serve` (this interpreter's, the bundled model unless --model says
   otherwise) on a free port.
3. For each connection (`ollama`: OLLAMA_BASE_URL at the server; `openai`: an OpenAI
   connection at its /v1), starts Open WebUI on a free port with a fresh data directory,
   no sign-in (WEBUI_AUTH=False) and nothing fetched (OFFLINE_MODE, its retrieval bypassed),
   and sends Open WebUI's own HTTP API what its web page sends: the model list, a chat
   whole and streamed, the title a new chat gets, structured output; through the Ollama
   connection also Open WebUI's /ollama routes (show, embed, generate, and a pull, which
   this server refuses) and a document dropped into a chat, which Open WebUI has the
   served model embed (its retrieval's embedding engine set to Ollama's API). Where the
   machine has Chromium (`apt install chromium`; `--chromium PATH`), Open WebUI's web page
   itself too, in each connection (page.py): a message typed and sent, the answer streamed
   to its end over the page's Socket.IO.
4. Prints a table (each check, whether it passed, which requests the server answered with
   which status) and writes JSON (default bench_results/open_webui.json).

No timing: the figures are statuses. Needs PyPI only to install Open WebUI; neither
process reaches the network.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
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
    stop,
    wait_healthy,
)

# Open WebUI's settings for a run with no network and no sign-in. Its settings live in its
# data directory's database once written, so every connection gets a fresh directory.
_OFFLINE = {
    "WEBUI_AUTH": "False",
    "WEBUI_SECRET_KEY": "iterserve-check",
    "OFFLINE_MODE": "True",
    "HF_HUB_OFFLINE": "1",
    "BYPASS_EMBEDDING_AND_RETRIEVAL": "True",
    "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False",
    "ENABLE_VERSION_UPDATE_CHECK": "False",
    "ANONYMIZED_TELEMETRY": "False",
    "DO_NOT_TRACK": "True",
    "SCARF_NO_ANALYTICS": "True",
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}


class Client:
    """Open WebUI's HTTP API as its web page uses it, signed in as its one user."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.token = self.post(
            "/api/v1/auths/signin", {"email": "admin@localhost", "password": ""}
        )["token"]

    def _open(
        self, method: str, path: str, data: bytes | None = None, kind: str = "application/json"
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": kind}
        if getattr(self, "token", None):
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.base + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def get(self, path: str) -> Any:
        return _ok(*self._open("GET", path))

    def post(self, path: str, body: Any) -> Any:
        return _ok(*self.post_raw(path, body))

    def post_raw(self, path: str, body: Any) -> tuple[int, bytes]:
        return self._open("POST", path, json.dumps(body).encode())

    def upload(self, name: str, text: str) -> Any:
        """A text file uploaded as the page uploads it (multipart); Open WebUI processes it
        (chunks and embeds it) after answering."""
        boundary = "iterserve-check-boundary"
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            f"Content-Type: text/plain\r\n\r\n{text}\r\n--{boundary}--\r\n"
        ).encode()
        kind = f"multipart/form-data; boundary={boundary}"
        return _ok(*self._open("POST", "/api/v1/files/?process=true", body, kind))


def _ok(status: int, body: bytes) -> Any:
    if status >= 400:
        raise AssertionError(f"HTTP {status}: {body[:300].decode(errors='replace')}")
    return json.loads(body)


@contextlib.contextmanager
def open_webui(
    python: Path, connection: str, server: str, model: str, log_path: Path
) -> Iterator[str]:
    """Open WebUI connected to `server` by `connection`, from started to stopped: its URL."""
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix=f"open-webui-{connection}-"))
    env = {**os.environ, **_OFFLINE, "DATA_DIR": str(data), "NO_PROXY": "127.0.0.1,localhost"}
    if connection == "ollama":
        env |= {
            "ENABLE_OLLAMA_API": "True",
            "OLLAMA_BASE_URL": server,
            "ENABLE_OPENAI_API": "False",
            # A document dropped into a chat is embedded by the served model, over /api/embed.
            "BYPASS_EMBEDDING_AND_RETRIEVAL": "False",
            "RAG_EMBEDDING_ENGINE": "ollama",
            "RAG_EMBEDDING_MODEL": model,
        }
    else:
        env |= {"ENABLE_OLLAMA_API": "False", "ENABLE_OPENAI_API": "True",
                "OPENAI_API_BASE_URL": f"{server}/v1", "OPENAI_API_KEY": "none"}  # fmt: skip
    env.pop("PYTHONPATH", None)
    command = [
        str(python.parent / "open-webui"),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    print("starting:", " ".join(command), f"({connection})", flush=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, cwd=data, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, f"{base}/health", 600, log_path)
        yield base
    finally:
        stop(process)


# ---- the checks: each returns what it saw, and raises where Open WebUI's answer is wrong ----


def _chat_body(model: str, content: str, **more: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **more}


def check_models(ui: Client, model: str) -> str:
    ids = [m["id"] for m in ui.get("/api/models")["data"]]
    assert model in ids, f"{model} not among {ids}"
    return f"listed: {ids}"


def check_chat(ui: Client, model: str) -> str:
    body = _chat_body(model, "Name three colours.", stream=False, max_tokens=24)
    choice = ui.post("/api/chat/completions", body)["choices"][0]
    assert choice["message"]["content"].strip(), "an empty answer"
    return f"{choice['finish_reason']}: {choice['message']['content'][:60]!r}"


def check_chat_streamed(ui: Client, model: str) -> str:
    body = _chat_body(model, "Name three colours.", stream=True,
                      params={"temperature": 0.2, "max_tokens": 16, "seed": 3})  # fmt: skip
    status, answer = ui.post_raw("/api/chat/completions", body)
    assert status == 200, f"HTTP {status}: {answer[:300]!r}"
    pieces, finish = [], None
    for line in answer.decode().splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            pieces.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
    assert "".join(pieces).strip() and finish, f"no text or no end in {answer[-300:]!r}"
    return f"{len(pieces)} pieces, {finish}: {''.join(pieces)[:60]!r}"


def check_title(ui: Client, model: str) -> str:
    body = {"model": model, "stream": False, "messages": [
        {"role": "user", "content": "How do I bake bread?"},
        {"role": "assistant", "content": "Mix flour, water, yeast and salt, knead, bake."},
    ]}  # fmt: skip
    answer = ui.post("/api/v1/tasks/title/completions", body)
    title = answer["choices"][0]["message"]["content"]
    assert title.strip(), "an empty title"
    return f"title {title[:60]!r}"


def check_structured(ui: Client, model: str) -> str:
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    body = _chat_body(model, "A city and its country, as JSON.", stream=False, max_tokens=60,
                      response_format=schema)  # fmt: skip
    text = ui.post("/api/chat/completions", body)["choices"][0]["message"]["content"]
    city = json.loads(text)
    assert set(city) == {"city", "country"}, f"keys {sorted(city)}"
    return text


def check_ollama_routes(ui: Client, model: str) -> str:
    shown = ui.post("/ollama/api/show", {"model": model})
    assert "completion" in shown.get("capabilities", []), (
        f"capabilities {shown.get('capabilities')}"
    )
    vectors = ui.post("/ollama/api/embed", {"model": model, "input": ["red", "blue"]})["embeddings"]
    assert len(vectors) == 2 and len(vectors[0]) > 0, "not two embeddings"
    generated = ui.post("/ollama/api/generate", {"model": model, "prompt": "Hello", "stream": False,
                                                 "options": {"num_predict": 6}})  # fmt: skip
    assert generated["done"] and generated["response"], "no answer"
    status, refused = ui.post_raw("/ollama/api/pull", {"model": "llama3.2"})
    assert status >= 400 and b"does not pull" in refused, f"pull: HTTP {status}: {refused[:200]!r}"
    return (f"show {shown['capabilities']}, embed 2 x {len(vectors[0])}, "
            f"generate {generated['response'][:30]!r}, pull refused ({status})")  # fmt: skip


DOCUMENT = (
    "Quillbrook is a small town on the river Pell. Its bridge was built in 1871 and its "
    "market opens on Thursdays. The town's library holds four thousand maps."
)


def check_document(ui: Client, model: str) -> str:
    """A document dropped into a chat: Open WebUI chunks it and has the server embed the
    chunks (/api/embed), then embeds the question the same way, finds the chunk and puts it
    in the prompt; its answer names the file among its sources."""
    uploaded = ui.upload("quillbrook.txt", DOCUMENT)
    deadline = time.monotonic() + 120
    while (status := ui.get(f"/api/v1/files/{uploaded['id']}/process/status")["status"]) not in (
        "completed",
        "failed",
    ) and time.monotonic() < deadline:
        time.sleep(1)
    assert status == "completed", f"processing: {status}"
    files = [{"type": "file", "id": uploaded["id"], "name": "quillbrook.txt"}]
    body = _chat_body(model, "Which river is Quillbrook on?", stream=False, max_tokens=24,
                      files=files)  # fmt: skip
    answer = ui.post("/api/chat/completions", body)
    sources = [s.get("source", {}).get("name") for s in answer.get("sources", [])]
    assert "quillbrook.txt" in sources, f"sources {sources}"
    return f"sources {sources}: {answer['choices'][0]['message']['content'][:60]!r}"


PAGE_MARK = "PAGE_RESULT "


def check_page(ui: Client, model: str, python: Path, chromium: str) -> str:
    """The web page in Chromium (page.py, in Open WebUI's venv): a message sent, the answer
    read once streamed to its end."""
    command = [str(python), str(HERE / "page.py"), ui.base, chromium, "Name three colours."]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PAGE_MARK)]
    assert lines, f"page.py printed no result: {done.stderr[-500:]}"
    result = json.loads(lines[-1][len(PAGE_MARK) :])
    assert result["answer"].strip(), "the page shows an empty answer"
    return f"answered in {result['seconds']} s: {result['answer'][:60]!r}"


Check = Callable[[Client, str], str]
CHECKS: dict[str, list[tuple[str, Check]]] = {
    "ollama": [("models", check_models), ("chat", check_chat), ("chat_streamed", check_chat_streamed),
               ("title", check_title), ("structured", check_structured),
               ("ollama_routes", check_ollama_routes), ("document", check_document)],
    "openai": [("models", check_models), ("chat", check_chat), ("chat_streamed", check_chat_streamed),
               ("title", check_title), ("structured", check_structured)],
}  # fmt: skip
# The one refusal a check asks for.
EXPECTED_REFUSALS = {("ollama", "ollama_routes"): {("/api/pull", 400)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-open-webui",
                        help="Open WebUI's venv (made if missing)")  # fmt: skip
    parser.add_argument("--reinstall", action="store_true", help="pip install again")
    parser.add_argument("--model", default=None, help="served model (default: the bundled one)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="one more `iterserve serve` argument (repeatable)")  # fmt: skip
    parser.add_argument("--only", choices=sorted(CHECKS), action="append", default=[],
                        help="only this connection (repeatable)")  # fmt: skip
    parser.add_argument("--server-wait", type=float, default=1800.0,
                        help="seconds to wait for /health (a cold start compiles kernels)")  # fmt: skip
    parser.add_argument("--chromium", default=shutil.which("chromium"),
                        help="the browser for the web page's check (default: chromium on "
                        "PATH; without one that check is skipped)")  # fmt: skip
    parser.add_argument("--json", default="bench_results/open_webui.json")
    parser.add_argument("--logs", type=Path, default=Path("bench_results"),
                        help="where the two servers' logs go")  # fmt: skip
    args = parser.parse_args()

    python = ensure_venv(args.venv.resolve(), HERE, args.reinstall)
    versions = installed_versions(python, ("open-webui", "fastapi", "aiohttp", "httpx"))
    args.logs.mkdir(parents=True, exist_ok=True)
    server_log = args.logs / "open_webui_iterserve.log"
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []  # the page's checks, where the machine has no Chromium
    port = free_port()
    server = f"http://127.0.0.1:{port}"
    with iterserve_server(port, args.model, args.server_arg, server_log, args.server_wait):
        served = get_json(f"{server}/v1/models")["data"][0]["id"]
        offset = access_statuses(server_log, 0)[1]
        for connection in args.only or sorted(CHECKS):
            ui_log = args.logs / f"open_webui_{connection}.log"
            # Through Ollama's API the model is listed by its Ollama name, NAME:latest.
            model = f"{served}:latest" if connection == "ollama" else served
            with open_webui(python, connection, server, model, ui_log) as base:
                ui = Client(base)
                offset = access_statuses(server_log, offset)[1]  # Open WebUI's start-up
                checks = list(CHECKS[connection])
                if args.chromium:
                    page = functools.partial(check_page, python=python, chromium=args.chromium)
                    checks.append(("page", page))
                else:
                    skipped.append(f"{connection}/page")
                for name, check in checks:
                    print(f"running {connection}/{name}", flush=True)
                    try:
                        seen, passed, error = check(ui, model), True, None
                    except Exception as failure:  # a failed check is a row, not the end
                        seen, passed, error = None, False, f"{type(failure).__name__}: {failure}"
                    time.sleep(1)  # the access line is written as the response ends
                    access, offset = access_statuses(server_log, offset)
                    expected = EXPECTED_REFUSALS.get((connection, name), set())
                    refused = [a for a in access if a["status"] >= 400
                               and (a["path"], a["status"]) not in expected]  # fmt: skip
                    rows.append({
                        "case": f"{connection}/{name}", "passed": passed and not refused,
                        "seen": seen, "error": error, "server_access_log": access,
                    })  # fmt: skip
    width = max(len(row["case"]) for row in rows)
    print(f"\n{'case':<{width}}  passed  iterserve's answers / what Open WebUI gave")
    for row in rows:
        statuses = ", ".join(
            f"{a['method']} {a['path']} {a['status']}" for a in row["server_access_log"]
        )
        print(f"{row['case']:<{width}}  {'yes' if row['passed'] else 'NO':<6}  {statuses or '-'}")
        print(f"{'':<{width}}          {(row['error'] or row['seen'] or '')[:150]}")
    passed = sum(row["passed"] for row in rows)
    print(f"\n{passed}/{len(rows)} passed; Open WebUI {versions['open-webui']}")
    if skipped:
        print(f"skipped (no Chromium: apt install chromium, or --chromium PATH): {skipped}")
    write_results(args.json, {
        "date": datetime.date.today().isoformat(),
        "open_webui": versions,
        "iterserve": served_source(),
        "model": served,
        "cases": rows,
        "skipped": skipped,
    })  # fmt: skip
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
