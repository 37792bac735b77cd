"""What the agreement scripts share (llama_cpp_agreement.py, transformers_agreement.py): the
held-out prompts as token ids, and the report of where two engines' greedy answers part."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from greedy_agreement import first_difference  # type: ignore[import-not-found]
from iterserve.bench.copy_texts import INSTRUCTIONS, PASSAGES
from iterserve.engine.llm import LLM
from iterserve.engine.outputs import RequestOutput
from iterserve.model.builder import ModelPlan
from iterserve.sampling_params import SamplingParams


def held_out_texts(count: int) -> list[str]:
    """Edit instructions over passages (bench/copy_texts.py)."""
    pairs = list(itertools.product(INSTRUCTIONS, PASSAGES))[:count]
    return [f"{a}\n\n{t}" for a, t in pairs]


def prompt_ids(llm: LLM, count: int) -> list[list[int]]:
    """The held-out texts rendered by the model's chat template, or as plain text, BOS
    first, where the file has none (a base model)."""
    texts = held_out_texts(count)
    if llm.engine.chat_template is None:
        print("no chat template in the file: plain prompts")
        return [llm.engine.tokenize(f"{text}\n\n") for text in texts]
    return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def iterserve_greedy(
    model: Path, dtype: str, count: int, tokens: int
) -> tuple[list[list[int]], list[RequestOutput], ModelPlan]:
    """iterserve's greedy answers (`LLM`, its defaults at `dtype`) to `count` prompts, with
    their top-20 log-probabilities: (prompt ids, outputs, the model's plan). The engine is
    gone on return, so the other engine never shares the memory with it."""
    llm = LLM(str(model), dtype=dtype)
    prompts = prompt_ids(llm, count)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=20)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    plan = llm.engine.model_plan
    del llm
    gc.collect()
    return prompts, outputs, plan


def compare(
    ours: Sequence[RequestOutput], theirs: Sequence[list[int]], prompts: Sequence[list[int]]
) -> list[dict[str, Any]]:
    """Per prompt, how many leading tokens agree and, where they first differ, iterserve's
    log-probabilities of its own token and of the other's (its outputs carry the top 20);
    printed, and returned as rows."""
    rows = []
    for i, (out, peer) in enumerate(zip(ours, theirs, strict=True)):
        first = first_difference(out.token_ids, peer)
        row: dict[str, Any] = {"prompt": i, "prompt_tokens": len(prompts[i]), "agree": first}
        line = f"prompt {i} ({len(prompts[i])} tokens): "
        if first is None:
            line += f"all {len(peer)} tokens agree"
        else:
            here = out.logprobs[first] if out.logprobs else None
            top = dict(here.top) if here else {}
            ours_lp, theirs_lp = (here.logprob if here else None), top.get(peer[first])
            row |= {
                "ours": out.token_ids[first],
                "theirs": peer[first],
                "ours_logprob": ours_lp,
                "theirs_logprob": theirs_lp,
            }
            gap = (
                f"{ours_lp - theirs_lp:.3f}"
                if ours_lp is not None and theirs_lp is not None
                else "> top 20"
            )
            line += f"the first {first} agree; then ours {out.token_ids[first]} vs theirs {peer[first]}, logprob gap {gap}"
        print(line)
        rows.append(row)
    same = sum(r["agree"] is None for r in rows)
    print(f"{same} of {len(rows)} answers identical")
    return rows
