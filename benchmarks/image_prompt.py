"""A question about an image on a Gemma 3 4B-shaped GGUF with its vision projector file
(or, with `--family mistral3`, a Ministral 3 3B-shaped one with Pixtral's; `--family
gemma4`, a Gemma 4 E2B-shaped one with its tower's; `--family qwen3vl`, a Qwen3-VL 2B-shaped
one with its tower's; `--family qwen25vl`, a Qwen2.5-VL 3B-shaped one), iterserve
against llama-server on the same two files, one server after the other.

Both files are made here with random weights (iterserve.bench): the language model in
the family's body as Q4_K_M (random blocks, the bundled tokenizer grown to the family's
vocabulary size, its image tokens added as control tokens, a chat template that writes
its marker for an image), and the vision projector file in its tower's shape as
llama.cpp's converter writes it (F16). For each server: a warm-up (a text and an image
request), then in each round a question about a new image (Gemma 3's 896 x 896, Mistral's
672 x 672, 576 merged patches: under llama.cpp's bound of 1,024 an image, so that both lay
it out alike; Gemma 4's 768 x 768, 256 rows, llama-server held to the same budget; Qwen3-VL's
768 x 768 and Qwen2.5-VL's 672 x 672, 576 rows; its tower encode, then the prompt's prefill) and a text question of about
the same length (the prefill alone), streamed, 8 tokens, greedy; time to first token of
each, their difference (what the image costs beyond its tokens), and the server's peak
and held RSS (VmHWM, VmRSS) at the end. Then a text stream with a new image's question
sent 2 s into it: how long the stream's tokens stop while the image is encoded
(llama-server with two slots, -np 2, so that both run).

    .venv/bin/python benchmarks/image_prompt.py [--rounds 3] [--engines iterserve,llama.cpp]
        [--family gemma3|mistral3|gemma4|qwen3vl|qwen25vl]

llama-server comes from benchmarks/peers/llama_cpp.sh (built if missing, ~10 minutes).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from _results import write_results  # type: ignore[import-not-found]  # noqa: E402
from _served import free_port, iterserve_server, stop, wait_healthy  # type: ignore[import-not-found]  # noqa: E402
from iterserve.bench.machine import cpu_line  # noqa: E402
from iterserve.bench.shaped_gguf import (  # noqa: E402
    q4_k_m_types,
    tokenizer_metadata,
    write_shaped_gguf,
)
from iterserve.bench.shaped_mmproj import TOWERS, write_shaped_mmproj  # noqa: E402

FILES = Path.home() / ".cache" / "iterserve-bench" / "images"
LLAMA_CPP_SH = Path(__file__).parent / "peers" / "llama_cpp.sh"
CONTROL = 3  # llama.cpp's token type for a control token
QUESTION = "What is in this picture? Say it in one short sentence."


def _template(marker: str, turn: str, reply: str) -> str:
    """A chat template that writes `marker` for an image, each turn as `turn` lays it out."""
    content = (
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for b in m['content'] %}"
        f"{{% if b['type'] == 'image' %}}{marker}{{% else %}}{{{{ b['text'] }}}}{{% endif %}}"
        "{% endfor %}{% endif %}"
    )
    return (
        "{{ bos_token }}{% for m in messages %}" + turn.replace("CONTENT", content)
        + "{% endfor %}{% if add_generation_prompt %}" + reply + "{% endif %}"
    )  # fmt: skip


@dataclass(frozen=True)
class Family:
    preset: str  # iterserve.bench.shaped_gguf's body
    tower: str  # iterserve.bench.shaped_mmproj.TOWERS'
    tokens: tuple[str, ...]  # its image tokens, added to the vocabulary
    template: str
    image_side: int  # pixels of the square images asked about
    llama_args: tuple[str, ...] = ()  # llama-server's, to lay an image out as iterserve does


FAMILIES = {
    "gemma3": Family(
        "gemma3-4b", "gemma3", ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        _template("<start_of_image>", "<start_of_turn>{{ m['role'] }}\nCONTENT<end_of_turn>\n",
                  "<start_of_turn>model\n"),
        896,
    ),
    "mistral3": Family(
        "ministral3-3b", "pixtral", ("[IMG]", "[IMG_BREAK]", "[IMG_END]"),
        _template("[IMG]", "{% if m['role'] == 'user' %}[INST]CONTENT[/INST]"
                  "{% else %}CONTENT{% endif %}", ""),
        672,
    ),
    "gemma4": Family(
        "gemma4-e2b", "gemma4v", ("<|image|>", "<|image>", "<image|>"),
        _template("<|image|>", "<start_of_turn>{{ m['role'] }}\nCONTENT<end_of_turn>\n",
                  "<start_of_turn>model\n"),
        768,
        # The HF processor's default budget, 280 rows (256 for a 768-pixel square), which
        # llama-server takes up to 1,120 by default.
        ("--image-max-tokens", "280"),
    ),
    "qwen3vl": Family(
        "qwen3vl-2b", "qwen3vl_merger", ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),
        _template("<|vision_start|><|image_pad|><|vision_end|>",
                  "<|im_start|>{{ m['role'] }}\nCONTENT<|im_end|>\n", "<|im_start|>assistant\n"),
        768,  # 24 x 24 merged patches: 576 rows
    ),
    "qwen25vl": Family(
        "qwen2.5vl-3b", "qwen2.5vl_merger", ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"),
        _template("<|vision_start|><|image_pad|><|vision_end|>",
                  "<|im_start|>{{ m['role'] }}\nCONTENT<|im_end|>\n", "<|im_start|>assistant\n"),
        672,  # 24 x 24 merged patches of 28 pixels: 576 rows
    ),
}  # fmt: skip


def make_files(name: str) -> tuple[Path, Path]:
    family = FAMILIES[name]
    FILES.mkdir(parents=True, exist_ok=True)
    text = FILES / f"{family.preset}-images.Q4_K_M.gguf"
    mmproj = FILES / f"mmproj-{family.preset}-f16.gguf"
    if not text.exists():
        tokenizer = tokenizer_metadata()
        tokens = family.tokens
        tokenizer["tokenizer.ggml.tokens"] = [*tokenizer["tokenizer.ggml.tokens"], *tokens]
        tokenizer["tokenizer.ggml.token_type"] = [
            *tokenizer["tokenizer.ggml.token_type"], *[CONTROL] * len(tokens)
        ]  # fmt: skip
        tokenizer["tokenizer.chat_template"] = family.template
        print(f"writing {text}", flush=True)
        write_shaped_gguf(text, family.preset, 7, tokenizer, q4_k_m_types, real_vocab=True)
    if not mmproj.exists():
        print(f"writing {mmproj}", flush=True)
        write_shaped_mmproj(mmproj, TOWERS[family.tower], seed=7)
    return text, mmproj


def picture(seed: int, side: int) -> str:
    """A new `side` x `side` image as a PNG data URL: a gradient under noise."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    pixels = ramp[None, :, None] * rng.uniform(0.3, 1, 3) + rng.normal(0, 30, (side, side, 3))
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def filler(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    vocabulary = [
        "river",
        "stone",
        "lamp",
        "orange",
        "window",
        "cloud",
        "paper",
        "music",
        "garden",
        "bridge",
    ]
    return " ".join(rng.choice(vocabulary, words))


def ttft(client: openai.OpenAI, content: Any) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt's tokens (the usage chunk)."""
    model = client.models.list().data[0].id
    start = time.perf_counter()
    first, prompt_tokens = None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=8,
        temperature=0.0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    return (first if first is not None else time.perf_counter() - start), prompt_tokens


def memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            fields[name] = int(value.split()[0]) * 1024
    return {"peak_rss": fields["VmHWM"], "held_rss": fields["VmRSS"]}


def beside_a_stream(client: openai.OpenAI, seed: int, side: int) -> dict[str, Any]:
    """A text stream of 160 tokens, and 2 s into it a question about a new image: the
    stream's largest gap between tokens and its tokens while the image waits for its first
    token, against its pace before."""
    model = client.models.list().data[0].id
    times: list[float] = []

    def stream() -> None:
        chunks = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": filler(seed, 40)}],
            max_tokens=160, temperature=0.0, stream=True,
            # The random model's picks may be the vocabulary's filler tokens, special ones:
            # shown, each token is a chunk with text to time.
            extra_body={"ignore_eos": True, "min_tokens": 160, "skip_special_tokens": False},
        )  # fmt: skip
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())

    worker = threading.Thread(target=stream)
    worker.start()
    while len(times) < 8:
        if not worker.is_alive():
            raise SystemExit("the text stream ended before 8 of its tokens had text")
        time.sleep(0.05)
    time.sleep(2.0)
    asked = time.perf_counter()
    seconds, _ = ttft(client, [{"type": "image_url", "image_url": {"url": picture(seed, side)}},
                               {"type": "text", "text": QUESTION}])  # fmt: skip
    answered = asked + seconds
    worker.join()
    steps = list(zip(times, times[1:], strict=False))
    before = [b - a for a, b in steps if b < asked]
    during = [t for t in times if asked <= t <= answered]
    gaps = [b - a for a, b in steps if b >= asked and a <= answered]
    return {
        "image_ttft_s": seconds,
        "stream_gap_before_s": statistics.median(before) if before else None,
        "stream_largest_gap_during_s": max(gaps, default=None),
        "stream_tokens_during": len(during),
    }


