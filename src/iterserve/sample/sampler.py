"""Turns one step's logits into one token per sequence: greedy, temperature, top-k/p, min-p.

The sampler runs every engine step for every sequence that samples, so it is
built around what is cheap on a CPU at vocab 49152 and batch ~256, where each
pass over the [S, V] logits costs milliseconds and sorting a row costs more:

- Greedy rows never see a softmax, only an exact argmax (`_LogitRows.argmax`).
- Random rows are drawn by inverse CDF, which needs one uniform per row; drawing
  S x V noise for a Gumbel/exponential race costs ~10x the rest of the sampler
  (measured once, no script).
- Top-k/top-p rows never sort the vocabulary unless they must: they take the
  best few candidates and fall back to more only when the support provably
  does not fit (an exact test, not a heuristic).
- Vocab-sized intermediates live in a reusable workspace: a fresh 50 MB tensor
  per step costs more in page faults than the arithmetic done on it.

Seeds: every random row consumes exactly one uniform per call. A row with its
own generator draws it from that generator, and everything else the row
computes depends only on its own logits and parameters, so a seeded request
samples the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from iterserve.core.outputs import TokenLogprobs
from iterserve.sample.infill_filter import infill_keep
from iterserve.sampling_params import SamplingParams

# Below this temperature the distribution is a point mass for any practical
# purpose and dividing by it would overflow; treat it as greedy, as vLLM does.
_GREEDY_TEMPERATURE = 1e-5
# Candidate-set sizes tried in turn for top-k/top-p rows; a full stable sort of
# the vocab is the implicit last level. Most nuclei fit in the first.
_CANDIDATE_LEVELS = (64, 1024)
# Chunk width of the two-level row reductions below; divides common vocab sizes.
_CHUNK = 64


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where that row's params.logprobs is None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; its draws are independent of the global RNG.

    Any integer is a seed: torch takes 64 bits (and already wraps negative seeds
    modulo 2**64), so larger ones are wrapped the same way instead of overflowing.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)
    return generator


# -- exact row operations, faster than torch's on long CPU rows ----------------------------------


class _LogitRows:
    """The step's logits plus the max of every _CHUNK-wide chunk of each row.

    One pass computes the chunk maxima (when first asked for); after it, a row's max,
    argmax and small top-k touch only the few chunks that matter, so no op copies whole rows
    (on CPU torch's argmax alone is ~4x slower than that pass, and topk more; measured
    once, no script). An argmax wants no chunk maxima where the kernels' `argmax_rows`
    is given: one pass of its own, one call.
    Falls back to plain torch ops where the view is not free (odd vocab, GPU).
    """

    def __init__(
        self,
        logits: torch.Tensor,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.logits = logits
        self.chunks = _chunked(logits)
        self.argmax_rows = argmax_rows if logits.device.type == "cpu" else None

    @functools.cached_property
    def chunk_max(self) -> torch.Tensor | None:
        return None if self.chunks is None else self.chunks.amax(-1)

    def select(self, rows: torch.Tensor | None) -> torch.Tensor:
        return self.logits if rows is None else self.logits.index_select(0, rows)

    def max(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Row maxima as [n, 1]."""
        if self.chunk_max is None:
            return self.select(rows).amax(-1, keepdim=True)
        cm = self.chunk_max if rows is None else self.chunk_max[rows]
        return cm.amax(-1, keepdim=True)

    def argmax(self, rows: torch.Tensor | None) -> torch.Tensor:
        """argmax, ties to the lowest index like torch's: the first maximal
        entry of the first chunk holding the row max is the row's first."""
        if self.argmax_rows is not None:
            return self.argmax_rows(self.select(rows))
        if self.chunks is None or self.chunk_max is None:
            return self.select(rows).argmax(-1)
        if rows is None:
            rows = torch.arange(self.logits.shape[0], device=self.logits.device)
        best = self.chunk_max[rows].argmax(-1)
        return best * _CHUNK + self.chunks[rows, best].argmax(-1)

    def topk(self, rows: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`torch.topk(row, k)`, best first. The k best entries lie in the k chunks
        with the largest maxima: a chunk left out has k chunks above it, each
        holding an entry at least as large."""
        if self.chunks is None or self.chunk_max is None or k * _CHUNK * 4 > self.logits.shape[1]:
            return torch.topk(self.select(rows), k, dim=-1)
        if rows is None:
            rows = torch.arange(self.logits.shape[0], device=self.logits.device)
        best = self.chunk_max[rows].topk(k, dim=-1).indices
        candidates = self.chunks[rows.unsqueeze(1), best].flatten(1)
        values, pos = candidates.topk(k, dim=-1)
        return values, best.gather(1, pos // _CHUNK) * _CHUNK + pos % _CHUNK


def _chunked(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, chunks, _CHUNK] when that is a free view and worth it, else None."""
    rows, width = x.shape
    if x.device.type != "cpu" or width % _CHUNK or width < 16 * _CHUNK or not x.is_contiguous():
        return None
    return x.view(rows, width // _CHUNK, _CHUNK)


def _invert_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw per row: (index, the uniform's unused part rescaled to [0, 1)).

    A zero weight is never chosen: searchsorted(right=True) finds the first cdf
    entry above the target, and a zero weight repeats the previous entry;
    keeping the target below the total keeps the answer inside the row.
    """
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, cdf.new_zeros(())))
    index = torch.searchsorted(cdf, target, right=True)
    weight = weights.gather(1, index)
    residual = ((target - (cdf.gather(1, index) - weight)) / weight).clamp_(0.0, 1.0 - 1e-12)
    return index.squeeze(1), residual.squeeze(1)


def _draw_from_weights(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, index i with probability weights[i] / sum(weights); float64 uniforms.

    Long rows pick a chunk from chunk sums, then an entry inside it with the
    rest of the same uniform: an exact draw that needs one summing pass over
    the row instead of a full-length cumsum.
    """
    chunks = _chunked(weights)
    if chunks is None:
        return _invert_cdf(weights.double(), uniforms)[0]
    chunk, rest = _invert_cdf(chunks.sum(-1).double(), uniforms)
    inside = chunks[torch.arange(weights.shape[0], device=weights.device), chunk]
    return chunk * _CHUNK + _invert_cdf(inside.double(), rest)[0]


def _inverse_temperatures(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    """1 / T per row, kept above float32's underflow: at T ~ 1e38 it would round to 0, and
    a banned token's -inf logit (sample/logits_controls.py) times 0 is NaN, not 0."""
    return torch.tensor([max(1.0 / p.temperature, 1e-30) for p in params], device=device)


def _judging_temperatures(
    params: Sequence[SamplingParams], device: torch.device
) -> torch.Tensor | None:
    """Each row's inverse temperature for truncating: 1 where the temperature comes last
    (llama.cpp's order), its own elsewhere; None when no row takes llama.cpp's order."""
    if not any(p.temperature_last for p in params):
        return None
    inverse = [1.0 if p.temperature_last else max(1.0 / p.temperature, 1e-30) for p in params]
    return torch.tensor(inverse, device=device)


def _kind(p: SamplingParams, vocab: int) -> str:
    """How a random row is drawn: from the whole vocab, among candidate sets, or through
    llama.cpp's infill sampler."""
    if p.infill_eog:
        return "infill"
    return "truncated" if _top_k(p, vocab) > 0 or p.top_p < 1.0 else "full"


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < _GREEDY_TEMPERATURE or p.top_k == 1


def _top_k(p: SamplingParams, vocab: int) -> int:
    """The request's k, or 0 when top-k is off or keeps the whole vocab anyway."""
    return p.top_k if 0 < p.top_k < vocab else 0


@dataclass(frozen=True)
class _Draws:
    """Random rows sampled together: their rows of the step's logits, their params (in
    the same order) and the uniform each one consumes."""

    rows: _LogitRows
    row_ids: list[int]
    params: list[SamplingParams]
    uniforms: torch.Tensor


@dataclass(frozen=True)
class _Truncation:
    """Truncated rows' settings as tensors, one entry a row. `judge_inv_temp`: the inverse
    temperature top-k, top-p and min-p judge the distribution at (1 for llama.cpp's order,
    SamplingParams.temperature_last); None when every row judges at its own."""

    inv_temp: torch.Tensor
    top_k: torch.Tensor  # the vocab size where top-k is off
    top_p: torch.Tensor
    min_p: torch.Tensor
    judge_inv_temp: torch.Tensor | None

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> _Truncation:
        return cls(
            _inverse_temperatures(params, device),
            torch.tensor([_top_k(p, vocab) or vocab for p in params], device=device),
            torch.tensor([p.top_p for p in params], device=device),
            torch.tensor([p.min_p for p in params], device=device),
            _judging_temperatures(params, device),
        )

    def rows(self, index: torch.Tensor) -> _Truncation:
        judge = None if self.judge_inv_temp is None else self.judge_inv_temp[index]
        return _Truncation(
            self.inv_temp[index], self.top_k[index], self.top_p[index], self.min_p[index], judge
        )

    @property
    def judging_inv_temp(self) -> torch.Tensor:
        return self.inv_temp if self.judge_inv_temp is None else self.judge_inv_temp


def _candidates(draws: _Draws, here: list[int], level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `level` best logits of draws `here` (values and token ids, best first), or at
    the vocab size their whole rows sorted."""
    rows = draws.rows
    selected = (
        None  # every row of the step: read the logits in place
        if len(here) == len(draws.params) == rows.logits.shape[0]
        else torch.tensor([draws.row_ids[j] for j in here], device=rows.logits.device)
    )
    if level >= rows.logits.shape[1]:
        # Stable, so equal logits keep vocab order and the draw is reproducible.
        return torch.sort(rows.select(selected), dim=-1, descending=True, stable=True)
    return rows.topk(selected, level)


def _draw_candidates(
    values: torch.Tensor,
    indices: torch.Tensor,
    limits: _Truncation,
    level: int,
    vocab_mass: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token drawn among its `level` best candidates (`values` best first, their
    token ids `indices`) under top-k, top-p and min-p; and whether the row's support
    provably lies among them (where it does not, the draw is discarded and the row tries
    the next level)."""
    ratio = ((values - values[:, :1]) * limits.inv_temp.unsqueeze(1)).exp_()
    position = torch.arange(values.shape[1], device=values.device)
    outside_top_k = position >= limits.top_k.unsqueeze(1)
    ratio.masked_fill_(outside_top_k, 0.0)
    # What top-p and min-p judge: the tempered ratios, or in llama.cpp's order untempered
    # ones (`vocab_mass` is at the same temperature).
    judged = ratio
    if limits.judge_inv_temp is not None:
        judged = ((values - values[:, :1]) * limits.judge_inv_temp.unsqueeze(1)).exp_()
        judged.masked_fill_(outside_top_k, 0.0)
    has_top_k = limits.top_k <= level
    probs = judged / torch.where(has_top_k, judged.sum(-1), vocab_mass).unsqueeze(1)
    cumulative = probs.cumsum(-1)
    # vLLM's rule: drop the low tail whose total mass is <= 1 - p, i.e.
    # keep a token while the mass strictly above it is < p (the best always).
    keep = (cumulative - probs) < limits.top_p.unsqueeze(1)
    keep &= judged >= limits.min_p.unsqueeze(1)
    # The best token always stays, whatever the rounding: a top_p below float32's
    # range (1e-85) is 0 here, and an empty support would index past the row.
    keep[:, 0] = True
    positions = _draw_from_weights(ratio * keep, uniforms)
    chosen = indices.gather(1, positions.unsqueeze(1)).squeeze(1)
    done = has_top_k | (limits.top_p >= 1.0) | (cumulative[:, -1] >= limits.top_p)
    return chosen, done


class Sampler:
    """Samples one token per row of a [S, V] float32 logits tensor; see the module doc.

    Holds only a scratch buffer, so one instance serves every step; not thread-safe.
    """

    def __init__(self, argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`argmax_rows`: the kernels' op (float32 [rows, vocab] -> int64 [rows], as
        torch.argmax), where the model runs on them."""
        self._workspace: torch.Tensor | None = None
        self._argmax_rows = argmax_rows
        # A token's text as bytes, special tokens empty: what the infill sampler compares
        # (the engine sets it from its tokenizer; rows asking for it need it).
        self.token_piece: Callable[[int], bytes] | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        raw_logits: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """`raw_logits`: the model's logits when `logits` are those after the sampling
        controls (sample/logits_controls.py); logprobs are reported from them."""
        logits = logits.float().contiguous()  # no-ops for the float32 rows we expect
        num_rows, device = logits.shape[0], logits.device
        if len(params) != num_rows or len(generators) != num_rows:
            raise ValueError(
                f"{num_rows} logit rows but {len(params)} params and {len(generators)} generators"
            )
        rows = _LogitRows(logits, self._argmax_rows)
        random_rows = [i for i, p in enumerate(params) if not _is_greedy(p)]
        if not random_rows:
            tokens = rows.argmax(None)
        else:
            tokens = torch.empty(num_rows, dtype=torch.long, device=device)
            greedy = [i for i, p in enumerate(params) if _is_greedy(p)]
            if greedy:
                greedy_t = torch.tensor(greedy, device=device)
                tokens[greedy_t] = rows.argmax(greedy_t)
            self._sample_random(rows, params, generators, random_rows, tokens)
        token_ids: list[int] = tokens.tolist()
        wants_logprobs = any(p.logprobs is not None for p in params)
        if raw_logits is not None and raw_logits is not logits and wants_logprobs:
            rows = _LogitRows(raw_logits.float().contiguous(), self._argmax_rows)
        return SamplerOutput(token_ids, self._logprobs(rows, params, tokens, token_ids))

    def probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The distribution one row of `logits` is sampled from under `params`, dense
        ([rows, vocab], rows sum to 1): temperature, then top-k, then top-p over the top-k
        survivors, then min-p, with the same rules as the draws above. For speculative
        decoding's acceptance test, on a handful of rows."""
        logits = logits.float()
        vocab = logits.shape[-1]
        if _is_greedy(params):
            return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        ratio = ((logits - logits.amax(-1, keepdim=True)) / params.temperature).exp_()
        # What the truncation judges (SamplingParams.temperature_last: untempered).
        judged = (
            (logits - logits.amax(-1, keepdim=True)).exp_() if params.temperature_last else ratio
        )
        keep = torch.ones_like(ratio, dtype=torch.bool)
        top_k = _top_k(params, vocab)
        if top_k or params.top_p < 1.0:
            values, order = torch.sort(judged, dim=-1, descending=True, stable=True)
            ranked = torch.ones_like(values, dtype=torch.bool)
            if top_k:
                ranked[:, top_k:] = False
            if params.top_p < 1.0:
                mass = values * ranked
                share = mass / mass.sum(-1, keepdim=True)
                ranked &= (share.cumsum(-1) - share) < params.top_p
                ranked[:, 0] = True
            keep = torch.zeros_like(keep).scatter_(-1, order, ranked)
        if params.min_p > 0.0:
            keep &= judged >= params.min_p
        weights = ratio * keep
        return weights / weights.sum(-1, keepdim=True)

    def logprobs_of(
        self, logits: torch.Tensor, params: SamplingParams, token_ids: list[int]
    ) -> list[TokenLogprobs | None]:
        """Logprobs (as the sampler reports them) of given tokens, one per row."""
        logits = logits.float().contiguous()
        tokens = torch.tensor(token_ids, device=logits.device)
        return self._logprobs(
            _LogitRows(logits, self._argmax_rows), [params] * len(token_ids), tokens, token_ids
        )

    @staticmethod
    def is_greedy(params: SamplingParams) -> bool:
        return _is_greedy(params)

    @staticmethod
    def uniform(generator: torch.Generator | None) -> float:
        if generator is None:
            return float(torch.rand(1, dtype=torch.float64))
        return float(Sampler._draw(generator))

    @staticmethod
    def replay_draws(
        generator: torch.Generator, state: torch.Tensor, num_rows: int, params: SamplingParams
    ) -> None:
        """Put `generator` where it would be had a call drawn for only `num_rows` of the
        rows it served (from `state`, its state before that call)."""
        if _is_greedy(params):
            return  # greedy rows draw nothing
        generator.set_state(state)
        for _ in range(num_rows):
            Sampler._draw(generator)

    @staticmethod
    def _draw(generator: torch.Generator) -> torch.Tensor:
        return torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)

    def _sample_random(
        self,
        rows: _LogitRows,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        random_rows: list[int],
        tokens: torch.Tensor,
    ) -> None:
        device, vocab = rows.logits.device, rows.logits.shape[1]
        # float64: the two-level draw spends some of the uniform's bits choosing a chunk.
        uniforms = torch.rand(len(random_rows), dtype=torch.float64, device=device)
        for j, i in enumerate(random_rows):
            gen = generators[i]
            if gen is not None:
                uniforms[j] = self._draw(gen).to(device)[0]
        # Temperature-only (and min-p) rows sample from the whole vocab; top-k
        # and top-p rows go through candidate sets; rows with llama.cpp's infill sampler
        # through theirs, one by one.
        kinds = [_kind(params[i], vocab) for i in random_rows]
        for kind, sample in (
            ("full", self._sample_full),
            ("truncated", self._sample_truncated),
            ("infill", self._sample_infill),
        ):
            group = [j for j, k in enumerate(kinds) if k == kind]
            if group:
                row_ids = [random_rows[j] for j in group]
                draws = _Draws(rows, row_ids, [params[i] for i in row_ids], uniforms[group])
                tokens[torch.tensor(row_ids, device=device)] = sample(draws)

    def _ratios(self, rows: _LogitRows, row_ids: list[int], inv_temp: torch.Tensor) -> torch.Tensor:
        """exp((x - max) / T) = p_i / p_max for the given rows, in the workspace.

        This unnormalised distribution is also exactly what min-p compares
        against, and the best token's ratio is exactly 1.
        """
        logits = rows.logits
        n, vocab = len(row_ids), logits.shape[1]
        ws = self._workspace
        if ws is None or ws.numel() < n * vocab or ws.device != logits.device:
            ws = self._workspace = torch.empty(n * vocab, dtype=torch.float32, device=logits.device)
        out = ws[: n * vocab].view(n, vocab)
        if n == logits.shape[0]:
            selected, src = None, logits  # read the caller's tensor directly: no copy
        else:
            selected = torch.tensor(row_ids, device=logits.device)
            src = torch.index_select(logits, 0, selected, out=out)
        torch.sub(src, rows.max(selected), out=out)
        if bool((inv_temp != 1.0).any()):
            out.mul_(inv_temp.unsqueeze(1))
        return out.exp_()

    def _sample_full(self, draws: _Draws) -> torch.Tensor:
        params, device = draws.params, draws.rows.logits.device
        inv_temp = _inverse_temperatures(params, device)
        weights = self._ratios(draws.rows, draws.row_ids, inv_temp)
        if any(p.min_p > 0.0 for p in params):
            # An untempered ratio r is >= min_p exactly where the tempered r ** (1 / T) is
            # >= min_p ** (1 / T): llama.cpp's order costs no second pass.
            min_p = torch.tensor(
                [
                    p.min_p ** (1.0 / p.temperature) if p.temperature_last else p.min_p
                    for p in params
                ],
                device=device,
            )
            weights.masked_fill_(weights < min_p.unsqueeze(1), 0.0)
        return _draw_from_weights(weights, draws.uniforms)

    def _sample_truncated(self, draws: _Draws) -> torch.Tensor:
        """Top-k, then top-p over the top-k survivors, then min-p, over growing candidate sets.

        A row is resolved with K candidates when its support provably lies in
        them: top-k with k <= K, or a nucleus whose mass is reached within the K
        best tokens (every later token then has >= p of mass above it and is cut).
        """
        rows, params = draws.rows, draws.params
        device, vocab = rows.logits.device, rows.logits.shape[1]
        limits = _Truncation.of(params, vocab, device)
        vocab_mass = self._vocab_mass(draws, limits.judging_inv_temp)
        picked = torch.empty(len(params), dtype=torch.long, device=device)
        pending = list(range(len(params)))
        for level in sorted({min(k, vocab) for k in _CANDIDATE_LEVELS} | {vocab}):
            # A top-k row cannot start below its k: renormalising the top-k
            # distribution needs all k candidates.
            here = [j for j in pending if _top_k(params[j], vocab) <= level]
            if not here:
                continue
            values, indices = _candidates(draws, here, level)
            h = torch.tensor(here, device=device)
            chosen, done = _draw_candidates(
                values, indices, limits.rows(h), level, vocab_mass[h], draws.uniforms[h]
            )
            picked[h[done]] = chosen[done]
            finished = set(h[done].tolist())
            pending = [j for j in pending if j not in finished]
            if not pending:
                break
        return picked

    def _sample_infill(self, draws: _Draws) -> torch.Tensor:
        """Top-k, top-p and min-p (judged as _sample_truncated judges them), then llama.cpp's
        infill sampler (sample/infill_filter.py), then a draw among what it kept by their
        logits at the row's temperature; row by row."""
        if self.token_piece is None:
            raise ValueError("the infill sampler needs the tokens' texts (Sampler.token_piece)")
        logits, vocab = draws.rows.logits, draws.rows.logits.shape[1]
        picked: list[int] = []
        for j, (row, p) in enumerate(zip(draws.row_ids, draws.params, strict=True)):
            values, ids = torch.topk(logits[row], _top_k(p, vocab) or vocab)
            judged = (
                (values - values[0]) * (1.0 if p.temperature_last else 1.0 / p.temperature)
            ).exp()
            probs = judged / judged.sum()
            keep = ((probs.cumsum(0) - probs) < p.top_p) & (judged >= p.min_p)
            keep[0] = True
            kept_probs, kept_values = probs[keep], values[keep]
            kept_ids: list[int] = ids[keep].tolist()
            chosen = infill_keep(
                kept_ids, (kept_probs / kept_probs.sum()).tolist(), self.token_piece, p.infill_eog
            )
            if not chosen:  # nothing but the end: its end-of-text token
                picked.append(p.infill_eog[0])
                continue
            where = {token: k for k, token in enumerate(kept_ids)}
            chosen_logits = kept_values[[where[token] for token in chosen]]
            weights = ((chosen_logits - chosen_logits.max()) / p.temperature).exp()
            index = _draw_from_weights(weights.unsqueeze(0), draws.uniforms[j : j + 1])
            picked.append(chosen[int(index)])
        return torch.tensor(picked, dtype=torch.long, device=logits.device)

    def _vocab_mass(self, draws: _Draws, inv_temp: torch.Tensor) -> torch.Tensor:
        """sum_i p_i / p_max over the whole vocab for the rows with a nucleus and no top-k
        (NaN for the others): such a nucleus is measured against the whole vocab, so one
        pass over the row, done once, not once per candidate level."""
        vocab = draws.rows.logits.shape[1]
        mass = torch.full((len(draws.params),), float("nan"), device=draws.rows.logits.device)
        needs_mass = [
            j for j, p in enumerate(draws.params) if not _top_k(p, vocab) and p.top_p < 1.0
        ]
        if needs_mass:
            row_ids = [draws.row_ids[j] for j in needs_mass]
            mass[needs_mass] = self._ratios(draws.rows, row_ids, inv_temp[needs_mass]).sum(-1)
        return mass

    def _logprobs(
        self,
        rows: _LogitRows,
        params: Sequence[SamplingParams],
        tokens: torch.Tensor,
        token_ids: list[int],
    ) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return out
        # log_softmax(x) = x - logsumexp(x): never materialise [S, V] log-probs;
        # the top-n log-probs are the top-n logits, shifted.
        device = rows.logits.device
        selected = None if len(wanted) == len(params) else torch.tensor(wanted, device=device)
        row_t = torch.arange(len(params), device=device) if selected is None else selected
        ones = torch.ones(len(wanted), device=device)
        lse = self._ratios(rows, wanted, ones).sum(-1, keepdim=True).log_() + rows.max(selected)
        raw = rows.logits[row_t, tokens[row_t]].unsqueeze(1)
        sampled = (raw - lse).squeeze(1).tolist()
        top_n = max(params[i].logprobs or 0 for i in wanted)
        top_values: list[list[float]] = [[] for _ in wanted]
        top_indices: list[list[int]] = [[] for _ in wanted]
        if top_n > 0:
            values, indices = rows.topk(selected, min(top_n, rows.logits.shape[1]))
            top_values, top_indices = (values - lse).tolist(), indices.tolist()
        for j, i in enumerate(wanted):
            n = params[i].logprobs or 0
            top = list(zip(top_indices[j][:n], top_values[j][:n], strict=True))
            out[i] = TokenLogprobs(token_ids[i], sampled[j], top)
        return out
