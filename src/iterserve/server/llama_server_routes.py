"""llama-server's own API: POST /completion (also /completions) and /infill, answered in
its shapes (llama_server_protocol.py says what each field does here), POST /apply-template
and GET /props, so that clients written for llama.cpp run against iterserve unchanged; the
editor plugins llama.vscode and llama.vim ask /infill for what goes at the cursor.
(llama-server's shape of /tokenize, `content`, is taken by tokenize.py.)

An answer carries llama-server's fields: `content`, `stop_type` (`eos`, `limit`, `word`)
and `stopping_word`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached` (the prompt's
tokens found in the prefix cache), `timings` (prompt and generation time and speed, as this
server measured them), `completion_probabilities` with `n_probs`, `tokens` with
`return_tokens`; `response_fields` keeps the fields named (`a/b` lifts `b` out of `a`).
Streamed (`stream: true`), each token's text comes as `data: {"content": ..., "stop":
false}` and the last event carries `stop: true` and the rest; no `[DONE]`, as llama-server.
Several prompts in one request, or `n_cmpl` completions of each, are answered as an array
(prompt i's completion j at index i * n_cmpl + j; each event says its `index`).

Two stop conditions are the editor's, checked here as the text grows: `n_indent` (stop
before the first later line indented less than the cursor's, the line cut after its
indentation) and `t_max_predict_ms` (stop once that long has passed since the first token
and a line has ended). The request stops there and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from iterserve.core.logprobs import TokenLogprobs
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import Prompt, render_chat
from iterserve.engine.request_stream import EngineStoppedError
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.llama_server_protocol import (
    DEFAULT_SAMPLERS,
    ApplyTemplateRequest,
    InfillRequest,
    LlamaCompletionRequest,
)
from iterserve.server.serving import (
    INFILL_ANSWER_ROOM,
    EngineStreamResponse,
    ServingContext,
    Submitted,
    sse,
    sse_error,
    submit,
    until_disconnected,
)

# The default settings /props reports.
_PROPS_SETTINGS = frozenset({"n_predict", "temperature", "top_k", "top_p", "min_p", "seed",
                             "repeat_penalty", "repeat_last_n", "n_probs"})  # fmt: skip


def llama_server_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/completion")
    @router.post("/completions")
    async def completion(body: LlamaCompletionRequest, raw: Request) -> Response:
        # A text goes to the engine as it is (its loop tokenizes it); a mixed one, and an
        # infill's layout, are tokenized here off the event loop.
        parts = body.prompt_parts()
        prompts = [p if isinstance(p, str) else mixed_prompt_ids(ctx, p) for p in parts]
        return await _answer(body, raw, ctx, prompts, ctx.eos_token_ids)

    @router.post("/infill")
    async def infill(body: InfillRequest, raw: Request) -> Response:
        prompt = await asyncio.to_thread(infill_prompt_ids, ctx, body)
        return await _answer(body, raw, ctx, [prompt], ctx.infill_end_ids)

    @router.post("/apply-template")
    def apply_template(body: ApplyTemplateRequest) -> dict[str, str]:
        messages = [m.as_template_input(i) for i, m in enumerate(body.messages)]
        kwargs = ctx.template_kwargs(body.chat_template_kwargs, None)
        return {
            "prompt": render_chat(ctx.tokenizer, ctx.chat_template, messages, True, kwargs).text
        }

    @router.get("/props")
    def props() -> dict[str, Any]:
        defaults = LlamaCompletionRequest()
        return {
            "default_generation_settings": {
                "n_ctx": ctx.max_model_len,
                "params": {
                    **defaults.model_dump(include=_PROPS_SETTINGS),
                    "samplers": list(DEFAULT_SAMPLERS),
                },
            },
            "model_alias": ctx.served_model_names[0],
            "model_path": ctx.served_model_names[0],
            "chat_template": ctx.template_text,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"iterserve {importlib.metadata.version('iterserve')}",
        }

    return router


def mixed_prompt_ids(ctx: ServingContext, prompt: list[int | str]) -> list[int]:
    """A mixed prompt's token ids: each text encoded alone, BOS (where the tokenizer adds
    one) only before a leading text."""
    tokenizer = ctx.tokenizer
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids += tokenizer.encode(part, add_special_tokens=i == 0)
        elif not 0 <= part < len(tokenizer):
            raise InvalidRequestError(
                f"prompt: token ids are in [0, {len(tokenizer)}), got {part}", "prompt"
            )
        else:
            ids.append(part)
    if not ids:
        raise InvalidRequestError("prompt: empty", "prompt")
    return ids


def infill_prompt_ids(ctx: ServingContext, body: InfillRequest) -> list[int]:
    """/infill's prompt in the model's fill-in-the-middle tokens, within the context."""
    room = body.n_predict if body.n_predict > 0 else INFILL_ANSWER_ROOM
    room = 1 if body.n_predict == 0 else room
    return ctx.infill_ids(
        body.input_prefix, body.input_suffix, body.input_extra, body.prompt, room, "input_prefix"
    )


def logit_bias_ids(ctx: ServingContext, body: LlamaCompletionRequest) -> dict[int, float] | None:
    """logit_bias by token id: a text's bias goes to each of its tokens, `false` bans."""
    bias: dict[int, float] = {}
    for key, value in body.bias_entries():
        ids = ctx.tokenizer.encode(key, add_special_tokens=False) if isinstance(key, str) else [key]
        for token_id in ids:
            if not 0 <= token_id < len(ctx.tokenizer):
                raise InvalidRequestError(
                    f"logit_bias: token ids are in [0, {len(ctx.tokenizer)}), got {token_id}",
                    "logit_bias",
                )
            bias[token_id] = -100.0 if value is False else float(value)
    return bias or None