def run_rounds(base: str, args: argparse.Namespace) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    rounds, words, side = args.rounds, args.words, FAMILIES[args.family].image_side
    image_part = {"type": "image_url", "image_url": {"url": picture(0, side)}}
    ttft(client, filler(0, words))  # warm-up: a text, then an image
    ttft(client, [image_part, {"type": "text", "text": QUESTION}])
    images, texts, tokens = [], [], {}
    for r in range(1, rounds + 1):
        image = [{"type": "image_url", "image_url": {"url": picture(r, side)}},
                 {"type": "text", "text": f"{r}. {QUESTION}"}]  # fmt: skip
        seconds, tokens["image"] = ttft(client, image)
        images.append(seconds)
        seconds, tokens["text"] = ttft(client, f"{r}. {filler(r, words)} {QUESTION}")
        texts.append(seconds)
        print(f"  round {r}: image {images[-1]:.2f} s, text {texts[-1]:.2f} s", flush=True)
    beside = beside_a_stream(client, 100, side)
    print(f"  beside a stream: {beside}", flush=True)
    return {"image_ttft_s": images, "text_ttft_s": texts, "prompt_tokens": tokens,
            "beside_a_stream": beside}  # fmt: skip


def llama_server_bin() -> Path:
    found = subprocess.run(["bash", str(LLAMA_CPP_SH), "path"], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"llama.cpp not built: {found.stderr.strip()}")
    return Path(found.stdout.strip().splitlines()[-1]) / "llama-server"


