"""The sampling controls, echo with prompt logprobs and the tokenizer endpoints over HTTP,
through the official openai client where it has the call."""

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
        ({"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
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
