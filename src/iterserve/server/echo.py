"""`echo` on /v1/completions: the prompt's text (and, with `logprobs`, its tokens'
logprobs) before the completion's, in OpenAI's completions logprobs shape. The first
prompt token has no logprob: its entry is null, as OpenAI and vLLM send it.

With `max_tokens: 0` (vLLM's echo-only mode, what evaluation harnesses send to score a
text) the engine still samples one token, which is left out here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from iterserve.engine.outputs import RequestOutput
from iterserve.server.logprobs import completion_logprobs
from iterserve.server.protocol import CompletionLogprobs


@dataclass(frozen=True)
class Echo:
    # The prompt as sent; None for token ids, decoded once the engine has checked them.
    prompt: str | None
    decode_ids: Callable[[list[int]], str]
    only: bool  # max_tokens 0: the prompt alone, no completion
    top_n: int | None = None  # the request's `logprobs`: each prompt token's top so many

    def prompt_text(self, output: RequestOutput) -> str:
        return self.prompt if self.prompt is not None else self.decode_ids(output.prompt_token_ids)

    def text(self, output: RequestOutput, completion: str) -> str:
        return self.prompt_text(output) + ("" if self.only else completion)

    def logprobs(
        self,
        output: RequestOutput,
        completion: CompletionLogprobs | None,
        decode: Callable[[int], str],
    ) -> CompletionLogprobs | None:
        """The prompt's logprobs, then the completion's (text offsets shifted past the
        prompt's text); None when the request did not ask for logprobs."""
        if completion is None:
            return None
        scored = output.prompt_logprobs or []
        first = decode(output.prompt_token_ids[0])
        result = CompletionLogprobs(
            text_offset=[0], token_logprobs=[None], tokens=[first], top_logprobs=[None]
        )
        # The engine scored the prompt for the larger of logprobs and prompt_logprobs.
        rest = completion_logprobs(scored[1:], decode, len(first), self.top_n)
        _extend(result, rest)
        if not self.only:
            shift = len(self.prompt_text(output))
            completion.text_offset = [offset + shift for offset in completion.text_offset]
            _extend(result, completion)
        return result

    def delta(
        self,
        output: RequestOutput,
        text: str,
        logprobs: CompletionLogprobs | None,
        first: bool,
        decode: Callable[[int], str],
    ) -> tuple[str, CompletionLogprobs | None]:
        """A stream chunk's text and logprobs: the prompt's go out with the first chunk
        (whose completion offsets are relative to the completion: shifted here)."""
        if first:
            return self.text(output, text), self.logprobs(output, logprobs, decode)
        if self.only:
            return "", None if logprobs is None else CompletionLogprobs()
        return text, logprobs


def _extend(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.text_offset += more.text_offset
    into.token_logprobs += more.token_logprobs
    into.tokens += more.tokens
    into.top_logprobs += more.top_logprobs
