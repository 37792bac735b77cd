"""llama.cpp's `infill` sampler: what llama-server does to an editor's candidates.

Editor plugins (llama.vscode, llama.vim) ask /infill with `samplers: [top_k, top_p,
infill]`. After top-k and top-p, llama.cpp's infill sampler decides among the few tokens
left, by their probabilities renormalised over them:

1. when the end-of-generation tokens weigh more than a third of the rest divided by the
   number of candidates, only they are kept (the suggestion ends);
2. a token whose text begins another's gives its mass to the likelier of the two, and the
   other goes (`ret` and `return` are one choice);
3. text tokens under 0.2 go; if none is left, the answer is the end-of-text token alone;
4. of what is left, renormalised, text tokens under 1 / (text tokens + 1) go.

The survivors are then drawn from by their own logits (the mass moved in 2 only decides who
survives). So a suggestion is nearly greedy and ends where the model hesitates, which is
what an editor wants. The same rules here, per row (an editor's rows are few); the sampler
calls it (sample/sampler.py) for rows with SamplingParams.infill_eog.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

_TEXT_FLOOR = 0.2


def infill_keep(
    ids: Sequence[int],
    probs: Sequence[float],
    piece: Callable[[int], bytes],
    eog: Collection[int],
) -> list[int]:
    """The candidates `ids` (probabilities `probs`, summing to 1) the infill sampler keeps,
    in their order; empty when it answers with the end-of-text token alone. `piece`: a
    token's text as bytes (empty for a special token, which begins nothing)."""
    count = len(ids)
    p_eog = sum(p for token, p in zip(ids, probs, strict=True) if token in eog)
    if 3 * p_eog * count > 1.0 - p_eog:
        return [token for token in ids if token in eog]
    mass = list(probs)
    alive = [True] * count
    for i in range(count):
        for j in range(count):
            if not alive[i]:
                break
            if i == j or not alive[j]:
                continue
            head, other = piece(ids[i]), piece(ids[j])
            if head and other.startswith(head):
                keep, drop = (j, i) if mass[j] > mass[i] else (i, j)
                mass[keep] += mass[drop]
                mass[drop], alive[drop] = 0.0, False
    kept = [k for k in range(count) if alive[k] and (ids[k] in eog or mass[k] >= _TEXT_FLOOR)]
    text = [k for k in kept if ids[k] not in eog]
    if not text:
        return []
    total = sum(mass[k] for k in kept)
    floor = 1.0 / (len(text) + 1)
    return [ids[k] for k in kept if ids[k] in eog or mass[k] / total >= floor]
