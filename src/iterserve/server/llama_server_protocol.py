"""llama-server's own completion API (POST /completion and /infill), the requests its
clients send: editor plugins (llama.vscode, llama.vim) asking for fill-in-the-middle, and
front ends written for llama.cpp. Not OpenAI's shapes: llama.cpp's names and defaults
(`n_predict`, temperature 0.8, top_k 40, top_p 0.95, min_p 0.05).

Every field llama-server documents is accepted. Those that would change the answer and that
iterserve does not implement are a 400 naming the field unless sent at their neutral value
(mirostat, DRY, XTC, typical-p, top-n-sigma, dynamic temperature, post-sampling
probabilities, per-request LoRA scales). `samplers` is llama.cpp's chain: only the samplers
it names run (the penalties, top-k, top-p, min-p, the temperature), and top-p and min-p
judge the distribution before the temperature unless it comes first; its default is
llama.cpp's (temperature last); the `infill` sampler is llama.cpp's (sample/infill_filter.py).
The penalties count llama.cpp's window (`repeat_last_n`, the last N tokens of prompt and
answer together; -1 all of them, 0 none). Accepted and not applied: `cache_prompt` (prefix
caching is always on), `id_slot`, `n_keep`, `t_max_prompt_ms`, `timings_per_token`,
`return_progress`, `min_keep`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from iterserve.chat.messages import ChatMessage
from iterserve.engine.fill_in_middle import ExtraFile
from iterserve.engine.request_stream import ALL_THE_CONTEXT
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.structured_output import StructuredOutput

# A part of a prompt: text, or token ids and text mixed (llama-server's "mixed" prompts).
MixedPrompt = str | list[int | str]
# Fields that change the answer and are not implemented, at their neutral values.
_UNHONOURED_NEUTRAL: dict[str, Any] = {
    "mirostat": 0,
    "top_n_sigma": -1.0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "typical_p": 1.0,
    "dynatemp_range": 0.0,
    "post_sampling_probs": False,
}


# llama.cpp's sampler chain (`samplers`): names with their aliases, or one letter each. Only
# the samplers named run, in that order; the default chain is llama.cpp's.
_SAMPLER_ALIASES = {
    "top_k": ("top-k", "topk"), "top_p": ("top-p", "topp", "nucleus"), "min_p": ("min-p", "minp"),
    "temperature": ("temp",), "penalties": (), "dry": (), "typ_p": ("typ-p", "typp", "typ"),
    "top_n_sigma": ("top-n-sigma", "topnsigma"), "xtc": (), "infill": (),
    "adaptive_p": ("adaptive-p", "adaptivep"),
}  # fmt: skip
_SAMPLER_NAMES = {alias: name for name, more in _SAMPLER_ALIASES.items() for alias in (name, *more)}
_SAMPLER_LETTERS = {
    "k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature", "e": "penalties", "d": "dry",
    "y": "typ_p", "s": "top_n_sigma", "x": "xtc", "i": "infill", "a": "adaptive_p",
}  # fmt: skip
DEFAULT_SAMPLERS = (
    "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"
)  # fmt: skip


def sampler_chain(samplers: list[str] | str | None) -> list[str]:
    """`samplers` as llama.cpp reads it: names (any case, or an alias) or a string of one
    letter a sampler; what it does not know is left out, as llama.cpp leaves it out."""
    if samplers is None:
        return list(DEFAULT_SAMPLERS)
    if isinstance(samplers, str):
        found = [_SAMPLER_LETTERS.get(letter) for letter in samplers]
    else:
        found = [_SAMPLER_NAMES.get(name.lower()) for name in samplers]
    return [name for name in found if name is not None]


class LlamaCompletionRequest(BaseModel):
    """POST /completion's body; what is not named here is accepted and left alone."""

    model_config = ConfigDict(extra="allow")

    prompt: MixedPrompt | list[MixedPrompt] = ""
    n_predict: int = Field(-1, ge=-1)
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    stop: list[str] = Field(default_factory=list)
    seed: int = -1
    ignore_eos: bool = False
    repeat_penalty: float = 1.0
    repeat_last_n: int = Field(64, ge=-1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[list[Any]] | dict[str, float | bool] | None = None
    n_probs: int = Field(0, ge=0, le=20)
    n_cmpl: int = Field(1, ge=1, le=128)  # completions of each prompt
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: int = Field(0, ge=0)
    stream: bool = False
    return_tokens: bool = False
    response_fields: list[str] | None = None
    lora: list[dict[str, Any]] | None = None
    samplers: list[str] | str | None = None

    def check_supported(self) -> None:
        """A 400 naming the first field that would change the answer and is not honoured."""
        extra = self.model_extra or {}
        for name, neutral in _UNHONOURED_NEUTRAL.items():
            if name in extra and extra[name] != neutral:
                raise InvalidRequestError(
                    f"{name}: not implemented here; send {neutral!r} or leave it out", name
                )
        if extra.get("xtc_threshold") is not None and extra.get("xtc_probability", 0) != 0:
            raise InvalidRequestError("xtc_threshold: XTC is not implemented here", "xtc_threshold")
        if self.lora:
            raise InvalidRequestError(
                "lora: per-request adapter scales are not implemented here; serve the adapter "
                "with --lora-modules and ask for it on /v1/completions by its name",
                "lora",
            )
        if extra.get("multimodal_data"):
            raise InvalidRequestError("multimodal_data: this server serves text", "multimodal_data")
        if self.grammar is not None and self.json_schema is not None:
            raise InvalidRequestError("grammar and json_schema: send one of them", "grammar")
        if "adaptive_p" in sampler_chain(self.samplers):
            raise InvalidRequestError("samplers: adaptive_p is not implemented here", "samplers")
        self._temperature_last()

    def sampling_params(
        self, logit_bias: dict[int, float] | None, ends: tuple[int, ...] = ()
    ) -> SamplingParams:
        """llama.cpp's settings in SamplingParams' terms: temperature <= 0 is greedy, top-k
        <= 0 none, n_predict -1 all the context allows and 0 the prompt alone (one token is
        still drawn, and not reported), seed -1 a fresh one. Only the samplers `samplers`
        names run (a sampler left out: its setting neutral, the temperature 1), top-k, top-p
        and min-p in llama.cpp's order, before the temperature unless it comes first, then
        the infill sampler if named. `ends`: the tokens that end the answer (the model's
        EOS first; an infill's also the markers of another file), which `ignore_eos` bans,
        as llama-server does, rather than only not stopping at them."""
        chain = sampler_chain(self.samplers)
        penalised = self.repeat_last_n != 0 and "penalties" in chain  # 0: "no penalties"
        return SamplingParams(
            n=self.n_cmpl,
            max_tokens=ALL_THE_CONTEXT if self.n_predict < 0 else max(1, self.n_predict),
            temperature=max(0.0, self.temperature) if "temperature" in chain else 1.0,
            top_k=max(0, self.top_k) if "top_k" in chain else 0,
            top_p=self.top_p if "top_p" in chain else 1.0,
            min_p=self.min_p if "min_p" in chain else 0.0,
            temperature_last=self._temperature_last(),
            infill_eog=ends if "infill" in chain else (),
            stop_token_ids=[] if self.ignore_eos else list(ends),
            seed=None if self.seed < 0 else self.seed,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repeat_penalty if penalised else 1.0,
            presence_penalty=self.presence_penalty if penalised else 0.0,
            frequency_penalty=self.frequency_penalty if penalised else 0.0,
            # -1: the whole context, llama.cpp's rule (the prompt counted by all three).
            penalty_last_n=ALL_THE_CONTEXT
            if self.repeat_last_n < 0
            else max(1, self.repeat_last_n),
            logit_bias={**(logit_bias or {}), **dict.fromkeys(ends, -100.0)}
            if self.ignore_eos and ends
            else logit_bias,
            logprobs=self.n_probs or None,
            structured_output=self._constraint(),
        )

    def _temperature_last(self) -> bool:
        """Whether top-p and min-p run before the temperature (llama.cpp's default) or
        after it (vLLM's order); between them is an order not implemented here."""
        chain = sampler_chain(self.samplers)
        judged = [chain.index(name) for name in ("top_p", "min_p") if name in chain]
        if "temperature" not in chain or not judged:
            return True  # no order to keep
        at = chain.index("temperature")
        if min(judged) < at < max(judged):
            raise InvalidRequestError(
                "samplers: the temperature between top_p and min_p is not implemented here; "
                "put it before both or after both",
                "samplers",
            )
        return at > max(judged)

    def _constraint(self) -> StructuredOutput | None:
        if self.grammar is not None:
            return StructuredOutput(grammar=self.grammar, param="grammar")
        if self.json_schema is not None:
            return StructuredOutput.from_json_schema(self.json_schema)
        return None

    def bias_entries(self) -> list[tuple[int | str, float | bool]]:
        """logit_bias as (token id or text, bias or false) pairs, from either of its forms:
        [[15043, 1.0], ["Hello", false]] or OpenAI's {"15043": 1.0}."""
        if self.logit_bias is None:
            return []
        if isinstance(self.logit_bias, dict):
            return [
                (int(key) if key.lstrip("-").isdigit() else key, bias)
                for key, bias in self.logit_bias.items()
            ]
        entries: list[tuple[int | str, float | bool]] = []
        for entry in self.logit_bias:
            if (
                len(entry) != 2
                or not isinstance(entry[0], int | str)
                or not isinstance(entry[1], int | float | bool)
            ):
                raise InvalidRequestError(
                    "logit_bias: each entry is [token id or text, bias or false]", "logit_bias"
                )
            entries.append((entry[0], entry[1]))
        return entries

    def prompt_parts(self) -> list[MixedPrompt]:
        """The prompts: a text, token ids and texts mixed, or a list of those (several
        prompts, answered as an array). A list holding a number is one mixed prompt."""
        prompt = self.prompt
        parts: list[MixedPrompt]
        if isinstance(prompt, str) or any(isinstance(part, int) for part in prompt):
            parts = [prompt]  # type: ignore[list-item]
        else:
            parts = list(prompt)  # type: ignore[arg-type]
        if not parts or any(not part for part in parts):
            raise InvalidRequestError("prompt: empty", "prompt")
        return parts


class InfillRequest(LlamaCompletionRequest):
    """POST /infill's body: the text before and after the cursor, other files as context,
    and `prompt`, the cursor's line up to the cursor (put after the prefix, as llama-server
    does)."""

    input_prefix: str
    input_suffix: str
    input_extra: list[ExtraFile] = Field(default_factory=list)
    prompt: str = ""  # type: ignore[assignment]


class ApplyTemplateRequest(BaseModel):
    """POST /apply-template: a conversation rendered by the chat template, not run."""

    messages: list[ChatMessage]
    chat_template_kwargs: dict[str, Any] | None = None
