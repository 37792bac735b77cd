"""`iterserve run-batch`: a file of OpenAI batch requests answered offline, a line each, as
vLLM's run-batch (a real process on the tiny model): answers are the server's own (greedy text
as offline `LLM`'s), a line the server refuses gets its 4xx body, a line that cannot be sent
gets an error naming its line, and every line gets its own answer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx

from iterserve import LLM, SamplingParams
from iterserve.cli.run_batch import send_line
from iterserve.server.batch_lines import parse_line
from server_fixtures import MODEL_NAME

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 6}


def _line(custom_id: str, url: str, body: dict[str, object]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_batch_file_is_answered_line_by_line_as_the_server_answers(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    chats = [
        _line(f"chat-{i}", "/v1/chat/completions", {"messages": CHAT, "seed": i, **GREEDY})
        for i in range(6)
    ]
    lines = [
        *chats,
        _line("text", "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, **GREEDY}),
        _line("embed", "/v1/embeddings", {"input": PROMPT}),
        "",  # blank lines are skipped
        _line("cold", "/v1/chat/completions", {"messages": CHAT, "temperature": -1}),
        _line("elsewhere", "/v1/completions", {"model": "gpt-4o", "prompt": PROMPT}),
        "{not json",
        _line("chat-0", "/v1/completions", {"prompt": PROMPT}),  # its custom_id is taken
        _line("stream", "/v1/completions", {"prompt": PROMPT, "stream": True}),
        _line("images", "/v1/images/generations", {"prompt": "a cat"}),
    ]
    source, answers = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    command = [
        sys.executable, "-m", "iterserve.cli", "run-batch", "-i", str(source), "-o",
        str(answers), str(tiny_llama_dir), "--served-model-name", MODEL_NAME, "--dtype",
        "float32", "--max-model-len", "512", "--num-kv-blocks", "256", "--enforce-eager",
        "--max-num-seqs", "2",  # 4 lines in flight: the six chats queue behind each other
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "14 lines: 8 answered, 2 refused (4xx/5xx), 4 not sent" in done.stderr

    records = [json.loads(text) for text in answers.read_text().splitlines()]
    assert len(records) == 14
    by_id = {r["custom_id"]: r for r in records if r["custom_id"] and r["response"]}
    not_sent = [r for r in records if r["response"] is None]
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    chat_text = llm.chat(CHAT, greedy, use_tqdm=False)[0].text
    for i in range(6):
        body = by_id[f"chat-{i}"]["response"]["body"]
        assert by_id[f"chat-{i}"]["response"]["status_code"] == 200
        assert body["choices"][0]["message"]["content"] == chat_text
        assert by_id[f"chat-{i}"]["response"]["request_id"] == body["id"]
    text = by_id["text"]["response"]["body"]["choices"][0]["text"]
    assert text == llm.generate(PROMPT, greedy, use_tqdm=False)[0].text
    assert len(by_id["embed"]["response"]["body"]["data"][0]["embedding"]) > 0
    cold = by_id["cold"]["response"]
    assert (cold["status_code"], cold["body"]["error"]["param"]) == (400, "temperature")
    assert by_id["elsewhere"]["response"]["status_code"] == 404
    problems = {r["error"]["line"]: r["error"]["message"] for r in not_sent}
    assert "not JSON" in problems[12]
    assert "not unique" in problems[13]
    assert "stream must be false" in problems[14]
    assert "url must be one of" in problems[15]


def test_a_line_names_what_keeps_it_from_being_sent() -> None:
    seen: set[str] = set()
    sent = parse_line(1, _line("a", "/v1/completions", {"prompt": "x"}), seen)
    assert (sent.problem, sent.url, seen) == (None, "/v1/completions", {"a"})
    for text, said in [
        ("[1, 2]", "not a JSON object"),
        (json.dumps({"url": "/v1/completions", "body": {}}), "custom_id must be a string"),
        (_line("b", "/v1/completions", "x"), "body must be a JSON object"),  # type: ignore[arg-type]
        (json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/models"}), "must be POST"),
    ]:
        problem = parse_line(2, text, seen).problem
        assert problem is not None and said in problem, (text, problem)


def test_a_line_refused_for_capacity_is_asked_again() -> None:
    """A 429 (the engine's queue full for a moment) is not a line's answer: it is sent
    again after its Retry-After, as a client would."""
    statuses = [429, 429, 200]
    sent: list[str] = []

    class Client:
        async def post(self, url: str, json: object) -> httpx.Response:
            sent.append(url)
            return httpx.Response(statuses[len(sent) - 1], json={"id": "cmpl-1"},
                                  headers={"retry-after": "0"})  # fmt: skip

    line = parse_line(1, _line("a", "/v1/completions", {"prompt": "x"}), set())
    record = asyncio.run(send_line(Client(), line))
    assert record["response"]["status_code"] == 200 and len(sent) == 3
