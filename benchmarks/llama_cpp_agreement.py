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

    .venv/bin/python benchmarks/llama_cpp_agreement.py [--model FILE.gguf] [--prompts 8]
        [--tokens 64] [--dtype float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from _agreement import compare, iterserve_greedy  # type: ignore[import-not-found]
from _results import write_results  # type: ignore[import-not-found]  # run from benchmarks/
from iterserve import kernels
from iterserve.bench.machine import cpu_line
from iterserve.model.bundled import default_model_path

PEER = Path(__file__).parent / "peers" / "llama_cpp.sh"


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


def llama_cpp_greedy(
    model: Path, prompts: list[list[int]], tokens: int, port: int
) -> list[list[int]]:
    """llama-server's greedy continuation of each token-id prompt."""
    server = subprocess.Popen(
        [str(PEER), "server", str(model), str(port), "-np", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
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
    finally:
        server.terminate()
        server.wait(timeout=60)


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
    parser.add_argument("--json", default="bench_results/llama_cpp_agreement.json")
    args = parser.parse_args()
    model = args.model or default_model_path()
    print(cpu_line())
    prompts, ours, plan = iterserve_greedy(model, args.dtype, args.prompts, args.tokens)
    theirs = llama_cpp_greedy(model, prompts, args.tokens, args.port)
    print(
        f"{model.name}: iterserve {plan.dtype}, weights {plan.weights}, kernels {kernels.isa()}; "
        f"{len(prompts)} prompts, {args.tokens} tokens each"
    )
    rows = compare(ours, theirs, prompts)
    same = sum(r["agree"] is None for r in rows)
    write_results(
        args.json,
        {
            "cpu": cpu_line(),
            "kernels": kernels.isa(),
            "model": str(model),
            "dtype": plan.dtype,
            "weights": plan.weights,
            "tokens": args.tokens,
            "identical": same,
            "prompts": rows,
        },
    )


if __name__ == "__main__":
    main()
