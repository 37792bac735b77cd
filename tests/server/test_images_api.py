"""Images through a real server (a tiny random Mistral 3 with its Pixtral tower, fp32): the
official `openai` client's image_url data URL, whole and streamed, and the `ollama`
client's `images`, answer as transformers' whole model on the same weights; /api/show
lists "vision"; what is not an image is a 400 naming where it was, and nothing is held."""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
import transformers

from iterserve.server.app import ServerSettings
from server_fixtures import MODEL_NAME, RunningServer, running_server
from tiny_vision import picture, save_tiny_mistral3, transformers_greedy

MAX_TOKENS = 8
IMAGE = picture(7, 60, 40)


def _png(image: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # type: ignore[attr-defined]
    return buffer.getvalue()


@pytest.fixture(scope="module")
def mistral3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_mistral3(tmp_path_factory.mktemp("mistral3"), tokenizer_dir)


@pytest.fixture(scope="module")
def server(mistral3_dir: Path) -> Iterator[RunningServer]:
    with running_server(mistral3_dir) as running:
        yield running


def _reference(directory: Path, content: list[dict]) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return transformers_greedy(directory, text, [IMAGE], MAX_TOKENS)


def test_an_image_url_answers_as_transformers(server: RunningServer, mistral3_dir: Path) -> None:
    want = _reference(mistral3_dir, [{"type": "image"}, {"type": "text", "text": "What is it?"}])
    tokenizer = transformers.AutoTokenizer.from_pretrained(mistral3_dir)
    url = "data:image/png;base64," + base64.b64encode(_png(IMAGE)).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
        {"type": "text", "text": "What is it?"},
    ]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    asked = dict(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0.0)
    messages = [{"role": "user", "content": content}]
    whole = client.chat.completions.create(messages=messages, **asked)  # type: ignore[arg-type]
    assert whole.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert whole.usage is not None and whole.usage.prompt_tokens > 6 + 4, "the image's tokens"
    streamed = client.chat.completions.create(messages=messages, stream=True, **asked)  # type: ignore[arg-type]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == whole.choices[0].message.content
    # Ollama's `images` before the text, as Ollama places them: the same answer.
    answer = ollama.Client(host=server.base_url).chat(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is it?", "images": [_png(IMAGE)]}],
        options={"temperature": 0, "num_predict": MAX_TOKENS},
    )
    assert answer.message.content == whole.choices[0].message.content
    shown = httpx.post(f"{server.base_url}/api/show", json={"model": MODEL_NAME}, timeout=30)
    assert "vision" in shown.json()["capabilities"]
    # The Responses API's input_image and Anthropic's image block, in the same order.
    given = client.responses.create(
        model=MODEL_NAME, max_output_tokens=MAX_TOKENS, temperature=0.0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                            {"type": "input_text", "text": "What is it?"}]}],
    )  # fmt: skip
    assert given.output_text == whole.choices[0].message.content
    source = {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(
        model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body={"temperature": 0.0},
        messages=[{"role": "user", "content": [{"type": "image", "source": source},
                                               {"type": "text", "text": "What is it?"}]}],
    )  # fmt: skip
    assert message.content[0].text == whole.choices[0].message.content  # type: ignore[union-attr]
    # One image, sent five times: encoded once (the Ollama client's PNG bytes are the same
    # pixels), found kept four times.
    metrics = server.metrics()
    assert metrics["iterserve:images_encoded_total"] == 1
    assert metrics["iterserve:images_reused_total"] == 4
    assert metrics["iterserve:image_encode_seconds_total"] > 0


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [
             {"type": "text", "text": "x"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         "messages.0.content.1.image_url"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]},
         "messages.0.content.0.image_url"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
         "messages.0.content.0"),
        ("/api/generate", {"prompt": "x", "raw": True, "images": ["AAAA"]}, "images"),
        ("/v1/responses",
         {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
         "input.0.content.0.file_id"),
        ("/v1/messages",
         {"messages": [{"role": "user", "content": [
             {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}]}]},
         "source.data"),
    ],
)  # fmt: skip
def test_what_is_not_an_image_is_a_400_naming_it(
    server: RunningServer, path: str, body: dict, named: str
) -> None:
    request = {"model": MODEL_NAME, "max_tokens": 2, "stream": False, **body}
    reply = httpx.post(f"{server.base_url}{path}", json=request, timeout=30)
    assert reply.status_code == 400, reply.text
    assert named in reply.text
    assert server.engine.scheduler.kv_cache_stats().num_used_blocks == 0


def test_a_text_model_refuses_images_by_name(tiny_llama_dir: Path) -> None:
    url = "data:image/png;base64," + base64.b64encode(_png(IMAGE)).decode()
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]
    with running_server(tiny_llama_dir) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="takes no images") as refused:
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=2
            )
    assert refused.value.body["param"] == "messages.0.content.1.image_url"  # type: ignore[index]


