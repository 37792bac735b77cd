"""Grammar libraries for structured output, measured on the bundled tokenizer (49152 tokens).

For each library that is importable (xgrammar, llguidance):

    compile_ms   compiling a typical JSON schema (a pydantic model with nested object,
                 list, enum, optional) with an empty cache, median of --repeats
    step_ms[B]   one decode step's masking for B constrained rows: fill the [B, V/32]
                 bitmask (the library's batch fill), apply it to [B, V] float32 logits in
                 one call, advance every matcher by its token; median over the steps of
                 generating a valid document of the schema (each row its own matcher)
    spec_step_ms[Bx4]  (engine only) the same with 3 guesses per row, as speculative
                 decoding verifies them: 4 positions per row, each masked after the
                 guesses before it (the guesses are the document's next tokens: right)
    mean_*       (engine only) the mean over the steps instead of the median
    numbers_*    (engine only) the same for an array of numbers (NUMBERS_DOCUMENT)

The engine's own path is timed too (`engine_*`: iterserve.sample.structured, whatever
library it uses), so the figures in docs/structured_output.md are the ones a step pays.
Nothing is asserted about time: the machine is shared; compare numbers from one run.

    PYTHONPATH=src .venv/bin/python benchmarks/structured_output.py [--batch 1,32] \
        [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": ["string", "null"]},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
}
# Where the JSON number bound has the most to do: numbers, one after another.
NUMBERS: dict[str, Any] = {"type": "array", "items": {"type": "number"}}
NUMBERS_DOCUMENT = [3.14159, -271.8, 1234567890123456, 0.5e-7, 42, -0.001, 6.02214076e23]
# Guesses per speculating row (--num-speculative-tokens) for the engine's speculative step.
DRAFTS = 3
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": None,
    "role": "admin",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "W1"},
}


def bundled_tokenizer() -> Any:
    import importlib.util

    from iterserve.model.bundled import BUNDLED_FILE, BUNDLED_PACKAGE
    from iterserve.model.gguf_loader import read_gguf_header
    from iterserve.model.tokenizer import tokenizer_from_gguf

    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    metadata, _ = read_gguf_header(path)
    return tokenizer_from_gguf(metadata, path)


def cpu_isa() -> str:
    """The widest x86 vector ISA the CPU has (what the masking's loops may use)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return platform.machine()
    for isa in ("avx512_bf16", "avx512f", "avx2"):
        if isa in flags:
            return isa
    return platform.machine()


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bench_xgrammar(
    tokenizer: Any, vocab: int, tokens: list[int], batches: list[int], repeats: int, threads: int
) -> dict[str, Any]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    schema = json.dumps(SCHEMA)

    def compile_cold() -> object:
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        return compiler.compile_json_schema(schema)

    compiled = compile_cold()
    result: dict[str, Any] = {"version": importlib.metadata.version("xgrammar")}
    result["compile_ms"] = median_ms(compile_cold, repeats)
    for batch in batches:
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        batch_matcher = xgr.BatchGrammarMatcher(max_threads=threads)
        bitmask = xgr.allocate_token_bitmask(batch, vocab)
        logits = torch.randn(batch, vocab)
        times = []
        for token in tokens:
            start = time.perf_counter()
            batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            for matcher in matchers:
                assert matcher.accept_token(token)
            times.append(time.perf_counter() - start)
        result[f"step_ms[{batch}]"] = 1e3 * statistics.median(times)
    return result


def bench_llguidance(
    tokenizer: Any, vocab: int, tokens: list[int], batches: list[int], repeats: int, threads: int
) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))

    def compile_cold() -> object:
        # llguidance compiles lazily: a matcher's first mask pays for the grammar.
        matcher = llguidance.LLMatcher(lltok, grammar)
        mask = llt.allocate_token_bitmask(1, vocab)
        llt.fill_next_token_bitmask(matcher, mask, 0)
        return matcher

    result: dict[str, Any] = {"version": importlib.metadata.version("llguidance")}
    result["compile_ms"] = median_ms(compile_cold, repeats)
    executor = llguidance.LLExecutor(num_threads=threads)
    for batch in batches:
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
        bitmask = llt.allocate_token_bitmask(batch, vocab)
        logits = torch.randn(batch, vocab)
        times = []
        for token in tokens:
            start = time.perf_counter()
            llt.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(matchers)], bitmask
            )
            llt.apply_token_bitmask_inplace(logits, bitmask)
            for matcher in matchers:
                assert matcher.consume_token(token), matcher.get_error()
            times.append(time.perf_counter() - start)
        result[f"step_ms[{batch}]"] = 1e3 * statistics.median(times)
    return result


