"""--chat-template: a template of the user's in place of the checkpoint's, from a file or
inline, for the server and the offline LLM alike; one that cannot work stops the start with
a message naming the flag. (Each tool-call format's real template given so, through a real
server: test_tool_call_families.py.) `LLM.chat` takes one a call, as vLLM's does."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from iterserve import LLM
from iterserve.config import ConfigError
from iterserve.engine.prompts import render_chat
from iterserve.sampling_params import SamplingParams
from iterserve.server.app import ServerSettings
from server_fixtures import MODEL_NAME, running_server

# Unlike the tiny model's own (SmolLM2's ChatML), so a prompt shows which one rendered it.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
]
RENDERED = "<system>Be brief.\n<user>Hi there\n<assistant>"


def _llm(model_dir: Path, chat_template: str) -> LLM:
    return LLM(
        str(model_dir),
        chat_template=chat_template,
        dtype="float32",
        compile=False,
        num_kv_blocks=64,
    )


def test_a_template_file_renders_the_servers_chats(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    with running_server(tiny_llama_dir, chat_template=str(path)) as server:
        expected = server.engine.tokenizer.encode(RENDERED, add_special_tokens=False)
        tokenized = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT})
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == expected
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert answer.usage is not None and answer.usage.prompt_tokens == len(expected)


def test_an_inline_template_renders_llm_chat(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir, TEMPLATE)
    [output] = llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)
    assert output.prompt == RENDERED
    assert llm.apply_chat_template(CHAT) == llm.tokenizer.encode(RENDERED, add_special_tokens=False)


def test_a_calls_own_template_renders_that_call_only(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`LLM.chat(..., chat_template=...)`, as vLLM's takes one: that call's conversations,
    inline or from a file; the next call without one renders with the engine's again."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False, num_kv_blocks=64)
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    for given in (TEMPLATE, str(path)):
        [output] = llm.chat(CHAT, SamplingParams(max_tokens=1), False, chat_template=given)
        assert output.prompt == RENDERED
    [own] = llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)
    assert own.prompt == render_chat(llm.tokenizer, llm.engine.chat_template, CHAT).text
    assert own.prompt != RENDERED
    with pytest.raises(ConfigError, match="chat_template 'missing.jinja': no such file"):
        llm.chat(CHAT, chat_template="missing.jinja")


@pytest.mark.parametrize(
    "flag, said",
    [
        ("no-such-template.jinja", "no such file, and not a Jinja template"),
        ("{% for m in messages %}{{ m['content'] }}", "does not parse, line 1"),
        ("{{ messages[0]['content'] }", "does not parse, line 1"),
        ("<directory>", "cannot read it"),
    ],
)
def test_a_template_that_cannot_work_stops_the_start(
    tiny_llama_dir: Path, tmp_path: Path, flag: str, said: str
) -> None:
    flag = str(tmp_path) if flag == "<directory>" else flag
    with pytest.raises(ConfigError, match="--chat-template") as raised:
        _llm(tiny_llama_dir, flag)
    assert said in str(raised.value)


def _refusal(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template"
    return error["message"]


def test_a_requests_own_template_renders_it_only_where_the_server_trusts_requests(
    tiny_llama_dir: Path,
) -> None:
    """vLLM's `chat_template` request field and --trust-request-chat-template: without the
    flag a 400 naming the field; with it, that request's chat (and /tokenize) render with it,
    a chat without one with the server's, and a template that cannot work is a 400 naming it
    (a path is text, never a file read on the server)."""
    own = {"messages": CHAT, "chat_template": TEMPLATE}
    with running_server(tiny_llama_dir) as server:
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", json={**own, "max_tokens": 1})
        assert "--trust-request-chat-template" in _refusal(chat)
        assert "--trust-request-chat-template" in _refusal(
            httpx.post(f"{server.base_url}/tokenize", json=own)
        )
    trusted = ServerSettings(served_model_names=[MODEL_NAME], trust_request_chat_template=True)
    with running_server(tiny_llama_dir, settings=trusted) as server:
        expected = server.engine.tokenizer.encode(RENDERED, add_special_tokens=False)
        tokenized = httpx.post(f"{server.base_url}/tokenize", json=own)
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == expected
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        for template, tokens in [(TEMPLATE, len(expected)), (None, None)]:
            answer = client.chat.completions.create(
                model=MODEL_NAME,
                messages=CHAT,  # type: ignore[arg-type]
                max_tokens=1,
                extra_body={"chat_template": template} if template else None,
            )
            assert answer.usage is not None
            if tokens is None:  # the server's own template (ChatML): another prompt
                assert answer.usage.prompt_tokens != len(expected)
            else:
                assert answer.usage.prompt_tokens == tokens
        for template, said in [
            ("{% for m in messages %}{{ m['content'] }}", "does not parse, line 1"),
            ("/etc/hostname", "is not a Jinja template"),
        ]:
            body = {"messages": CHAT, "chat_template": template, "max_tokens": 1}
            assert said in _refusal(httpx.post(f"{server.base_url}/v1/chat/completions", json=body))
        # The server still answers its other requests.
        assert client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)  # type: ignore[arg-type]


def test_a_requests_documents_reach_a_rag_template_and_are_refused_by_one_without_a_place(
    tiny_llama_dir: Path,
) -> None:
    """vLLM's `documents` field: Granite 3.3's real template writes each into the prompt (a
    chat's usage and /tokenize agree); the tiny model's own (ChatML) has no place for them,
    so a request sending some gets a 400 naming the field, not an answer that never saw
    them."""
    granite = Path(__file__).parent / "chat_templates" / "granite_3_3_2b_instruct.jinja"
    documents = [{"doc_id": "1", "text": "Lutetia is the old name of Paris."}]
    ask = {"messages": CHAT, "documents": documents}
    with running_server(tiny_llama_dir, chat_template=str(granite)) as server:
        tokenized = httpx.post(f"{server.base_url}/tokenize", json=ask)
        assert tokenized.status_code == 200, tokenized.text
        with_documents = server.engine.tokenizer.decode(tokenized.json()["tokens"])
        assert 'document {"document_id": "1"}' in with_documents
        assert "Lutetia is the old name of Paris." in with_documents
        without = httpx.post(f"{server.base_url}/tokenize", json={"messages": CHAT}).json()
        assert "Lutetia" not in server.engine.tokenizer.decode(without["tokens"])
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=1,
            extra_body={"documents": documents},
        )
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == tokenized.json()["count"]
    with running_server(tiny_llama_dir) as server:
        refused = httpx.post(f"{server.base_url}/v1/chat/completions", json=ask)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "documents"
