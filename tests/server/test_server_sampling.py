"""The sampling controls, echo with prompt logprobs, vLLM's token-level fields
(prompt_logprobs, return_token_ids, return_tokens_as_token_ids, truncate_prompt_tokens) and
the tokenizer endpoints over HTTP, through the official openai client where it has the
call."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from server_fixtures import MODEL_NAME, RunningServer, running_server

pytestmark = pytest.mark.timeout(180)

# Longer than one step's budget below (16 tokens), so its prefill is chunked.
PROMPT = (
    "A prompt long enough to span several KV cache blocks and several chunks, so that "
    "its logprobs come from more than one step: the quick brown fox jumps over the dog."
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_llama_dir, max_num_batched_tokens=16, max_num_seqs=8) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_logit_bias_bans_the_greedy_token(client: openai.OpenAI) -> None:
    def tokens(**extra: object) -> list[str]:
        answer = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=0, **extra
        )
        return answer.choices[0].logprobs.tokens  # type: ignore[union-attr,return-value]

    free = tokens()
    token_id = client._client.post(  # the first token's id, through /tokenize
        str(client.base_url).removesuffix("/v1/") + "/tokenize",
        json={"prompt": free[0], "add_special_tokens": False},
    ).json()["tokens"][0]
    banned = tokens(logit_bias={str(token_id): -100}, presence_penalty=0.5, seed=3)
    assert free[0] not in banned and len(banned) == 8


def test_allowed_token_ids_are_the_only_ones_drawn(client: openai.OpenAI) -> None:
    """vLLM's allowed_token_ids: sampled (a seed, temperature 1) from those alone."""
    tokenize = str(client.base_url).removesuffix("/v1/") + "/tokenize"
    words = " red green blue"
    allowed = client._client.post(tokenize, json={"prompt": words, "add_special_tokens": False})
    ids = allowed.json()["tokens"]
    answer = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, logprobs=0,
        extra_body={"allowed_token_ids": ids, "ignore_eos": True},
    )  # fmt: skip
    drawn = answer.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert drawn is not None and len(drawn) == 12
    assert set("".join(drawn).split()) <= {"red", "green", "blue"}


def test_echo_scores_the_prompt_like_transformers(
    client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    """lm-eval-harness's loglikelihood request: echo, logprobs 1, max_tokens 0. Sent twice:
    the second finds the prompt's blocks cached, and must still score every token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    expected = torch.tensor([logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))])
    for _ in range(2):
        answer = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
        )
        choice = answer.choices[0]
        assert choice.text == PROMPT
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs and lp.top_logprobs and lp.text_offset
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.token_logprobs) == len(ids)
        got = torch.tensor(lp.token_logprobs[1:])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_a_completion_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model=MODEL_NAME, prompt="1 2 3", echo=True, logprobs=0, max_tokens=4, temperature=0.0
    )
    choice = whole.choices[0]
    assert choice.text.startswith("1 2 3") and len(choice.text) > len("1 2 3")
    assert choice.logprobs is not None and choice.logprobs.tokens
    assert "".join(choice.logprobs.tokens).endswith(choice.text[len("1 2 3") :])
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="1 2 3",
        echo=True,
        logprobs=0,
        max_tokens=4,
        temperature=0.0,
        stream=True,
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert "".join(c.text for c in chunks) == choice.text
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs or []]
    assert streamed == choice.logprobs.token_logprobs and streamed[0] is None
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset or []]
    assert offsets == choice.logprobs.text_offset
    tokens = choice.logprobs.tokens or []
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_tokenize_and_detokenize(server: RunningServer, tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    url = server.base_url
    answer = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).json()
    assert answer["tokens"] == tokenizer.encode(PROMPT)
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 512
    back = httpx.post(f"{url}/detokenize", json={"tokens": answer["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(answer["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert models[0]["max_model_len"] == 512


def test_tokenizer_info_serves_lm_eval_its_tokenizer(
    server: RunningServer, client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    """lm-evaluation-harness (0.4.10 on) reads GET /tokenizer_info and then tokenizes through
    /tokenize: its special tokens and template are the tokenizer's, and a loglikelihood
    request as it sends one (context and continuation tokenized apart, the ids echoed with
    max_tokens 1, the continuation's logprobs read at [context length:-1]) sums to
    transformers' log-probability of the continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    url = server.base_url
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    for key in ("bos_token", "eos_token", "chat_template"):
        assert info[key] == getattr(tokenizer, key), key
    assert info["model_max_length"] == 512
    assert not {"name_or_path", "tokenizer_file", "tokenizer_object"} & info.keys()

    def encode(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        return httpx.post(f"{url}/tokenize", json=body).json()["tokens"]

    context, continuation = encode(PROMPT), encode(" and then it sleeps")
    answer = client.completions.create(
        model=MODEL_NAME, prompt=[context + continuation], echo=True, logprobs=1,
        max_tokens=1, temperature=0,
    )  # fmt: skip
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    got = sum(logprobs.token_logprobs[len(context) : -1])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        table = torch.log_softmax(model(ids).logits[0], -1)
    expected = sum(table[i - 1, ids[0, i]].item() for i in range(len(context), ids.shape[1]))
    assert got == pytest.approx(expected, abs=1e-3)


def test_tokenizer_info_can_be_turned_off(tiny_llama_dir: Path) -> None:
    """--no-enable-tokenizer-info-endpoint: no route (a 404), as a vLLM server without its
    flag has none."""
    from transformers import AutoTokenizer

    from iterserve.server.serving import ServingContext
    from iterserve.server.tokenize import tokenizer_routes

    ctx = ServingContext(
        engine=None, served_model_names=[MODEL_NAME],  # type: ignore[arg-type]
        tokenizer=AutoTokenizer.from_pretrained(tiny_llama_dir), chat_template=None,
        max_model_len=512, response_store=None,  # type: ignore[arg-type]
    )  # fmt: skip

    def paths(info: bool) -> set[str]:
        return {getattr(route, "path", "") for route in tokenizer_routes(ctx, info).routes}

    assert "/tokenizer_info" in paths(True) and "/tokenizer_info" not in paths(False)
    assert {"/tokenize", "/detokenize"} <= paths(False)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"min_tokens": 100}, "min_tokens"),
        ({"allowed_token_ids": [1, 10**9]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        (
            {"allowed_token_ids": [1, 2], "response_format": {"type": "json_object"}},
            "allowed_token_ids",
        ),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 513}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_controls_are_400s_naming_the_field(
    server: RunningServer, fields: dict, param: str
) -> None:
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, **fields}
    answer = httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_unhonoured_fields_at_their_neutral_value_pass(server: RunningServer) -> None:
    body = {"prompt": "x", "max_tokens": 2, "spaces_between_special_tokens": True, "foo": 1}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body).status_code == 200


