"""Greedy tokens of iterserve and llama.cpp on the same GGUF, compared token by token.

Both engines read one file (default: the bundled SmolLM2-135M-Instruct Q4_1, a trained
model). Each held-out chat prompt (bench/copy_texts.py: edit instructions over passages) is
rendered (a file without a chat template, a base model, takes the plain texts) and
tokenized once, by iterserve; iterserve (`LLM`, its defaults, temperature 0)
and then llama-server (benchmarks/peers/llama_cpp.sh server, top-k 1) generate --tokens
tokens from those same ids, one engine after the other (never two models in memory at once).

For each prompt it prints how many leading tokens agree and, where the answers first differ,
iterserve's log-probabilities of its own token and of llama.cpp's there: a gap of a few
hundredths is a near-tie that the engines' roundings decide (llama.cpp keeps the residual
stream in fp32, iterserve in bf16; both multiply the Q4_1 blocks by 8-bit activations), a
large one would be a real difference. Asserts nothing.

First it compares the two tokenizers on the prompts' texts (plain, BOS as each vocabulary
says; and rendered by the chat template, specials parsed) and on a few harder strings
(digits, whitespace runs, contractions in capitals, accents, CJK, emoji, code), iterserve's
from the file's metadata against llama-server's /tokenize: a client that sends text to both
engines gets the same ids only if these agree. `--tokenize-only` stops there.

    .venv/bin/python benchmarks/llama_cpp_agreement.py [--model FILE.gguf] [--prompts 8]
        [--tokens 64] [--dtype float32] [--tokenize-only] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _agreement import compare, held_out_texts, iterserve_greedy  # type: ignore[import-not-found]
from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from greedy_agreement import first_difference  # type: ignore[import-not-found]
from iterserve import kernels
from iterserve.bench.machine import cpu_line
from iterserve.engine.prompts import encode_text, render_chat
from iterserve.model.bundled import default_model_path
from iterserve.model.gguf_loader import read_gguf_header
from iterserve.model.tokenizer import chat_template_of, tokenizer_from_gguf

PEER = Path(__file__).parent / "peers" / "llama_cpp.sh"

# Where byte-level splits differ: digit runs, whitespace runs and newlines, contractions in
# capitals, accents, CJK, emoji, code.
HARD_TEXTS = [
    "In 1984, 12345678 people paid $3.50 each (about 4.2e7 in all).",
    "Line one\n\n\n  Line two\t\tindented   then   spaced  \r\n end",
    "I'LL say it: YOU'RE right, THEY'VE gone, it's Bob's, we'd've.",
    "Naïve café owners in São Paulo said «très bien» to Zoë.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 🙂👍🏽 and 🇫🇷, symbols: ©®™ ±×÷ ∑∫√ ≤≥",
    "def f(x):\n    return {'a': x**2, \"b\": [i for i in range(10)]}  # done",
]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def _wait_healthy(url: str, server: subprocess.Popen[bytes], seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"llama-server exited ({server.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("llama-server did not come up")


@contextmanager
def llama_server(model: Path, port: int, *flags: str) -> Iterator[str]:
    """llama-server on `model` (one slot, and `flags`) while the block runs: its base URL."""
    server = subprocess.Popen(
        [str(PEER), "server", str(model), str(port), "-np", "1", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def llama_cpp_greedy(url: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """llama-server's greedy continuation of each token-id prompt."""
    answers = []
    for prompt in prompts:
        body = {
            "prompt": prompt,
            "n_predict": tokens,
            "top_k": 1,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": False,
            "return_tokens": True,
        }
        answers.append(_post(f"{url}/completion", body)["tokens"])
    return answers


@dataclass(frozen=True)
class Tokenized:
    """A text as both engines are asked to tokenize it: plain (BOS as the vocabulary says,
    as a text prompt is) or a rendered chat (its specials written by the template)."""

    label: str
    text: str
    add_special: bool


def texts_to_tokenize(model: Path, count: int) -> tuple[list[Tokenized], list[list[int]]]:
    """The texts, and iterserve's ids for them: its tokenizer as the file's metadata makes it,
    encoded as the engine encodes a text prompt or a rendered chat."""
    metadata, _ = read_gguf_header(model)
    tokenizer = tokenizer_from_gguf(metadata, model)
    template = chat_template_of(tokenizer)
    texts = [Tokenized(f"prompt {i}", t, True) for i, t in enumerate(held_out_texts(count))]
    texts += [Tokenized(f"hard {i}", t, True) for i, t in enumerate(HARD_TEXTS)]
    if template is not None:
        texts += [
            Tokenized(
                f"chat {i}",
                render_chat(tokenizer, template, [{"role": "user", "content": t.text}]).text,
                False,
            )
            for i, t in enumerate(texts)
        ]
    ours = [encode_text(tokenizer, t.text, t.add_special, "prompt") for t in texts]
    return texts, ours


def compare_tokens(url: str, texts: list[Tokenized], ours: list[list[int]]) -> list[dict[str, Any]]:
    """llama-server's /tokenize of each text against iterserve's ids; printed, and returned."""
    rows = []
    for text, mine in zip(texts, ours, strict=True):
        body = {"content": text.text, "add_special": text.add_special, "parse_special": True}
        theirs = _post(f"{url}/tokenize", body)["tokens"]
        first = first_difference(mine, theirs)
        rows.append({"text": text.label, "tokens": len(theirs), "first_difference": first})
        if first is not None:
            print(
                f"tokenize {text.label}: differ at {first} of {len(theirs)}: iterserve "
                f"{mine[first : first + 4]}, llama.cpp {theirs[first : first + 4]}"
            )
    same = sum(r["first_difference"] is None for r in rows)
    print(f"tokenize: {same} of {len(rows)} texts give llama.cpp's ids")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="a GGUF (default: the bundled one)"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8013)
    parser.add_argument(
        "--dtype", default="auto", help="iterserve's (float32: dense weights, fp32 activations)"
    )
    parser.add_argument(
        "--tokenize-only", action="store_true", help="compare the tokenizers, not the answers"
    )
    parser.add_argument("--json", default="bench_results/llama_cpp_agreement.json")
    args = parser.parse_args()
    model = args.model or default_model_path()
    print(cpu_line())
    texts, our_ids = texts_to_tokenize(model, args.prompts)
    result: dict[str, Any] = {"cpu": cpu_line(), "kernels": kernels.isa(), "model": str(model)}
    if args.tokenize_only:
        with llama_server(model, args.port) as url:
            result["tokenize"] = compare_tokens(url, texts, our_ids)
        write_results(args.json, result)
        return
    prompts, ours, plan = iterserve_greedy(model, args.dtype, args.prompts, args.tokens)
    with llama_server(model, args.port) as url:
        result["tokenize"] = compare_tokens(url, texts, our_ids)
        theirs = llama_cpp_greedy(url, prompts, args.tokens)
    print(
        f"{model.name}: iterserve {plan.dtype}, weights {plan.weights}, kernels {kernels.isa()}; "
        f"{len(prompts)} prompts, {args.tokens} tokens each"
    )
    rows = compare(ours, theirs, prompts)
    result |= {
        "dtype": plan.dtype,
        "weights": plan.weights,
        "tokens": args.tokens,
        "identical": sum(r["agree"] is None for r in rows),
        "prompts": rows,
    }
    write_results(args.json, result)


if __name__ == "__main__":
    main()
