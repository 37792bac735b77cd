"""llama-server's own API on llama-server and on iterserve, the same requests to both: does
iterserve lay out the same prompt, and answer in the same shape?

A tiny random GGUF is made here (the `tiny` body of iterserve.bench.shaped_gguf, F16, the
bundled tokenizer with Qwen2.5-Coder's five fill-in-the-middle tokens added as control
tokens, which llama.cpp recognises by their text). llama-server (benchmarks/peers/llama_cpp.sh
server, one slot) and then `iterserve serve` run on it, one after the other, and each gets
the same requests: /infill with other files and without, /completion with a text prompt and
a mixed one, llama-server's /tokenize (with pieces) and /apply-template.

Compared per request: the status; the prompt as the server processed it (`prompt`, the
tokens detokenized, special tokens written out) and `tokens_evaluated`, i.e. the layout; the
answer's fields that a client reads (`content`, `stop_type`, `tokens_predicted`, `timings`,
`tokens_cached`...) being present; /tokenize's tokens and pieces and /apply-template's
prompt equal. The greedy `content` is printed beside (random weights: two engines' float
arithmetic may part at a near tie), not required equal. Fails (exit 1) on a layout or shape
difference.

    .venv/bin/python benchmarks/llama_server_parity.py [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve.bench.machine import cpu_line
from iterserve.bench.server_process import free_port, launch_server
from iterserve.bench.shaped_gguf import PRESETS, tokenizer_metadata, write_shaped_gguf
from iterserve.config import EngineConfig
from llama_cpp_agreement import llama_server  # type: ignore[import-not-found]

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>",
              "<|file_sep|>")  # fmt: skip
STARCODER_REPOSITORY_TOKENS = ("<reponame>", "<repo_name>", "<file_sep>")
CONTROL = 3  # llama.cpp's token type
BEFORE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return "
AFTER = "\n\nprint(fibonacci(10))\n"
FILES = [{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n"},
         {"filename": "README.md", "text": "# numbers\n\nSmall helpers.\n"}]  # fmt: skip
GREEDY = {"n_predict": 8, "temperature": 0, "top_k": 1}
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("infill with other files", "/infill",
     {"input_prefix": BEFORE, "input_suffix": AFTER, "input_extra": FILES, "prompt": "fib",
      **GREEDY}),
    ("infill alone", "/infill", {"input_prefix": BEFORE, "input_suffix": AFTER, **GREEDY}),
    ("completion, text", "/completion", {"prompt": BEFORE, **GREEDY}),
    ("completion, stop word", "/completion", {"prompt": BEFORE, "stop": ["\n"], **GREEDY}),
    ("completion, mixed prompt", "/completion", {"prompt": [1, "def main():\n"], **GREEDY}),
    ("tokenize with pieces", "/tokenize", {"content": "héllo 龘 <|fim_prefix|>",
                                           "with_pieces": True}),
    ("apply-template", "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}),
]  # fmt: skip
# The answer's fields a llama.cpp client reads (llama.vscode: content, timings,
# tokens_cached, truncated).
ANSWER_FIELDS = ("content", "stop", "stop_type", "stopping_word", "tokens_predicted",
                 "tokens_evaluated", "tokens_cached", "truncated", "timings", "prompt",
                 "generation_settings", "has_new_line")  # fmt: skip


def coder_tokenizer() -> dict[str, Any]:
    """The bundled tokenizer with Qwen2.5-Coder's five fill-in-the-middle tokens added as
    control tokens, which llama.cpp recognises by their text."""
    tokenizer = tokenizer_metadata()
    # The bundled (StarCoder-derived) vocabulary has StarCoder's repository tokens, which a
    # Qwen2.5-Coder vocabulary has not; llama.cpp would take `<reponame>` for Qwen's.
    vocabulary = [f"<unused{t[1:]}" if t in STARCODER_REPOSITORY_TOKENS else t
                  for t in tokenizer["tokenizer.ggml.tokens"]]  # fmt: skip
    tokenizer["tokenizer.ggml.tokens"] = [*vocabulary, *FIM_TOKENS]
    tokenizer["tokenizer.ggml.token_type"] = [*tokenizer["tokenizer.ggml.token_type"],
                                              *[CONTROL] * len(FIM_TOKENS)]  # fmt: skip
    return tokenizer


def make_model(path: Path) -> Path:
    # A context with room for /infill's other files on llama-server, which gives them what
    # is left of it after a batch (2048 tokens) and twice n_predict.
    shape = dataclasses.replace(PRESETS["tiny"], context=8192)
    return write_shaped_gguf(path, shape, seed=7, tokenizer=coder_tokenizer())


def post(base: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")[:500]


def ask_all(base: str) -> list[tuple[int, Any]]:
    return [post(base, path, body) for _, path, body in REQUESTS]


def compare(name: str, path: str, theirs: tuple[int, Any], ours: tuple[int, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"request": name, "path": path, "status": [theirs[0], ours[0]]}
    problems = []
    if theirs[0] != ours[0] or ours[0] != 200:
        problems.append(f"status {theirs[0]} / {ours[0]}")
    elif path in ("/infill", "/completion"):
        a, b = theirs[1], ours[1]
        row |= {"prompt_same": a.get("prompt") == b.get("prompt"),
                "tokens_evaluated": [a.get("tokens_evaluated"), b.get("tokens_evaluated")],
                "content": [a.get("content"), b.get("content")],
                "stop_type": [a.get("stop_type"), b.get("stop_type")]}  # fmt: skip
        if not row["prompt_same"]:
            problems.append(f"prompt {a.get('prompt')!r} / {b.get('prompt')!r}")
        if a.get("tokens_evaluated") != b.get("tokens_evaluated"):
            problems.append("tokens_evaluated")
        missing = [f for f in ANSWER_FIELDS if f in a and f not in b]
        if missing:
            problems.append(f"fields missing here: {missing}")
    elif theirs[1] != ours[1] and path == "/apply-template":
        problems.append(f"{theirs[1]!r} / {ours[1]!r}")
    elif path == "/tokenize" and theirs[1]["tokens"] != ours[1]["tokens"]:
        problems.append(f"{theirs[1]['tokens']} / {ours[1]['tokens']}")
    row["problems"] = problems
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="bench_results/llama_server_parity.json")
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = make_model(Path(scratch) / "tiny-coder.gguf")
        with llama_server(model, free_port(), "-c", "8192") as url:
            theirs = ask_all(url)
        config = EngineConfig(model=str(model))
        with launch_server(config) as server:
            ours = ask_all(server.base_url)
    rows = [compare(name, path, a, b)
            for (name, path, _), a, b in zip(REQUESTS, theirs, ours, strict=True)]  # fmt: skip
    for row in rows:
        verdict = "same" if not row["problems"] else "DIFFERENT: " + "; ".join(row["problems"])
        print(f"{row['request']:<26} {verdict}")
        if "content" in row:
            print(f"{'':<26} greedy content, llama-server / iterserve: {row['content']}")
    write_results(args.json, {"cpu": cpu_line(), "rows": rows, "llama_server": theirs,
                              "iterserve": ours})  # fmt: skip
    return 0 if all(not row["problems"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
