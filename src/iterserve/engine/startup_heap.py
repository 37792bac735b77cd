"""A serving process's startup heap, taken out of Python's cyclic garbage collector's way.

Loading a model leaves a quarter of a million long-lived objects behind (torch, transformers,
tokenizers, the server's own modules): the bundled model's server tracks ~265,000. The
collector's oldest generation walks every one of them when it runs, which it does once the
objects that outlived younger collections since its last pass reach a quarter of what it
walked then. A full pass of that heap holds the GIL, so the engine's loop and the event loop
with it, for 107-145 ms: in `iterserve serve` (bundled model, 16 streams, gc.callbacks
timing each pass; 2026-11-30, AMD EPYC Zen 5, scratch harness), one came 0.65 s into
serving, a gap of ten or more decode steps in every stream at once; once frozen, the
collector tracked ~6,000 objects and that pass ran before /health said ok.

`gc.freeze()` moves what is alive now to a generation the collector never walks, as vLLM's
engine and API server do after start-up; a full pass then looks only at what serving made.
Objects frozen are still freed when their last reference goes; a cycle among them is not,
so only processes that serve one engine for their whole life freeze (`iterserve serve`, a
data-parallel replica), never one that builds engines and drops them (tests, benchmarks,
`LLM`).
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze the rest; returns the number of
    objects frozen (all of them, this call's and any before)."""
    start = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - start
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "startup heap frozen: %d objects out of the garbage collector's full passes "
        "(one took %.0f ms)",
        frozen,
        took * 1e3,
    )
    return frozen
