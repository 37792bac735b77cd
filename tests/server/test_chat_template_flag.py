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
