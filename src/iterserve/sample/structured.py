"""Structured output with llguidance: grammars compiled once per constraint and cached,
and per request a matcher that masks the logits and follows the sampled tokens.

Why llguidance (and not xgrammar): docs/structured_output.md, with the measurements.

- `GrammarCompiler` turns a `StructuredOutput` into a `CompiledGrammar`, cached by the
  constraint (kind, spec). Thread-safe: the server compiles on worker threads so the
  step loop never waits for a grammar (engine/async_engine.py).
- `StructuredBatch` is the executor's side (executor/torch_runner.py): one matcher per
  request id, created from the compiled grammar when the request first samples and
  dropped when it finishes. Each step fills one bitmask for all constrained rows (in
  parallel, in llguidance's threads; a speculating request's rows each masked after
  the guesses before it), applies it to the logits in one pass, and after sampling
  advances each matcher by its kept tokens.
- A thinking model's request may say its grammar starts after its thinking
  (`StructuredOutput.after_thinking`): its `ThinkingGate` (sample/thinking_gate.py)
  watches the tokens, and until the thinking ends its rows are left unmasked and its
  matcher (and number bound) follow nothing.

A matcher whose grammar can go no further allows only EOS, so the request ends with
`stop`; where it is complete but could go on, EOS is one of the tokens it allows.

JSON (a schema or any object) gets a second matcher beside the schema's: the bound on
its numbers' digits (sample/json_number_bounds.py), a regular language over the whole
text. A token is allowed where both allow it. Where the bound would leave no token the
schema allows (a schema needing more digits than the caps, e.g. a large `multipleOf`),
the schema alone decides that row, and the request drops its bound once it takes a
token the bound refuses: the bound steers, the schema has the last word.

The bound's own mask is rarely filled, since outside a number it walks most of the
vocabulary (~1.3 ms a row) and refuses nothing a JSON schema allows there
(`NumberBound`): a row is left to the schema where the bound is between values or in
a string and the schema allows only tokens the bound never refuses there; a row
allowing a few tokens (inside a number: digits, `.`, `e`, what ends it) has each
checked against the bound; only the rest get the bound's mask
(docs/structured_output.md, "What the bound costs").
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from iterserve.sample.json_number_bound_rows import NumberBound, few_tokens
from iterserve.sample.json_number_bounds import NumberBounds
from iterserve.sample.thinking_gate import Phase, ThinkingGate
from iterserve.sampling_params import InvalidRequestError
from iterserve.structured_output import StructuredOutput, ThinkingMarkers

# Compiled grammars kept; a schema is a few kB of automaton, a server sees few distinct ones.
logger = logging.getLogger(__name__)

_CACHE_SIZE = 256
# Tokens of a grammar's first mask tried before it is accepted (GrammarCompiler).
_START_PROBES = 16
# JSON as compact as a person writes it: a small model given free whitespace may emit
# newlines until max_tokens (a known failure with flexible whitespace).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CompiledGrammar:
    """A matcher in its start state; each request's matcher is a copy of it."""

    template: Any  # llguidance.LLMatcher
    # JSON's bound on number digits (None for other constraints).
    bound: NumberBound | None = None

    def new_matcher(self) -> Any:
        return self.template.deep_copy()

    def new_bound(self) -> Any:
        return None if self.bound is None else self.bound.template.deep_copy()


