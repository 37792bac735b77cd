"""Offline use: `LLM(model).generate(prompts, sampling_params)` and `LLM(model).chat(...)`,
with vLLM's names and shapes (`outputs[0].outputs[0].text`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from iterserve.config import EngineConfig, engine_config
from iterserve.core.lora import LoRARequest
from iterserve.engine.chat_template import resolve_chat_template
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import Prompt, RenderedChat, as_prompt, prompt_text, render_chat
from iterserve.engine.score_prompts import score_pairs
from iterserve.pooling_params import PoolingParams
from iterserve.sampling_params import InvalidRequestError, SamplingParams

Message = dict[str, str]
# A prompt as LLM's methods take it: text, token ids, a rendered chat, or vLLM's prompt dicts
# ({"prompt": text}, {"prompt_token_ids": ids}).
PromptInput = Prompt | Mapping[str, Any]


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **kwargs: Any):
        if config is None:
            try:
                config = engine_config({"model": model, **kwargs})
            except TypeError as error:
                raise TypeError(f"LLM() got an {error}") from None
        elif model is not None or kwargs:
            raise TypeError("give either config= or settings, not both")
        self.engine = LLMEngine(config)

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); also on leaving a
        `with LLM(...) as llm:` block, and at exit for an LLM never closed."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """vLLM's spelling of `tokenizer`."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams samples with: the model's own settings
        (--generation-config auto: its generation_config.json or a GGUF's
        general.sampling.* keys), the rest SamplingParams' defaults; as vLLM's."""
        return SamplingParams(**self.engine.sampling_defaults.given())

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion: one output per prompt, in prompt order, as vLLM's
        `LLM.generate` (`output.prompt`, `output.outputs[i].text` for choice i of n; the
        first choice's fields also stand on the output itself: `output.text`). A prompt is
        text, token ids, or vLLM's `{"prompt": ...}` / `{"prompt_token_ids": ...}` /
        `{"prompt_embeds": tensor}` (with enable_prompt_embeds).
        `lora_request`: the LoRA adapter every prompt runs, or one per prompt (None: the
        base model), as in vLLM."""
        prompt_list = [as_prompt(p) for p in _prompt_list(prompts)]
        params_list = _per_prompt(
            sampling_params, len(prompt_list), self.get_default_sampling_params()
        )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise InvalidRequestError("give one LoRARequest, or one per prompt")

        groups: list[list[str]] = []
        try:
            for prompt, p, lora in zip(prompt_list, params_list, loras, strict=True):
                groups.append([])
                for child in p.per_choice():
                    groups[-1].append(self.engine.add_request(prompt, child, lora_request=lora))
        except Exception:
            for request_id in (i for group in groups for i in group):
                # all or nothing: no half-queued batch left behind
                self.engine.abort_request(request_id)
            raise
        done = self._run([i for group in groups for i in group], use_tqdm)
        outputs = []
        for prompt, group in zip(prompt_list, groups, strict=True):
            choices = [done[request_id] for request_id in group]
            text = prompt_text(prompt)
            for choice in choices:
                choice.prompt = text
            first = choices[0]
            if len(choices) > 1:
                first.choices = choices
            outputs.append(first)
        return outputs

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """One embedding per prompt (a text or a list of token ids), in order: each output's
        `.embedding` (a list of floats; vLLM's `.outputs.embedding` too) and
        `.prompt_token_ids`. `pooling_params`: say `dimensions` (a matryoshka model), or
        override the model's pooling or normalizing. `lora_request`: the states computed with
        that adapter."""
        ids: list[str] = []
        try:
            for prompt in (as_prompt(p) for p in _prompt_list(prompts)):
                ids.append(
                    self.engine.add_request(
                        prompt,
                        pooling=pooling_params or PoolingParams(),
                        lora_request=lora_request,
                    )
                )
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._in_order(ids, use_tqdm)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """A reranker's relevance of each (text_1, text_2) pair, as vLLM's `LLM.score`: one
        text_1 against every text_2, or the two lists item by item. Each output's `.score`
        is in (0, 1) (the sigmoid of the model's score head: docs/reranking.md).
        `lora_request`: the pairs' states computed with that adapter (the head is the
        base's)."""
        engine = self.engine
        pairs = score_pairs(
            text_1 if isinstance(text_1, str) else list(text_1),
            text_2 if isinstance(text_2, str) else list(text_2),
        )
        ids: list[str] = []
        try:
            for query, document in pairs:
                prompt = engine.pair_prompts(query, document)
                score = PoolingParams(task="score")
                ids.append(engine.add_request(prompt, pooling=score, lora_request=lora_request))
        except Exception:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return self._in_order(ids, use_tqdm)

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """A classifier's labels' probabilities for each input (a text or token ids), as
        vLLM's `LLM.classify`: each output's `.probs`, in the order of
        `self.engine.pooling.labels`."""
        return self.embed(prompts, PoolingParams(task="classify"), use_tqdm, lora_request)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        tool_parser: str = "auto",
        reasoning_parser: str = "auto",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        thinking_token_budget: int | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Chat completions for one conversation or several. With `tools` (OpenAI's
        function definitions) and `tool_choice`, as the server takes them: the tools go to
        the template, and each answer is read into `output.tool_calls` by `tool_parser`
        (as `--tool-call-parser`). A thinking model's thinking goes to
        `output.reasoning_content` and the rest of the answer to `output.content`, as
        `reasoning_parser` reads it (as `--reasoning-parser`). `chat_template_kwargs` go to
        the template (`{"enable_thinking": False}` turns Qwen3's thinking off);
        `thinking_token_budget` caps the thinking in tokens. `chat_template` (the text, or a
        file holding it) renders this call's conversations in place of the engine's, as
        vLLM's `LLM.chat` takes one; the parsers under "auto" follow it. Reading:
        chat/offline_chat.py."""
        from iterserve.chat.offline_chat import OfflineChat  # the server's parsers

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        template = resolve_chat_template(
            chat_template, self.engine.chat_template, self.tokenizer, "chat_template"
        )
        chat = OfflineChat(
            self.tokenizer,
            template,
            tools,
            tool_choice,
            parallel_tool_calls,
            tool_parser,
            reasoning_parser,
            chat_template_kwargs,
            thinking_token_budget,
        )
        each = _per_prompt(sampling_params, len(conversations), self.get_default_sampling_params())
        prepared = [chat.prepare(conv, p) for conv, p in zip(conversations, each, strict=True)]  # type: ignore[arg-type]
        outputs = self.generate(
            [prompt for prompt, _ in prepared], [p for _, p in prepared], use_tqdm
        )
        return chat.read(outputs)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        """The token ids `chat` would run for this conversation (the server's too)."""
        return self.engine.tokenize(self._render(messages))

    def _render(self, messages: Sequence[Message]) -> RenderedChat:
        return render_chat(self.tokenizer, self.engine.chat_template, messages)

    def _in_order(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done = self._run(ids, use_tqdm)
        return [done[request_id] for request_id in ids]

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Steps the engine until every request is done; their last outputs by id."""
        engine = self.engine
        done: dict[str, RequestOutput] = {}
        start_stats = (engine.stats.prefill_tokens, engine.stats.decode_tokens)
        start = time.perf_counter()
        bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm)
        try:
            while engine.has_unfinished():
                # Everything is added: static batching may start a short last batch.
                for output in engine.step(no_more_arrivals=True).outputs:
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(
                    f"prefill {(engine.stats.prefill_tokens - start_stats[0]) / elapsed:.0f} tok/s, "
                    f"decode {(engine.stats.decode_tokens - start_stats[1]) / elapsed:.0f} tok/s",
                    refresh=False,
                )
        finally:
            bar.close()
        return done


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (text, ids, a rendered chat, a prompt dict) or a list of them, as a list."""
    if isinstance(prompts, str | RenderedChat | Mapping):
        return [prompts]
    given = list(prompts)
    return [given] if given and isinstance(given[0], int) else given  # type: ignore[list-item]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None,
    count: int,
    default: SamplingParams,
) -> list[SamplingParams]:
    """One SamplingParams a prompt, `default` where none are given."""
    if params is None:
        params = default
    if isinstance(params, SamplingParams):
        return [params] * count
    params_list = list(params)
    if len(params_list) != count:
        raise InvalidRequestError("give one SamplingParams, or one per prompt")
    return params_list