def bench_engine(
    tokenizer: Any, vocab: int, tokens: list[int], batches: list[int], repeats: int
) -> dict[str, Any]:
    """The engine's own path: compile through its cache-less compiler, then its batched
    mask-and-advance as TorchRunner calls it, on the typical schema's document and on
    an array of numbers (where the number bound has the most to check)."""
    from iterserve.sample.structured import GrammarCompiler
    from iterserve.structured_output import StructuredOutput

    spec = StructuredOutput(json_schema=SCHEMA)
    compiler = GrammarCompiler(tokenizer, vocab)
    result: dict[str, Any] = {"library": compiler.library}
    result["compile_ms"] = median_ms(lambda: compiler.compile_uncached(spec), repeats)
    numbers = tokenizer.encode(json.dumps(NUMBERS_DOCUMENT), add_special_tokens=False)
    cases = (
        ("", compiler.compile_uncached(spec), tokens),
        ("numbers_", compiler.compile_uncached(StructuredOutput(json_schema=NUMBERS)), numbers),
    )
    for prefix, grammar, document in cases:
        for batch in batches:
            for drafts, key in (
                (0, f"step_ms[{batch}]"),
                (DRAFTS, f"spec_step_ms[{batch}x{DRAFTS + 1}]"),
            ):
                times = engine_steps(grammar, document, batch, vocab, drafts)
                result[prefix + key] = 1e3 * statistics.median(times)
                # The median misses the few steps whose masks are dear; the mean is what
                # the document costs a token.
                result[prefix + "mean_" + key] = 1e3 * statistics.fmean(times)
    return result


def engine_steps(
    grammar: Any, document: list[int], batch: int, vocab: int, drafts: int
) -> list[float]:
    """Seconds per step of `batch` requests writing `document`: each step masks every
    request's row, and with `drafts` the rows after each of its next `drafts` document
    tokens (guesses all right, as n-gram guesses cut at the grammar's first refusal and
    a draft model's masked guesses are to the grammar), then advances each by a token."""
    from iterserve.sample.structured import StructuredBatch

    matchers = StructuredBatch()
    ids = [f"r{i}" for i in range(batch)]
    for request_id in ids:
        matchers.add(request_id, grammar)
    logits = torch.randn(batch * (drafts + 1), vocab)
    rows = [i * (drafts + 1) for i in range(batch)]
    times = []
    for position, token in enumerate(document[: len(document) - drafts]):
        guesses = [document[position : position + drafts]] * batch
        start = time.perf_counter()
        if drafts:
            matchers.mask(logits, ids, rows, guesses)
        else:
            matchers.mask(logits, ids)
        for request_id in ids:
            matchers.advance(request_id, [token])
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    tokenizer = bundled_tokenizer()
    vocab = len(tokenizer)
    tokens = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    report: dict[str, Any] = {
        "vocab": vocab,
        "document_tokens": len(tokens),
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "isa": cpu_isa(),
        "load_average": os.getloadavg(),  # the machine is shared: context for the figures
        "torch": torch.__version__,
        "libraries": {},
    }
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            report["libraries"][name] = bench(
                tokenizer, vocab, tokens, batches, args.repeats, args.threads
            )
        except ImportError as error:
            report["libraries"][name] = {"unavailable": str(error)}
    try:
        report["engine"] = bench_engine(tokenizer, vocab, tokens, batches, args.repeats)
    except ImportError as error:
        report["engine"] = {"unavailable": str(error)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
