"""Decoding a few ids, as a streamed token's text is, through a fast tokenizer's Rust backend
against its Python wrapper (engine/detokenizer.py takes the backend when there is one).

    .venv/bin/python benchmarks/detokenize.py [--model PATH] [--ids 4]
"""

from __future__ import annotations

import argparse
import timeit

from iterserve.bench.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--ids", type=int, default=4, help="ids decoded per call")
    parser.add_argument("--number", type=int, default=20_000)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    ids = tokenizer.encode("The capital of France is Paris, and")[: args.ids]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    wrapper = timeit.timeit(lambda: tokenizer.decode(ids), number=args.number) / args.number
    print(f"wrapper  {wrapper * 1e6:6.2f} us per call ({len(ids)} ids)")
    if backend is None:
        print("no Rust backend (a slow tokenizer): the engine decodes through the wrapper")
        return
    rust = timeit.timeit(lambda: backend.decode(ids), number=args.number) / args.number
    print(f"backend  {rust * 1e6:6.2f} us per call ({wrapper / rust:.1f}x faster)")


if __name__ == "__main__":
    main()