def _hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)


def test_prompt_logprobs_with_ranks_like_transformers(
    client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    """vLLM's prompt_logprobs: per prompt token (the first None), the token's logprob and
    rank and the top 2, keyed by token id; chunked over several steps here."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer.encode(PROMPT)
    expected = _hf_logprobs(tiny_llama_dir, ids)
    answer = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    positions = answer.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    assert len(positions) == len(ids) and positions[0] is None
    for i, position in enumerate(positions[1:], 1):
        row = expected[i - 1]
        token = position[str(ids[i])]
        assert abs(token["logprob"] - row[ids[i]].item()) < 1e-4
        assert token["decoded_token"] == tokenizer.decode([ids[i]])
        # Its rank among the model's: between the counts of tokens clearly above it and of
        # those not clearly below it (a near tie may go either way).
        above = (row > row[ids[i]] + 1e-4).sum().item() + 1
        not_below = (row > row[ids[i]] - 1e-4).sum().item() + 1
        assert above <= token["rank"] <= not_below
        top = sorted((e["rank"], e["logprob"]) for e in position.values() if e["rank"] <= 2)
        assert [rank for rank, _ in top] == [1, 2]
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in top]), row.topk(2).values, rtol=0, atol=1e-4
        )
        assert len(position) in (2, 3)  # the token, unless it is one of the top 2
    # Chat: once for the choices' prompt, at the top of the answer.
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        n=2,
        extra_body={"prompt_logprobs": 0},
    )
    scored = chat.prompt_logprobs  # type: ignore[attr-defined]
    assert scored[0] is None and all(len(position) == 1 for position in scored[1:])
    # Beside echo, each keeps its own count of top tokens.
    both = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
        extra_body={"prompt_logprobs": 3},
    ).choices[0]  # fmt: skip
    assert both.logprobs is not None and both.logprobs.top_logprobs
    assert all(len(top) <= 2 for top in both.logprobs.top_logprobs[1:] if top)
    assert all(
        len(position) >= 3
        for position in both.prompt_logprobs[1:]  # type: ignore[attr-defined]
    )
    # Left out of answers that did not ask, rather than a null in each.
    plain = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1).choices[0]
    assert "prompt_logprobs" not in plain.model_dump() and "token_ids" not in plain.model_dump()


def test_return_token_ids_whole_and_streamed(client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    """vLLM's return_token_ids, what RL rollouts train on: the prompt's ids and the answer's,
    the stream's in pieces that add up to the whole answer's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    fields = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body=fields
    ).choices[0]
    assert whole.prompt_token_ids == tokenizer.encode(PROMPT)  # type: ignore[attr-defined]
    assert len(whole.token_ids) == 8  # type: ignore[attr-defined]
    assert tokenizer.decode(whole.token_ids) == whole.text  # type: ignore[attr-defined]
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0, stream=True,
        extra_body=fields,
    )  # fmt: skip
    chunks = [chunk.choices[0].model_dump() for chunk in stream if chunk.choices]
    assert chunks[0]["prompt_token_ids"] == whole.prompt_token_ids  # type: ignore[attr-defined]
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    assert [t for chunk in chunks for t in chunk["token_ids"]] == whole.token_ids  # type: ignore[attr-defined]

    messages = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0.0, extra_body=fields
    )  # type: ignore[arg-type]
    assert chat.prompt_token_ids == prompt_ids  # type: ignore[attr-defined]
    answer_ids = chat.choices[0].token_ids  # type: ignore[attr-defined]
    assert len(answer_ids) == 6
    streamed = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0.0, stream=True,
            extra_body=fields,
        )  # type: ignore[arg-type]
    )  # fmt: skip
    assert streamed[0].choices[0].delta.role == "assistant"
    assert streamed[0].prompt_token_ids == prompt_ids  # type: ignore[attr-defined]
    assert all(getattr(chunk, "prompt_token_ids", None) is None for chunk in streamed[1:])
    # Every chunk with a choice carries its ids, the role's none.
    pieces = [c.choices[0].token_ids for c in streamed if c.choices]  # type: ignore[attr-defined]
    assert pieces[0] == []
    assert [t for piece in pieces for t in piece] == answer_ids
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content