def test_image_urls_are_read_where_the_server_is_told(mistral3_dir: Path, tmp_path: Path) -> None:
    """file:// under --allowed-local-media-path and http(s) from --allowed-media-domains (a
    real HTTP server on this machine) answer as the same image inline; elsewhere a 400."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "picture.png").write_bytes(_png(IMAGE))
    (tmp_path / "outside.png").write_bytes(_png(IMAGE))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    site = f"http://127.0.0.1:{web.server_address[1]}"
    settings = ServerSettings(
        served_model_names=[MODEL_NAME],
        allowed_local_media_path=str(media),
        allowed_media_domains=["127.0.0.1"],
    )
    inline = "data:image/png;base64," + base64.b64encode(_png(IMAGE)).decode()
    try:
        with running_server(mistral3_dir, settings) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)

            def ask(url: str) -> str:
                content = [{"type": "image_url", "image_url": {"url": url}},
                           {"type": "text", "text": "What is it?"}]  # fmt: skip
                answer = client.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": content}],
                    max_tokens=MAX_TOKENS, temperature=0.0,
                )  # fmt: skip
                return answer.choices[0].message.content or ""

            want = ask(inline)
            assert ask(f"file://{media / 'picture.png'}") == want
            assert ask(f"{site}/picture.png") == want
            for url, why in [
                (f"file://{tmp_path / 'outside.png'}", "is not under"),
                (f"{site}/missing.png", "answered 404"),
                (f"http://localhost:{web.server_address[1]}/picture.png", "not 'localhost'"),
            ]:
                with pytest.raises(openai.BadRequestError, match=why) as refused:
                    ask(url)
                assert refused.value.body["param"] == "messages.0.content.0.image_url"  # type: ignore[index]
    finally:
        web.shutdown()


def test_an_image_being_encoded_holds_up_no_other_request(server: RunningServer) -> None:
    """The tower runs on a worker thread: while an image is encoded (held here until told),
    a text request is answered."""
    images = server.engine.images
    encode, started, release = images.encoder.encode, threading.Event(), threading.Event()

    def held(image: object) -> object:
        started.set()
        release.wait(timeout=60)
        return encode(image)

    url = "data:image/png;base64," + base64.b64encode(_png(picture(11, 50, 50))).decode()
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    asked = dict(model=MODEL_NAME, max_tokens=4, temperature=0.0)
    images.encoder.encode = held
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            content = [{"type": "image_url", "image_url": {"url": url}}]
            waiting = pool.submit(
                client.chat.completions.create,
                messages=[{"role": "user", "content": content}], **asked,
            )  # fmt: skip
            assert started.wait(timeout=60), "the image's encode began"
            text = client.chat.completions.create(
                messages=[{"role": "user", "content": "Hello"}], **asked
            )  # fmt: skip
            assert text.choices[0].message.content and not waiting.done()
            release.set()
            assert waiting.result(timeout=60).choices[0].message.content
    finally:
        release.set()
        images.encoder.encode = encode


def test_token_counts_lay_each_image_out_by_its_size(server: RunningServer) -> None:
    """/tokenize and Anthropic's count_tokens count an image's tokens as the chat runs them
    (usage), by its size, without running the tower: two sizes, two counts."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    counts = []
    for image in (IMAGE, picture(8, 100, 90)):
        data = base64.b64encode(_png(image)).decode()
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                   {"type": "text", "text": "What is it?"}]  # fmt: skip
        messages = [{"role": "user", "content": content}]
        encoded = server.metrics()["iterserve:images_encoded_total"]
        tokenized = httpx.post(
            f"{server.base_url}/tokenize", json={"model": MODEL_NAME, "messages": messages}
        ).json()
        source = {"type": "base64", "media_type": "image/png", "data": data}
        blocks = [{"role": "user", "content": [{"type": "image", "source": source},
                                               {"type": "text", "text": "What is it?"}]}]  # fmt: skip
        counted = claude.messages.count_tokens(model=MODEL_NAME, messages=blocks)  # type: ignore[arg-type]
        assert server.metrics()["iterserve:images_encoded_total"] == encoded, "no tower run"
        used = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=1,  # type: ignore[arg-type]
        ).usage
        assert used is not None
        assert tokenized["count"] == counted.input_tokens == used.prompt_tokens
        counts.append(used.prompt_tokens)
    # 60 x 40 pixels: 3 x 2 merged patches, 3 rows of 2 [IMG] with their breaks and end;
    # 100 x 90: 4 x 4.
    assert counts[1] - counts[0] == (4 * 4 + 4) - (3 * 2 + 3)