def indent_cut(text: str, n_indent: int, start: int = 0) -> int | None:
    """Where llama-server's `n_indent` ends an answer: at the first line after the first
    (from the newline at or after `start`) whose text begins indented by fewer than
    `n_indent` spaces or tabs, just after that indentation; None while every line that has
    text is indented enough (a line of whitespace alone may still grow)."""
    newline = text.find("\n", start)
    while newline != -1:
        line_start = newline + 1
        end = text.find("\n", line_start)
        line = text[line_start : len(text) if end == -1 else end]
        body = line.lstrip(" \t")
        indent = len(line) - len(body)
        if body and indent < n_indent:
            return line_start + indent
        newline = end
    return None


@dataclass
class Answer:
    """One prompt's answer as it grows, and what llama-server reports of it."""

    index: int
    submitted_at: float
    silent: bool  # n_predict 0: the prompt alone; the token drawn is not reported
    prompt_ids: list[int] = field(default_factory=list)  # as the engine tokenized it
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    probs: list[TokenLogprobs | None] = field(default_factory=list)
    cached: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    stop_type: str = "none"
    stopping_word: str = ""
    cut: bool = False  # stopped here by n_indent or t_max_predict_ms: abort its request

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def take(self, output: RequestOutput, body: LlamaCompletionRequest, now: float) -> str:
        """Add a step's output; the text to send for it (after any cut)."""
        self.prompt_ids, self.cached = output.prompt_token_ids, output.num_cached_tokens
        if output.delta_token_ids and self.first_token_at is None:
            self.first_token_at = now
        before = len(self.text)
        if not self.silent:
            self.tokens += output.delta_token_ids
            self.probs += output.delta_logprobs
            self.text += output.delta_text
            self._client_stops(body, before, now)
        if output.finished and not self.done:
            if output.finish_reason == "abort":
                raise EngineStoppedError("the server shut down before the request finished")
            self.finished_at = now
            if output.finish_reason == "length":
                self.stop_type = "limit"
            elif isinstance(output.stop_reason, str):
                self.stop_type, self.stopping_word = "word", output.stop_reason
            else:
                self.stop_type = "eos"
        return self.text[before:]

    def _client_stops(self, body: LlamaCompletionRequest, before: int, now: float) -> None:
        if not (body.n_indent or body.t_max_predict_ms):
            return
        # The newline before the first line the new text may have completed or begun.
        scan_from = max(0, self.text.rfind("\n", 0, before))
        cut = indent_cut(self.text, body.n_indent, scan_from) if body.n_indent else None
        if cut is not None:
            self.text = self.text[: max(cut, before)]
        elapsed_ms = (now - (self.first_token_at or now)) * 1000
        timed_out = 0 < body.t_max_predict_ms < elapsed_ms and "\n" in self.text
        if cut is not None or timed_out:
            self.stop_type, self.cut, self.finished_at = "limit", True, now

    def timings(self) -> dict[str, float | int]:
        first = self.first_token_at or self.finished_at or self.submitted_at
        prompt_ms = (first - self.submitted_at) * 1000
        predicted_ms = ((self.finished_at or first) - first) * 1000
        prompt_n, predicted_n = len(self.prompt_ids) - self.cached, len(self.tokens)
        return {
            "cache_n": self.cached,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(1, prompt_n),
            "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(1, predicted_n),
            "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
        }


def _probabilities(
    entries: list[TokenLogprobs | None], ctx: ServingContext
) -> list[dict[str, Any]]:
    """llama-server's completion_probabilities: each token with its top candidates."""

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        raw = ctx.token_bytes(token_id)
        return {"id": token_id, "token": ctx.decode_token(token_id), "bytes": list(raw),
                "logprob": logprob}  # fmt: skip

    return [
        {**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]}
        for e in entries
        if e is not None
    ]