def test_return_tokens_as_token_ids(client: openai.OpenAI) -> None:
    fields = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=2,
        extra_body=fields,
    ).choices[0]  # fmt: skip
    named = [f"token_id:{t}" for t in choice.token_ids]  # type: ignore[attr-defined]
    assert choice.logprobs is not None and choice.logprobs.tokens == named
    for top in choice.logprobs.top_logprobs or []:
        assert top and all(key.startswith("token_id:") for key in top)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0.0, logprobs=True, top_logprobs=1, extra_body=fields,
    ).choices[0]  # fmt: skip
    content = chat.logprobs.content if chat.logprobs else None
    assert content and [e.token for e in content] == [
        f"token_id:{t}"
        for t in chat.token_ids  # type: ignore[attr-defined]
    ]
    assert all(e.top_logprobs[0].token.startswith("token_id:") for e in content)


def test_chat_logprobs_bytes_are_each_tokens_own(client: openai.OpenAI) -> None:
    """A character the vocabulary spells in several tokens (龘: three of a byte each, forced
    by a regex): each token's `token` shows U+FFFD, and its `bytes` are its own, so the
    tokens' bytes joined are the answer's UTF-8, as OpenAI's field promises."""
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        temperature=0.0, logprobs=True, top_logprobs=2,
        extra_body={"structured_outputs": {"regex": "龘龘"}},
    ).choices[0]  # fmt: skip
    assert choice.message.content == "龘龘"
    content = choice.logprobs.content if choice.logprobs else None
    assert content and len(content) >= 6 and any("\ufffd" in e.token for e in content)
    joined = b"".join(bytes(e.bytes or []) for e in content)
    assert joined.startswith("龘龘".encode())  # then the end-of-turn token's, where listed
    for entry in content:
        assert all(top.bytes for top in entry.top_logprobs)


def test_truncate_prompt_tokens_keeps_the_end_or_the_start(
    client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    """The prompt cut to its last (or first) 10 tokens runs as those 10 tokens sent alone;
    echo shows what ran."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer.encode(PROMPT)
    assert len(ids) > 20

    def complete(prompt: str | list[int], **extra: object) -> openai.types.Completion:
        return client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0.0, extra_body=extra
        )

    for side, kept in (("left", ids[-10:]), ("right", ids[:10])):
        cut = complete(PROMPT, truncate_prompt_tokens=10, truncation_side=side)
        alone = complete(kept)
        assert cut.usage is not None and cut.usage.prompt_tokens == 10
        assert cut.choices[0].text == alone.choices[0].text
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, echo=True,
        extra_body={"truncate_prompt_tokens": 10, "return_token_ids": True},
    ).choices[0]  # fmt: skip
    assert echoed.prompt_token_ids == ids[-10:]  # type: ignore[attr-defined]
    assert echoed.text.startswith(tokenizer.decode(ids[-10:]))
    whole = complete(PROMPT, truncate_prompt_tokens=-1)  # the context holds it all
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 5},
    )  # fmt: skip
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
