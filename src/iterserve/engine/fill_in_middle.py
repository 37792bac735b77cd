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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iterserve.sampling_params import InvalidRequestError


@dataclass(frozen=True)
class FimFormat:
    """A code model's fill-in-the-middle tokens, prefix-suffix-middle order."""

    prefix: str
    suffix: str
    middle: str

    def prompt(self, before: str, after: str) -> str:
        """The prompt whose continuation is what goes between `before` and `after`."""
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


KNOWN_FORMATS = (
    FimFormat("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5/3-Coder
    FimFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, Granite Code
    FimFormat("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    FimFormat("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    FimFormat("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"),  # GLM-4.5
)


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The format whose three markers are each one token of `tokenizer`'s, or None."""
    vocabulary = tokenizer.get_vocab()
    for known in KNOWN_FORMATS:
        if all(marker in vocabulary for marker in (known.prefix, known.suffix, known.middle)):
            return known
    return None


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