def grammar_text(spec: StructuredOutput) -> str:
    """The constraint as an llguidance grammar (not yet checked)."""
    matcher = llguidance.LLMatcher
    if spec.json_schema is not None:
        return matcher.grammar_from_json_schema(spec.json_schema, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.json_object:
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # Lark string literals take JSON's escapes, so any choice is matched literally.
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    assert spec.grammar is not None
    lark = gbnf_to_lark(spec.grammar) if "::=" in spec.grammar else spec.grammar
    return matcher.grammar_from_lark(lark)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, caching by constraint."""

    library = f"llguidance {importlib.metadata.version('llguidance')}"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids) or None
        self._lltokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        # Bound matchers by their caps: nearly every schema shares the default ones.
        self._bounds: dict[NumberBounds, NumberBound] = {}
        self._lock = threading.Lock()

    @property
    def lltokenizer(self) -> Any:
        """The library's view of the vocabulary, built on first use (~0.3 s at 49152)."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._lltokenizer

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar (cached); raises InvalidRequestError naming `spec.param`
        for a constraint that is malformed or that no output can satisfy."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self.compile_uncached(spec)  # outside the lock: others may compile meanwhile
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def compile_uncached(self, spec: StructuredOutput) -> CompiledGrammar:
        try:
            text = grammar_text(spec)
        except Exception as error:  # the GBNF converter raises bare Exceptions
            raise InvalidRequestError(f"invalid {spec.kind}: {error}", spec.param) from None
        template = llguidance.LLMatcher(self.lltokenizer, text, log_level=0)
        if template.is_error():
            raise InvalidRequestError(
                f"invalid {spec.kind}: {template.get_error().strip()}", spec.param
            )
        if not _can_start(template.deep_copy(), self.vocab_size):
            raise InvalidRequestError(
                f"invalid {spec.kind}: no token of this model's vocabulary can begin text "
                "it matches (it needs bytes the tokenizer cannot write)",
                spec.param,
            )
        return CompiledGrammar(template, self._bound_for(spec))

    def _bound_for(self, spec: StructuredOutput) -> NumberBound | None:
        """The number bound in its start state, for JSON constraints."""
        if spec.json_schema is not None:
            bounds = NumberBounds.for_schema(spec.json_schema)
        elif spec.json_object:
            bounds = NumberBounds()
        else:
            return None
        with self._lock:
            bound = self._bounds.get(bounds)
        if bound is None:
            text = llguidance.LLMatcher.grammar_from_regex(bounds.text_regex())
            matcher = llguidance.LLMatcher(self.lltokenizer, text, log_level=0)
            if matcher.is_error():  # the regex is ours: a failure is iterserve's bug
                raise RuntimeError(f"the JSON number bound does not compile: {matcher.get_error()}")
            bound = NumberBound.build(matcher, self.lltokenizer, self.vocab_size)
            with self._lock:
                self._bounds[bounds] = bound
        return bound

    def attach(self, spec: StructuredOutput) -> None:
        """Compile `spec` unless it already carries its grammar."""
        if spec.compiled is None:
            spec.compiled = self.compile(spec)


@dataclass(frozen=True)
class _Rows:
    """How a request's rows in one mask are masked: rows before `first` are its thinking
    (left as they are), rows from `first` on by its matchers after `draft` (its guesses
    from there). `first` None: every row is thinking. `lone_first`: row 0 is masked on its
    own (an undecided gate whose first guess opens thinking); `opener`: the token row 0
    allows beside the grammar's (the token that opens thinking)."""

    first: int | None
    draft: Sequence[int]
    lone_first: bool = False
    opener: int | None = None


class StructuredBatch:
    """The matchers of the requests being decoded under a constraint, by request id."""

    def __init__(self, num_threads: int | None = None) -> None:
        self._matchers: dict[str, Any] = {}
        # The number bounds of JSON requests, each following the same tokens as its
        # request's matcher until it refuses one the schema takes (then dropped).
        self._bounds: dict[str, Any] = {}
        self._bound_specs: dict[str, NumberBound] = {}
        # Requests whose grammar starts after their thinking, and, for taking guesses back,
        # what each followed guess changed: (the gate before it if it moved, whether the
        # matchers took it).
        self._gates: dict[str, ThinkingGate] = {}
        self._trails: dict[str, list[tuple[ThinkingGate | None, bool]]] = {}
        self._executor = llguidance.LLExecutor(num_threads=num_threads)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(
        self,
        request_id: str,
        grammar: CompiledGrammar,
        after_thinking: ThinkingMarkers | None = None,
    ) -> None:
        self._matchers[request_id] = grammar.new_matcher()
        if grammar.bound is not None:
            self._bounds[request_id] = grammar.new_bound()
            self._bound_specs[request_id] = grammar.bound
        if after_thinking is not None:
            self._gates[request_id] = ThinkingGate.start(after_thinking)
            self._trails[request_id] = []

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._bounds.pop(request_id, None)
        self._bound_specs.pop(request_id, None)
        self._gates.pop(request_id, None)
        self._trails.pop(request_id, None)

    def mask(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        rows: Sequence[int] | None = None,
        drafts: Sequence[Sequence[int]] | None = None,
        fallback: torch.Tensor | None = None,
    ) -> None:
        """Set to -inf, in place, every logit a request's grammar forbids next: row
        `rows[i]` (default i) for `request_ids[i]`. With `drafts` (speculation), request i
        owns rows `rows[i]` to `rows[i] + len(drafts[i])`, and row `rows[i] + j` is masked
        by its matcher's state after drafts[i][:j] (the library consumes them and rolls
        back); rows past a draft the grammar rejects stay unmasked: verification never
        gets past that draft (its own row forbids it). One bitmask fill for all (in the
        library's threads), then one masked pass over those rows. A request still
        thinking has its rows up to the end of its thinking left as they are.

        `fallback`: the logits before the request's own controls (bias, bans, min_tokens,
        penalties). The grammar has the last word: a row where the controls left no token
        the grammar allows (min_tokens against a finished JSON value, a -100 bias on the
        only bracket that may come next) is drawn from `fallback` under the grammar alone,
        instead of from a row of -inf whose draw would break the grammar."""
        width = logits.shape[1]
        starts = list(range(len(request_ids))) if rows is None else list(rows)
        lengths = [1] * len(request_ids) if drafts is None else [1 + len(d) for d in drafts]
        plans = [
            self._rows(request_id, () if drafts is None else drafts[i])
            for i, request_id in enumerate(request_ids)
        ]
        bitmask = self._bitmask(request_ids, lengths, plans, width)
        # Bit i of word w is token 32w + i: little-endian words, bits unpacked low first
        # (numpy's unpack is ~15x faster than shifting and masking with torch ops).
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=width, bitorder="little")
        targets = [start + j for start, n in zip(starts, lengths, strict=True) for j in range(n)]
        forbidden = bits == 0
        _forbid(logits, targets, forbidden)
        if fallback is None:
            return
        emptied = (logits[targets] == float("-inf")).all(dim=1).tolist()
        for i, (row, empty) in enumerate(zip(targets, emptied, strict=True)):
            if empty:
                logits[row] = fallback[row]
                _forbid(logits, [row], forbidden[i : i + 1])

    def _rows(self, request_id: str, draft: Sequence[int]) -> _Rows:
        """Which of a request's rows its grammar masks, given its guesses this step."""
        gate = self._gates.get(request_id)
        if gate is None or gate.is_open:
            return _Rows(0, draft)
        after, taken = gate.follow(draft)
        undecided = gate.phase is Phase.UNDECIDED
        first = taken if after.is_open or after.phase is Phase.UNDECIDED else None
        return _Rows(
            first,
            draft[taken:] if first is not None else (),
            # An undecided row 0 is always masked; by itself when the first guess opened
            # thinking, so the batch call does not start this matcher there.
            lone_first=undecided and first != 0,
            opener=gate.markers.open if undecided else None,
        )

    def _bitmask(
        self,
        request_ids: Sequence[str],
        lengths: list[int],
        plans: list[_Rows],
        width: int,
    ) -> np.ndarray:
        """One row of allowed-token bits (32 to a word) per masked logit row, request i's
        `lengths[i]` rows one after the other: what its grammar allows, and its number
        bound too where the two leave some token (the bound yields to the schema); a
        thinking request's rows allow everything, an undecided one's first row the token
        that opens thinking too."""
        words = (width + 31) // 32
        matchers = [self._matchers[request_id] for request_id in request_ids]
        bitmask = self._fill(matchers, lengths, plans, words)
        offsets = list(itertools.accumulate(lengths, initial=0))
        self._apply_bounds(request_ids, offsets, plans, bitmask)
        for offset, plan in zip(offsets, plans, strict=False):
            if plan.opener is not None:  # after the bound: the opener is not JSON's text
                row = bitmask[offset].view(np.uint32)
                row[plan.opener >> 5] |= np.uint32(1 << (plan.opener & 31))
        return bitmask

    def _apply_bounds(
        self,
        request_ids: Sequence[str],
        offsets: list[int],
        plans: list[_Rows],
        bitmask: np.ndarray,
    ) -> None:
        """AND into the schema's rows (`bitmask`, request i's from `offsets[i]`) what the
        number bounds allow, leaving a row as it is where that would empty it. A row is
        the bound's at its state after the guesses before it, and the bound's mask is
        filled only where cheaper checks cannot answer (NumberBound, FEW_TOKENS in sample/json_number_bound_rows.py)."""
        # (bitmask row, the request's id, its guesses before that row)
        rows: list[tuple[int, str, list[int]]] = []
        for request_id, offset, plan in zip(request_ids, offsets[:-1], plans, strict=True):
            if request_id not in self._bounds:
                continue
            if plan.lone_first:
                rows.append((offset, request_id, []))
            if plan.first is not None:
                start = offset + plan.first
                draft = list(plan.draft)
                # Rows past a guess the schema refuses stay unmasked, as the library
                # leaves them: verification never gets past that guess.
                reached = self._matchers[request_id].validate_tokens(draft) if draft else 0
                rows.extend((start + j, request_id, draft[:j]) for j in range(reached + 1))
        if not rows:
            return
        # The rows' words where some state outside numbers refuses a token, read as one
        # Python int a row (a few hundred words: two ANDs of ints, not numpy calls).
        taken: dict[int, bytes] = {}
        full: list[tuple[int, Any]] = []  # rows that need the bound's mask, its matcher there
        for row, request_id, prefix in rows:
            bound = self._bounds[request_id]
            spec = self._bound_specs[request_id]
            raw = taken.get(id(spec))
            if raw is None:
                raw = taken[id(spec)] = bitmask.take(spec.unsafe_words, axis=1).tobytes()
            size = 4 * len(spec.unsafe_words)
            if spec.skips(
                bound, prefix, int.from_bytes(raw[row * size : row * size + size], "little")
            ):
                continue
            n = len(prefix)
            if prefix and bound.validate_tokens(prefix) < n:
                # The bound refuses a guess before this row: the row is the schema's (the
                # library leaves a row past a refused guess unwritten, all allowed).
                continue
            state = bound  # asking it leaves it where it is; a fill needs a copy of its own
            if prefix:
                state = bound.deep_copy()
                if state.try_consume_tokens(prefix) != n:
                    raise RuntimeError(f"request {request_id}: its number bound lost its guesses")
            allowed = few_tokens(bitmask[row])
            if allowed is None:
                full.append((row, state if prefix else bound.deep_copy()))
                continue
            refused = [token for token in allowed if not state.validate_tokens([token])]
            if len(refused) < len(allowed):  # else the schema's row stays: the bound yields
                row_words = bitmask[row].view(np.uint32)
                for token in refused:
                    row_words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
        if not full:
            return
        words = bitmask.shape[1]
        bound_bits = np.empty((len(full), words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(state, k) for k, (_, state) in enumerate(full)],
            bound_bits.ctypes.data,
            words * 4,
            len(full),
        )
        for (row, _), bits in zip(full, bound_bits, strict=True):
            both = bitmask[row] & bits
            if both.any():
                bitmask[row] = both

    def _fill(
        self,
        matchers: list[Any],
        lengths: list[int],
        plans: list[_Rows],
        words: int,
    ) -> np.ndarray:
        """The allowed-token bits of `matchers`, matcher i's `lengths[i]` rows one after
        the other, from row `plans[i].first` on after each of its guesses from there (the
        rows before, thinking, all allowed), filled by the library's threads."""
        count = sum(lengths)
        offsets = list(itertools.accumulate(lengths, initial=0))
        stride = words * 4
        if count > len(plans) or any(plan.first != 0 for plan in plans):
            # Rows past a refused draft, and a thinking request's, are not written: they
            # stay all allowed.
            bitmask = np.full((count, words), -1, dtype=np.int32)
        else:
            bitmask = np.empty((count, words), dtype=np.int32)
        masked = [
            (matcher, offset + plan.first, list(plan.draft))
            for matcher, offset, plan in zip(matchers, offsets, plans, strict=False)
            if plan.first is not None
        ]
        plain = [(matcher, offset) for matcher, offset, draft in masked if not draft]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.ctypes.data, stride, count)
        drafted = [segment for segment in masked if segment[2]]
        if drafted:  # the library takes non-empty drafts only
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, bitmask.ctypes.data, stride, count
            )
            for matcher, offset, draft in drafted:
                self._fill_after_completion(matcher, bitmask, offset, draft)
        for matcher, offset, plan in zip(matchers, offsets, plans, strict=False):
            if plan.lone_first:  # the same matcher is not in the batch call at this row
                row = bitmask[offset]
                matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return bitmask

    @staticmethod
    def _fill_after_completion(
        matcher: Any, bitmask: np.ndarray, offset: int, draft: Sequence[int]
    ) -> None:
        """The library leaves unwritten (all allowed) the rows after a draft it refuses,
        which verification never reaches, but also the row after a draft that completes
        the grammar (llguidance 1.9.1), whose draw must be EOS: find the first unwritten
        row and, if the draft before it was allowed, write its mask here."""
        for j in range(1, len(draft) + 1):
            row = bitmask[offset + j]
            if row[0] != -1 or not (row == -1).all():
                continue  # written
            token = draft[j - 1]
            if (int(bitmask[offset + j - 1, token >> 5]) >> (token & 31)) & 1:
                # A complete grammar takes no EOS as a token, but its mask is EOS only.
                consumed = matcher.try_consume_tokens(list(draft[:j]))
                matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
                if consumed and not matcher.rollback(consumed):
                    raise RuntimeError("a grammar matcher could not roll its drafts back")
            return

    def valid_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, from the start, the request's grammar (and number
        bound) accepts next (0 for a request without a matcher yet; thinking accepts
        anything)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return 0
        taken = 0
        gate = self._gates.get(request_id)
        if gate is not None and not gate.is_open:
            after, taken = gate.follow(token_ids)
            if not (after.is_open or after.phase is Phase.UNDECIDED):
                return len(token_ids)
        answer = list(token_ids[taken:])
        valid = int(matcher.validate_tokens(answer))
        bound = self._bounds.get(request_id)
        if bound is not None and valid:
            valid = min(valid, int(bound.validate_tokens(answer[:valid])))
        return taken + valid

    def try_advance(self, request_id: str, token_id: int) -> bool:
        """Follow one guessed token if the grammar (and number bound) accepts it and the
        grammar is not already complete, or if it is thinking (a draft model's guesses;
        `rollback` undoes them). False, and no change, if not."""
        gate = self._gates.get(request_id)
        if gate is None or gate.is_open:
            taken = self._take_guess(request_id, token_id)
            if taken and gate is not None:
                self._trails[request_id].append((None, True))
            return taken
        after, to_grammar = gate.after(token_id)
        if to_grammar and not self._take_guess(request_id, token_id):
            return False
        self._gates[request_id] = after
        self._trails[request_id].append((gate, to_grammar))
        return True

    def _take_guess(self, request_id: str, token_id: int) -> bool:
        matcher = self._matchers[request_id]
        if matcher.is_stopped() or matcher.try_consume_tokens([token_id]) != 1:
            return False
        bound = self._bounds.get(request_id)
        if bound is not None and bound.try_consume_tokens([token_id]) != 1:
            self._rollback(matcher, 1, request_id)
            return False
        return True

    def rollback(self, request_id: str, num_tokens: int) -> None:
        trail = self._trails.get(request_id)
        if trail is not None and num_tokens:  # a gated request: the gate goes back too
            undone = trail[len(trail) - num_tokens :]
            del trail[len(trail) - num_tokens :]
            gates = [gate for gate, _ in undone if gate is not None]
            if gates:
                self._gates[request_id] = gates[0]
            num_tokens = sum(1 for _, to_grammar in undone if to_grammar)
        if num_tokens:
            self._rollback(self._matchers[request_id], num_tokens, request_id)
            bound = self._bounds.get(request_id)
            if bound is not None:
                self._rollback(bound, num_tokens, request_id)

    @staticmethod
    def _rollback(matcher: Any, num_tokens: int, request_id: str) -> None:
        if not matcher.rollback(num_tokens):
            raise RuntimeError(f"request {request_id}: cannot roll its grammar back")

    def advance(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Follow the tokens sampled for a request (all allowed by its last mask); a
        thinking request's gate takes them until its thinking ends."""
        gate = self._gates.get(request_id)
        if gate is not None and not gate.is_open:
            gate, taken = gate.follow(token_ids)
            self._gates[request_id] = gate
            token_ids = token_ids[taken:]
        matcher = self._matchers[request_id]
        if not token_ids:
            return
        if matcher.is_stopped():
            # Its request ended with the grammar; this step was planned before that was
            # known (asynchronous scheduling) and its token is discarded.
            return
        for token_id in token_ids:
            if matcher.is_stopped():
                if matcher.try_consume_tokens([token_id]):
                    continue  # EOS after a complete output
                # Past EOS: an accepted EOS draft's next row was sampled unmasked, and the
                # scheduler drops that token with the output's end.
                return
            if not matcher.consume_token(token_id):
                # A masked draw the grammar then refuses: the library allowed a token for
                # bytes no token of the vocabulary completes (a regex needing a byte the
                # tokenizer lacks). The matcher is stopped, its next mask is EOS only: the
                # request ends there, and the rest of the step is untouched.
                logger.warning(
                    "request %s: token %d breaks its grammar; ending it (%s)",
                    request_id, token_id, matcher.get_error().splitlines()[0],
                )  # fmt: skip
                return
            self._follow_bound(request_id, token_id)

    def _follow_bound(self, request_id: str, token_id: int) -> None:
        """Advance the request's number bound, or drop it if it refuses the token: the
        schema took a token the bound forbids, which only a row the bound would have
        emptied allows (a schema needing more digits than the caps)."""
        bound = self._bounds.get(request_id)
        if bound is not None and not bound.consume_token(token_id):
            del self._bounds[request_id]
            del self._bound_specs[request_id]
            logger.debug(
                "request %s: its schema needs more digits than the bound; dropped", request_id
            )

    def is_finished(self, request_id: str) -> bool:
        gate = self._gates.get(request_id)
        if gate is not None and not gate.is_open:
            return False
        return bool(self._matchers[request_id].is_stopped())


def _can_start(matcher: Any, vocab_size: int) -> bool:
    """Whether the grammar's start state lets some token (or the end) through: its mask
    allows a token that it then accepts. Only the first few are tried: where the
    library's mask is wrong at all (bytes with no token of their own), it is wrong
    for every token it allows."""
    if matcher.is_accepting():
        return True
    bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
    return any(matcher.validate_tokens([int(token)]) for token in allowed[:_START_PROBES])


def _forbid(logits: torch.Tensor, targets: list[int], forbidden: np.ndarray) -> None:
    """Set to -inf, in place, the logits of row `targets[i]` where `forbidden[i]` is set."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy's masked copy: one thread, no OpenMP handoff, which on a busy 2-core
        # machine cost torch's masked_fill_ ~15 ms a call (measured).
        view = logits.numpy()
        count = len(targets)
        if targets == list(range(targets[0], targets[0] + count)):
            np.copyto(view[targets[0] : targets[0] + count], -np.inf, where=forbidden)
        else:
            for i, row in enumerate(targets):
                np.copyto(view[row], -np.inf, where=forbidden[i])
        return
    index = torch.tensor(targets, device=logits.device)
    mask = torch.from_numpy(forbidden).to(logits.device)
    logits[index] = logits[index].masked_fill_(mask, float("-inf"))