def run_iterserve(text: Path, mmproj: Path, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    port = free_port()
    extra = ["--mmproj", str(mmproj), "--max-model-len", "4096", "-t", str(args.threads)]
    with iterserve_server(port, str(text), extra, logs / "iterserve.log", 900) as server:
        found = run_rounds(f"http://127.0.0.1:{port}/v1", args)
        return {**found, **memory(server.pid)}


def run_llama_cpp(text: Path, mmproj: Path, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    port = free_port()
    command = [str(llama_server_bin()), "-m", str(text), "--mmproj", str(mmproj), "--port",
               str(port), "-t", str(args.threads), "-c", "8192", "-np", "2", "--jinja",
               *FAMILIES[args.family].llama_args]  # fmt: skip
    print("starting:", " ".join(command), flush=True)
    log_path = logs / "llama-server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}/health", 900, log_path)
        found = run_rounds(f"http://127.0.0.1:{port}/v1", args)
        return {**found, **memory(server.pid)}
    finally:
        stop(server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="iterserve,llama.cpp")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--words", type=int, default=250, help="the text prompt's filler")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gemma3")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    text, mmproj = make_files(args.family)
    logs = Path("bench_results") / "image_prompt"
    logs.mkdir(parents=True, exist_ok=True)
    runners = {"iterserve": run_iterserve, "llama.cpp": run_llama_cpp}
    found: dict[str, Any] = {}
    for engine in args.engines.split(","):
        print(f"{engine}:", flush=True)
        found[engine] = runners[engine](text, mmproj, args, logs)
    print(f"\n{cpu_line()}")
    print(f"{'engine':<10} {'image TTFT':>11} {'text TTFT':>10} {'image cost':>11} "
          f"{'tokens img/text':>16} {'peak / held RSS':>17}")  # fmt: skip
    for engine, row in found.items():
        image, plain = statistics.median(row["image_ttft_s"]), statistics.median(row["text_ttft_s"])
        row["image_cost_s"] = image - plain
        tokens = row["prompt_tokens"]
        rss = f"{row['peak_rss'] / 2**30:.2f} / {row['held_rss'] / 2**30:.2f} GiB"
        print(f"{engine:<10} {image:>10.2f}s {plain:>9.2f}s {image - plain:>10.2f}s "
              f"{tokens.get('image', 0):>7} / {tokens.get('text', 0):<7} {rss:>17}")  # fmt: skip
    if len(found) == 2:
        ours, theirs = found["iterserve"], found["llama.cpp"]
        for key in ("image_ttft_s", "text_ttft_s"):
            ratio = statistics.median(theirs[key]) / statistics.median(ours[key])
            print(f"{key}: llama.cpp / iterserve {ratio:.2f}x")
    date = datetime.date.today().isoformat()
    write_results(args.json or f"bench_results/{date}-image_prompt.json",
                  {"machine": cpu_line(), "files": [str(text), str(mmproj)], "args": vars(args),
                   "engines": found})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
