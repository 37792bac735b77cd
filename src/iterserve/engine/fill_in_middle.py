"""Fill in the middle: a code model writes what goes between a prefix and a suffix (an
editor's cursor), when asked in the format it was trained on. The completions API's
`suffix` asks for it: the prompt is the text before the cursor, `suffix` the text after.

Code models mark the two parts with tokens of their own vocabulary, in the prefix-suffix-
middle order their model cards give: Qwen2.5-Coder's and Qwen3-Coder's `<|fim_prefix|>`,
StarCoder's `<fim_prefix>` (StarCoder2, SantaCoder, Granite Code), DeepSeek-Coder's
`<｜fim▁begin｜>`, GLM-4.5's `<|code_prefix|>`. llama.cpp recognises the same tokens by
their text and its `/infill` puts them in the same order. (CodeLlama's, whose markers carry
SentencePiece's word boundary, is not here.) A model with none of them cannot be asked: a
`suffix` sent to it is refused rather than pasted into a prompt it would misread.

llama-server's `/infill` also takes other files' text (`input_extra`), put before the prefix:
for a model trained on whole repositories (Qwen2.5-Coder's `<|repo_name|>` and
`<|file_sep|>`, StarCoder2's `<reponame>` and `<file_sep>`) in that layout, each file its
name and text after a separator, else each text after a plain snippet line
(`infill_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from iterserve.sampling_params import InvalidRequestError


@dataclass(frozen=True)
class FimFormat:
    """A code model's fill-in-the-middle tokens, prefix-suffix-middle order."""

    prefix: str
    suffix: str
    middle: str
    # A repository's name, and each of its files', follow these (None: the model has no
    # such tokens, and other files' text goes before the prefix as plain snippets).
    repository: str | None = None
    file_separator: str | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(m for m in (self.prefix, self.suffix, self.middle, self.repository,
                                 self.file_separator) if m is not None)  # fmt: skip

    def prompt(self, before: str, after: str) -> str:
        """The prompt whose continuation is what goes between `before` and `after`."""
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


KNOWN_FORMATS = (
    # Qwen2.5/3-Coder
    FimFormat(
        "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"
    ),
    # StarCoder (StarCoder2: the repository's tokens too), Granite Code
    FimFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>", "<file_sep>"),
    FimFormat("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    FimFormat("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    FimFormat("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"),  # GLM-4.5
)


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The format whose three markers are each one token of `tokenizer`'s, or None; its
    repository markers kept only where the vocabulary has both."""
    vocabulary = tokenizer.get_vocab()
    for known in KNOWN_FORMATS:
        if all(marker in vocabulary for marker in (known.prefix, known.suffix, known.middle)):
            if known.repository in vocabulary and known.file_separator in vocabulary:
                return known
            return replace(known, repository=None, file_separator=None)
    return None


@dataclass(frozen=True)
class ExtraFile:
    """Another file's text, context for an infill (llama-server's `input_extra` chunk)."""

    text: str
    filename: str = "tmp"


# What precedes each extra text where the model has no file separator (llama-server's).
SNIPPET_LINE = "\n\n--- snippet ---\n\n"
# The repository's and the edited file's names in the repository-level layout: the client
# does not send them (llama-server's placeholders).
REPOSITORY_NAME = "myproject\n"
EDITED_FILE_NAME = "filename\n"


def infill_tokens(
    fim: FimFormat,
    encode: Callable[[str], list[int]],
    marker_id: Callable[[str], int],
    before: str,
    after: str,
    extra: Sequence[ExtraFile],
    prompt: str,
    budget: int,
    bos: Sequence[int] = (),
) -> list[int]:
    """llama-server's /infill prompt, at most `budget` tokens: `bos`, the other files
    (`[repository]myproject, [file separator]NAME\nTEXT..., [file separator]filename`, or
    each text after a snippet line), then `[prefix]before prompt[suffix]after[middle]`.
    `prompt` goes right after the prefix, tokenized apart, where llama-server's code puts
    it (its README says after the middle marker): editor plugins send the cursor's line up
    to the cursor there, and the lines above it as `before`.

    What does not fit is cut where it matters least: the other files from their start
    first, then the text far from the cursor, the prefix's start and the suffix's end, in
    the 3:1 ratio llama-server keeps between them. `encode` adds no special tokens."""
    context: list[int] = []
    if fim.repository is not None and fim.file_separator is not None:
        separator = marker_id(fim.file_separator)
        context += [marker_id(fim.repository), *encode(REPOSITORY_NAME)]
        for file in extra:
            context += [separator, *encode(file.filename + "\n"), *encode(file.text)]
        context += [separator, *encode(EDITED_FILE_NAME)]
    else:
        for file in extra:
            context += encode(SNIPPET_LINE) + encode(file.text)
    prefix, suffix, cursor_line = encode(before), encode(after), encode(prompt)
    room = max(0, budget - len(bos) - 3 - len(cursor_line))
    if len(prefix) + len(suffix) > room:
        suffix_room = max(room // 4, room - len(prefix))
        suffix = suffix[:suffix_room]
        prefix = prefix[len(prefix) - min(len(prefix), room - len(suffix)) :]
    room -= len(prefix) + len(suffix)
    context = context[len(context) - min(len(context), room) :]
    return [
        *bos, *context, marker_id(fim.prefix), *prefix, *cursor_line, marker_id(fim.suffix),
        *suffix, marker_id(fim.middle),
    ]  # fmt: skip


def fill_in_middle_prompts(
    prompts: list[str | list[int]], suffix: str, fim: FimFormat | None
) -> list[str | list[int]]:
    """Each prompt (the text before the cursor) as the model's fill-in-the-middle prompt with
    `suffix` after the cursor; InvalidRequestError naming `suffix` where that cannot be."""
    if fim is None:
        markers = ", ".join(known.prefix for known in KNOWN_FORMATS)
        raise InvalidRequestError(
            f"suffix: this model has no fill-in-the-middle tokens (none of {markers}), so it "
            "cannot be asked for what goes between a prompt and a suffix",
            "suffix",
        )
    if any(not isinstance(prompt, str) for prompt in prompts):
        raise InvalidRequestError("suffix needs the prompt as text, not token ids", "suffix")
    return [fim.prompt(prompt, suffix) for prompt in prompts]  # type: ignore[arg-type]