def _final(answer: Answer, body: LlamaCompletionRequest, ctx: ServingContext) -> dict[str, Any]:
    result: dict[str, Any] = {
        "index": answer.index,
        "content": answer.text,
        "tokens": answer.tokens if body.return_tokens else [],
        "id_slot": -1,
        "stop": True,
        "model": ctx.served_model_names[0],
        "tokens_predicted": len(answer.tokens),
        "tokens_evaluated": len(answer.prompt_ids),
        "generation_settings": {
            "n_ctx": ctx.max_model_len,
            **body.model_dump(
                include={
                    "n_predict",
                    "seed",
                    "temperature",
                    "top_k",
                    "top_p",
                    "min_p",
                    "stop",
                    "n_probs",
                    "ignore_eos",
                    "repeat_penalty",
                    "repeat_last_n",
                    "presence_penalty",
                    "frequency_penalty",
                    "n_indent",
                    "t_max_predict_ms",
                    "grammar",
                    "stream",
                }  # fmt: skip
            ),
        },
        "prompt": ctx.tokenizer.decode(answer.prompt_ids),
        "has_new_line": "\n" in answer.text,
        "truncated": False,
        "stop_type": answer.stop_type,
        "stopping_word": answer.stopping_word,
        "tokens_cached": answer.cached,
        "timings": answer.timings(),
    }
    if body.n_probs:
        result["completion_probabilities"] = _probabilities(answer.probs, ctx)
    return result


def kept_fields(result: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`response_fields`: only the fields named, `a/b` lifted out of `a` under its path;
    a name that is not there is left out."""
    kept: dict[str, Any] = {}
    for name in names:
        value: Any = result
        for key in name.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            kept[name] = value
    return kept


async def _answer(
    body: LlamaCompletionRequest,
    raw: Request,
    ctx: ServingContext,
    prompts: list[Prompt],
    ends: tuple[int, ...],
) -> Response:
    """`ends`: the tokens that end an answer (the model's EOS first)."""
    body.check_supported()
    params = body.sampling_params(logit_bias_ids(ctx, body), ends)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    submitted = await submit(
        raw, ctx, request_id, [(f"{request_id}-{i}", ids) for i, ids in enumerate(prompts)],
        params, "interactive", 0, fill_context=body.n_predict < 0,
    )  # fmt: skip
    now = time.monotonic()
    # Answer i is completion i % n_cmpl of prompt i // n_cmpl, as the engine numbers them.
    answers = [Answer(i, now, body.n_predict == 0) for i in range(len(prompts) * body.n_cmpl)]
    if body.stream:
        response = EngineStreamResponse(_events(submitted, answers, body, ctx), submitted.stream)
        response.headers.update(submitted.headers)
        return response

    async def run() -> None:
        async for _ in _progress(submitted, answers, body):
            pass

    await until_disconnected(raw, run())
    results = [_final(answer, body, ctx) for answer in answers]
    if body.response_fields is not None:
        results = [kept_fields(result, body.response_fields) for result in results]
    return JSONResponse(results[0] if len(results) == 1 else results, headers=submitted.headers)


async def _progress(
    submitted: Submitted, answers: list[Answer], body: LlamaCompletionRequest
) -> AsyncIterator[tuple[Answer, str, list[int], list[TokenLogprobs | None]]]:
    """Each step's news of an answer: (answer, its new text, tokens, probabilities)."""
    async with submitted.stream as stream:
        async for index, output in stream:
            submitted.record.saw(output)
            answer = answers[index]
            if answer.done:  # stopped here already: what its request still delivered
                continue
            text = answer.take(output, body, time.monotonic())
            if answer.cut:
                stream.abort_request(index)
            tokens = [] if answer.silent else output.delta_token_ids
            probs = [] if answer.silent else output.delta_logprobs
            yield answer, text, tokens, probs
    # Each prompt once, however many completions it has (the access log's count).
    submitted.record.prompt_tokens = sum(len(a.prompt_ids) for a in answers[:: body.n_cmpl])


async def _events(
    submitted: Submitted, answers: list[Answer], body: LlamaCompletionRequest,
    ctx: ServingContext,
) -> AsyncIterator[str]:  # fmt: skip
    try:
        async for answer, text, tokens, probs in _progress(submitted, answers, body):
            if text or tokens:
                event: dict[str, Any] = {
                    "index": answer.index, "content": text, "tokens": tokens, "stop": False,
                    "id_slot": -1, "tokens_predicted": len(answer.tokens),
                    "tokens_evaluated": len(answer.prompt_ids),
                }  # fmt: skip
                if body.n_probs:
                    event["completion_probabilities"] = _probabilities(probs, ctx)
                yield sse_json(event)
            if answer.done:
                yield sse_json({**_final(answer, body, ctx), "content": "", "tokens": []})
    except Exception as error:  # the 200 is out: say it in the stream
        yield sse_error(error)


def sse_json(payload: dict[str, Any]) -> str:
    return sse(json.dumps(payload))
