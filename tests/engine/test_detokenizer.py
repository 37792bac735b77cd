"""Incremental detokenization against full decoding, and stop-string cutting.

Uses the bundled model's tokenizer (byte-level BPE, vocab 49152), built from the
GGUF once per session by the `tokenizer_dir` fixture.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from iterserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "The capital of France is Paris. It has 2,165,423 inhabitants!",
    "naïve café, crème brûlée, jalapeño, Ångström, Dvořák, façade",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 🤗👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 rare 𝄞 and ∑∫√ math",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n\n\tindent  two  spaces",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "  leading spaces and trailing   ",
    "a",
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def sentencepiece_like() -> Any:
    """A tiny Llama-style tokenizer built in memory: Metaspace words, byte fallback,
    and a decoder that strips the leading space of whatever it decodes first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["The capital of France is Paris.", "Hello world, hello there. The end is near."]
    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = metaspace
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator(corpus * 5, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges = [tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _prompt(tokenizer: Any) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def _chunks(ids: Sequence[int], rng: random.Random) -> Iterator[list[int]]:
    """ids in random groups of 1-4 (speculative decoding appends several at once)."""
    i = 0
    while i < len(ids):
        step = rng.choice([1, 1, 1, 2, 3, 4])
        yield list(ids[i : i + step])
        i += step


def _stream(
    tokenizer: Any,
    prompt: Sequence[int],
    ids: Sequence[int],
    skip_special_tokens: bool = True,
    rng: random.Random | None = None,
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    groups = _chunks(ids, rng) if rng else ([t] for t in ids)
    deltas = [detok.add_tokens(group) for group in groups]
    return deltas, detok


# -- incremental detokenization -----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    for rng in (None, random.Random(0)):
        deltas, detok = _stream(tokenizer, _prompt(tokenizer), ids, rng=rng)
        assert "".join(deltas) == text == tokenizer.decode(ids, skip_special_tokens=True)
        assert detok.output_text == text
        assert detok.flush() == ""
        # Valid text never shows a replacement character, even mid-stream.
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_arrive_whole(tokenizer: Any) -> None:
    text = " 🤗 日本 é"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5  # the emoji and the CJK characters take several byte tokens
    deltas, _ = _stream(tokenizer, [], ids)
    assert "".join(deltas) == text
    assert any("🤗" in d for d in deltas)  # whole in one delta, never split across two
    assert "" in deltas  # some tokens completed nothing and were held back


def test_first_token_keeps_its_leading_space(tokenizer: Any, sentencepiece_like: Any) -> None:
    for tok in (tokenizer, sentencepiece_like):
        prompt = tok.encode("The capital of France is", add_special_tokens=False)
        ids = tok.encode("The capital of France is Paris. 日本🤗", add_special_tokens=False)
        assert ids[: len(prompt)] == prompt
        output = ids[len(prompt) :]
        deltas, _ = _stream(tok, prompt, output)
        assert deltas[0].startswith(" Paris")
        assert "".join(deltas) == " Paris. 日本🤗"
        # Without context the text is exactly the decode of the output alone,
        # which for SentencePiece has lost its leading space.
        deltas, _ = _stream(tok, [], output)
        assert "".join(deltas) == tok.decode(output)
    assert sentencepiece_like.decode(output) == "Paris. 日本🤗"


def test_random_sequences_sentencepiece_like(sentencepiece_like: Any) -> None:
    """Byte fallback and the leading-space strip: deltas in context == decode in context.

    The pieces are whole tokens and whole characters' byte runs in random order.
    (An invalid byte run is not "normal text": the ByteFallback decoder turns a
    whole run into U+FFFDs, so an ASCII byte token already streamed can become
    U+FFFD once an unfinished byte follows it; streamed text is never retracted.)
    """
    tok, rng = sentencepiece_like, random.Random(3)
    prompt = tok.encode("The capital is", add_special_tokens=False)
    words = [i for t, i in tok.get_vocab().items() if not t.startswith("<0x")]
    chars = [tok.encode(c, add_special_tokens=False)[1:] for c in "日本🤗éß€𝄞"]
    assert all(len(c) > 1 for c in chars)  # byte-fallback runs, without the "\u2581"
    for _ in range(300):
        ids: list[int] = []
        for _ in range(rng.randint(1, 15)):
            ids += [rng.choice(words)] if rng.random() < 0.6 else rng.choice(chars)
        for context in (prompt, []):
            deltas, detok = _stream(tok, context, ids, rng=rng)
            assert not any("\ufffd" in d for d in deltas)
            text = "".join(deltas) + detok.flush()
            prefix = tok.decode(context, skip_special_tokens=True)
            assert text == tok.decode(context + ids, skip_special_tokens=True)[len(prefix) :]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Any, skip: bool) -> None:
    ids = tokenizer.encode(
        "Hi<|im_end|> there<|endoftext|>🤗<|im_start|>x", add_special_tokens=False
    )
    deltas, detok = _stream(tokenizer, _prompt(tokenizer), ids, skip_special_tokens=skip)
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.output_text) is not skip


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences(tokenizer: Any, skip: bool) -> None:
    """Arbitrary ids, invalid UTF-8 included: deltas + flush == full decode."""
    rng = random.Random(1 if skip else 2)
    vocab = len(tokenizer)
    byte_tokens = tokenizer.encode("🤗日本語éß€𝄞", add_special_tokens=False)
    for _ in range(500):
        length = rng.randint(1, 40)
        # Mix in byte-level pieces and special tokens so partial characters are common.
        pool = [rng.randrange(vocab) for _ in range(length)] + byte_tokens + [0, 1, 2, 5]
        ids = [rng.choice(pool) for _ in range(length)]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        deltas, detok = _stream(tokenizer, prompt, ids, skip, rng=rng)
        tail = detok.flush()
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
        assert detok.output_text == "".join(deltas) + tail


def test_decodes_a_small_window_not_the_whole_sequence(tokenizer: Any) -> None:
    lengths: list[int] = []

    class Counting:
        """The tokenizer, recording how many ids each decode sees (no Rust fast path)."""

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            lengths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer.encode("word " * 400 + "🤗 end", add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting(), _prompt(tokenizer))
    text = "".join(detok.add_tokens([t]) for t in ids)
    assert text == tokenizer.decode(ids)
    assert max(lengths) <= 10, max(lengths)


# -- stop strings -------------------------------------------------------------------------------


def _run(matcher: StopStringMatcher, deltas: Sequence[str]) -> tuple[str, bool]:
    emitted, stopped = [], False
    for delta in deltas:
        safe, stopped = matcher.feed(delta)
        emitted.append(safe)
        if stopped:
            break
    if not stopped:
        emitted.append(matcher.flush())
    return "".join(emitted), stopped


def _reference(text: str, stops: Sequence[str], include: bool = False) -> tuple[str, bool]:
    """Character by character: cut before the first stop string to be completed (after it,
    with `include`)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end if include else end - max(len(s) for s in done)], True
    return text, False


def _splits(text: str) -> Iterator[list[str]]:
    """Every way of cutting text into two deltas, and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


@pytest.mark.parametrize(
    "text,stops,expected",
    [
        ("Hello world STOP more text", ["STOP"], "Hello world "),
        ("Hello world", ["world", "lo"], "Hel"),  # the first to appear wins
        ("cac", ["cac", "a"], "c"),  # ... even when a longer one started earlier
        ("xabcd", ["bcd", "abcd", "cd"], "x"),  # completed together: the longest
        ("xabce tail", ["abcd", "bce"], "xa"),  # a held partial of one, a hit of another
        ("STOP at once", ["STOP"], ""),
        ("a\n\nUser: hi", ["\n\nUser:", "\n\n\n"], "a"),
        ("emoji 🤗 stop🤗", ["stop🤗"], "emoji 🤗 "),
    ],
)
def test_stop_strings_across_every_split(text: str, stops: list[str], expected: str) -> None:
    for deltas in _splits(text):
        matcher = StopStringMatcher(stops)
        assert _run(matcher, deltas) == (expected, True), deltas
        assert matcher.stopped and matcher.stop_reason in stops
        assert matcher.feed("more") == ("", True)


@pytest.mark.parametrize(
    "text,stops",
    [
        ("ST STO STOPP? no: S T O P", ["STOP!"]),
        ("partial prefixes: <|e <|en <|end", ["<|end|>"]),
        ("nothing to see", []),
        ("ends with a prefix STO", ["STOP"]),
    ],
)
def test_no_false_stop(text: str, stops: list[str]) -> None:
    for deltas in _splits(text):
        matcher = StopStringMatcher(stops)
        assert _run(matcher, deltas) == (text, False), deltas
        assert matcher.stop_reason is None


def test_held_back_text_is_only_a_possible_stop_prefix() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("x") == ("STx", False)
    assert matcher.feed("S") == ("", False)
    assert matcher.flush() == "S"


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_randomised(include: bool) -> None:
    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(2)]
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        got = _run(StopStringMatcher(stops, include), deltas)
        assert got == _reference(text, stops, include), (text, stops, deltas)


def test_with_the_stop_string_included_nothing_is_held_back() -> None:
    """vLLM's include_stop_str_in_output: the text goes out as it comes, and the stop
    string, begun in text already out, ends it."""
    matcher = StopStringMatcher(["STOP", "</a>"], include=True)
    assert matcher.feed("abc ST") == ("abc ST", False)
    assert matcher.feed("x </") == ("x </", False)
    assert matcher.feed("a> more") == ("a>", True)
    assert matcher.stop_reason == "</a>" and matcher.flush() == ""
    for deltas in _splits("Hello world STOP more text"):
        assert _run(StopStringMatcher(["STOP"], True), deltas) == ("Hello world STOP", True)
