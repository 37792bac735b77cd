"""llama-server's own API (/completion, /infill) over a real server: its answers are the
engine's (the same greedy text and log-probabilities as /v1/completions on the same token
ids), /infill lays out a repository-level prompt as llama-server does, the editor's stop
conditions end the answer where llama-server ends it, and what is not implemented is a 400
naming the field. The tiny model carries Qwen2.5-Coder's five fill-in-the-middle tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import VOCAB
from iterserve import LLM, SamplingParams
from iterserve.engine.fill_in_middle import KNOWN_FORMATS, ExtraFile, fim_format, infill_tokens
from iterserve.model.tokenizer import load_hf_tokenizer
from iterserve.sampling_params import InvalidRequestError
from iterserve.server.app import ServerSettings
from iterserve.server.llama_server_protocol import LlamaCompletionRequest
from iterserve.server.llama_server_routes import indent_cut, kept_fields
from server_fixtures import MODEL_NAME, RunningServer, running_server
from tiny_checkpoints import save_checkpoint, tiny_hf_model

pytestmark = pytest.mark.timeout(180)

QWEN_CODER = KNOWN_FORMATS[0]
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_CODER.markers)})  # type: ignore[dict-item]
    model = tiny_hf_model(
        "llama", vocab_size=VOCAB + 5, tie_word_embeddings=True, max_position_embeddings=512
    )
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny-coder"), tokenizer)


@pytest.fixture(scope="module")
def server(coder_dir: Path) -> Iterator[RunningServer]:
    with running_server(coder_dir) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any]) -> Any:
    reply = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def openai_greedy(server: RunningServer, ids: list[int], tokens: int, **more: Any) -> Any:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": tokens, "temperature": 0, **more}
    return post(server, "/v1/completions", body)["choices"][0]


def encode(server: RunningServer, text: str, special: bool = True) -> list[int]:
    body = {"prompt": text, "add_special_tokens": special}
    return post(server, "/tokenize", body)["tokens"]


def test_completion_is_the_engines_answer(server: RunningServer) -> None:
    ids = encode(server, PROMPT)
    expected = openai_greedy(server, ids, 8, logprobs=2)
    answer = post(server, "/completion", {
        "prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 2, "return_tokens": True,
    })  # fmt: skip
    assert answer["content"] == expected["text"]
    assert answer["stop"] is True and answer["stop_type"] == "limit"
    assert answer["tokens_predicted"] == len(answer["tokens"]) == 8
    assert answer["tokens_evaluated"] == len(ids)
    assert answer["timings"]["predicted_n"] == 8 and answer["timings"]["prompt_ms"] > 0
    probabilities = answer["completion_probabilities"]
    assert [p["logprob"] for p in probabilities] == pytest.approx(
        expected["logprobs"]["token_logprobs"], abs=1e-5
    )
    for entry, top in zip(probabilities, expected["logprobs"]["top_logprobs"], strict=True):
        assert {t["token"]: t["logprob"] for t in entry["top_logprobs"]} == pytest.approx(top)
        assert bytes(entry["bytes"]).decode() == entry["token"]
    # The same prompt as token ids and text mixed; and two prompts, an array in order.
    mixed = post(server, "/completion", {
        "prompt": [*ids[:3], PROMPT[len(load_text(server, ids[:3])) :]], "n_predict": 8,
        "temperature": 0,
    })  # fmt: skip
    assert mixed["tokens_evaluated"] >= 3
    both = post(server, "/completions", {"prompt": [PROMPT, "x = "], "n_predict": 8,
                                         "temperature": 0})  # fmt: skip
    assert [a["index"] for a in both] == [0, 1] and both[0]["content"] == expected["text"]
    kept = post(server, "/completion", {
        "prompt": PROMPT, "n_predict": 2, "response_fields": ["content", "timings/predicted_n",
                                                              "nothing"],
    })  # fmt: skip
    assert set(kept) == {"content", "timings/predicted_n"} and kept["timings/predicted_n"] == 2


def load_text(server: RunningServer, ids: list[int]) -> str:
    return post(server, "/detokenize", {"tokens": ids})["prompt"]


def test_n_cmpl_completions_of_each_prompt(server: RunningServer) -> None:
    """Prompt i's completion j at index i * n_cmpl + j; greedy ones are alike, seeded
    ones draw apart."""
    answers = post(server, "/completion", {"prompt": [PROMPT, "x = "], "n_cmpl": 2,
                                           "n_predict": 6, "temperature": 0})  # fmt: skip
    assert [a["index"] for a in answers] == [0, 1, 2, 3]
    assert answers[0]["content"] == answers[1]["content"] != answers[2]["content"]
    assert (
        answers[0]["tokens_evaluated"]
        == answers[1]["tokens_evaluated"]
        == len(encode(server, PROMPT))
    )
    drawn = post(server, "/completion", {"prompt": PROMPT, "n_cmpl": 4, "n_predict": 12,
                                         "temperature": 1.5, "seed": 3, "top_k": 0,
                                         "min_p": 0, "top_p": 1})  # fmt: skip
    assert len({a["content"] for a in drawn}) > 1


def test_penalties_count_llama_cpps_window(server: RunningServer, coder_dir: Path) -> None:
    """repeat_penalty over repeat_last_n tokens (its default 64) is llama.cpp's rule: the
    engine's penalty_last_n (tests/sample has the rule against a reference decode)."""
    ids = encode(server, PROMPT)
    plain = post(server, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0,
                                         "return_tokens": True})  # fmt: skip
    penalised = post(server, "/completion", {
        "prompt": PROMPT, "n_predict": 12, "temperature": 0, "return_tokens": True,
        "repeat_penalty": 1.5, "frequency_penalty": 0.5, "repeat_last_n": 8,
    })  # fmt: skip
    assert penalised["tokens"] != plain["tokens"]
    llm = LLM(str(coder_dir), dtype="float32", compile=False, max_model_len=512)
    reference = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=12, repetition_penalty=1.5, frequency_penalty=0.5,
        penalty_last_n=8,
    ), use_tqdm=False)  # fmt: skip
    assert penalised["tokens"] == reference[0].token_ids


def test_llama_vscodes_chat_edit_request(server: RunningServer) -> None:
    """llama.vscode's "edit with AI" payload to /v1/chat/completions, as it sends it to
    llama-server: its sampler fields at their neutral values, and max_tokens -1, which
    llama-server reads as no limit (here as null: all the context allows)."""
    messages = [{"role": "system", "content": "You are an expert coder."},
                {"role": "user", "content": "Rename x to count:\nx = 1"}]  # fmt: skip
    edit = {
        "messages": messages, "stream": False, "cache_prompt": True, "samplers": "edkypmxt",
        "temperature": 0, "dynatemp_range": 0, "dynatemp_exponent": 1, "top_k": 40,
        "top_p": 0.95, "min_p": 0.05, "typical_p": 1, "xtc_probability": 0,
        "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1,
        "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75,
        "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": -1,
        "timings_per_token": False,
    }  # fmt: skip
    answer = post(server, "/v1/chat/completions", edit)
    unlimited = post(server, "/v1/chat/completions", {**edit, "max_tokens": None})
    content = answer["choices"][0]["message"]["content"]
    assert content and content == unlimited["choices"][0]["message"]["content"]
    for field in ("max_tokens", "max_completion_tokens"):
        reply = httpx.post(f"{server.base_url}/v1/chat/completions",
                           json={"messages": messages, field: -2})  # fmt: skip
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field


def test_a_stream_ends_with_the_answers_fields(server: RunningServer) -> None:
    whole = post(server, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
    events = []
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completion", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert sum(len(e["tokens"]) for e in events) == 8
    assert events[-1]["stop_type"] == "limit" and events[-1]["tokens_predicted"] == 8


def test_a_stop_word_ends_the_answer_before_it(server: RunningServer) -> None:
    free = post(server, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
    word = free["content"][3:6]
    assert word.strip(), free["content"]
    stopped = post(server, "/completion", {
        "prompt": PROMPT, "n_predict": 8, "temperature": 0, "stop": [word],
    })  # fmt: skip
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == free["content"][: free["content"].index(word)]


def test_logit_bias_false_bans_a_token(server: RunningServer) -> None:
    free = post(server, "/completion", {"prompt": PROMPT, "n_predict": 1, "temperature": 0,
                                        "return_tokens": True})  # fmt: skip
    banned = free["tokens"][0]
    for bias in ([[banned, False]], {str(banned): -100}):
        other = post(server, "/completion", {
            "prompt": PROMPT, "n_predict": 1, "temperature": 0, "return_tokens": True,
            "logit_bias": bias,
        })  # fmt: skip
        assert other["tokens"] != [banned]


def test_infill_lays_out_the_repository_and_the_cursor(server: RunningServer) -> None:
    """Qwen2.5-Coder's repository-level layout, built here by hand: the greedy middle is
    /v1/completions' on those ids."""
    before, after, start = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n", "return"
    files = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"},
             {"filename": "main.py", "text": "import util\n"}]  # fmt: skip
    ids = {m: encode(server, m, special=False)[0] for m in QWEN_CODER.markers}

    def text(t: str) -> list[int]:
        return encode(server, t, special=False)

    expected = [ids["<|repo_name|>"], *text("myproject\n")]
    for file in files:
        expected += [ids["<|file_sep|>"], *text(file["filename"] + "\n"), *text(file["text"])]
    # The cursor's line (`prompt`) right after the prefix, tokenized apart, as llama-server.
    expected += [ids["<|file_sep|>"], *text("filename\n"), ids["<|fim_prefix|>"], *text(before),
                 *text(start), ids["<|fim_suffix|>"], *text(after), ids["<|fim_middle|>"]]  # fmt: skip
    answer = post(server, "/infill", {
        "input_prefix": before, "input_suffix": after, "input_extra": files, "prompt": start,
        "n_predict": 6, "temperature": 0, "top_k": 40, "top_p": 0.99, "cache_prompt": True,
        "samplers": ["top_k", "top_p", "infill", "temperature"], "t_max_prompt_ms": 500,
    })  # fmt: skip
    assert answer["tokens_evaluated"] == len(expected)
    assert answer["content"] == openai_greedy(server, expected, 6)["text"]
    # llama.vscode's own chain: temperature 1 through the infill sampler.
    vscode = {"input_prefix": before, "input_suffix": after, "n_predict": 6, "seed": 3,
              "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"]}  # fmt: skip
    assert post(server, "/infill", vscode)["tokens_predicted"] >= 1
    # llama.vscode's warm-up: the prompt alone, nothing reported; the next finds it cached.
    warm = {"input_prefix": before * 4, "input_suffix": after, "input_extra": files,
            "n_predict": 0}  # fmt: skip
    first = post(server, "/infill", warm)
    assert first["content"] == "" and first["tokens_predicted"] == 0
    assert post(server, "/infill", warm)["tokens_cached"] >= 16


def test_ollamas_generate_with_a_suffix_fills_in_the_middle(server: RunningServer) -> None:
    """Ollama's /api/generate `suffix` (its "insert"): the prompt /infill lays out for the
    same prefix and suffix, and its greedy middle; /api/show says the model inserts."""
    before, after = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    infill = post(server, "/infill", {"input_prefix": before, "input_suffix": after,
                                      "n_predict": 6, "samplers": ["temperature"],
                                      "temperature": 0})  # fmt: skip
    options = {"num_predict": 6, "temperature": 0, "repeat_penalty": 1}
    ollama_body = {"model": MODEL_NAME, "prompt": before, "suffix": after, "stream": False,
                   "options": options}  # fmt: skip
    answer = post(server, "/api/generate", ollama_body)
    assert answer["prompt_eval_count"] == infill["tokens_evaluated"]
    assert answer["response"] == infill["content"] and "context" in answer
    assert "insert" in post(server, "/api/show", {"model": MODEL_NAME})["capabilities"]


def test_the_editors_stop_conditions(server: RunningServer) -> None:
    """A grammar (GBNF, as llama.cpp's clients write it) makes the random model write three
    lines; the third is indented less than n_indent, so the answer ends after its
    indentation, as llama-server ends it; with t_max_predict_ms, after the first line."""
    grammar = 'root ::= "x = 1\\n    y = 2\\n  z = 3\\n"'
    body = {"prompt": PROMPT, "n_predict": 32, "temperature": 0, "grammar": grammar}
    whole = post(server, "/completion", body)
    assert whole["content"] == "x = 1\n    y = 2\n  z = 3\n"
    cut = post(server, "/completion", {**body, "n_indent": 4})
    assert cut["content"] == "x = 1\n    y = 2\n  " and cut["stop_type"] == "limit"
    assert cut["tokens_predicted"] < whole["tokens_predicted"]
    # t_max_predict_ms: past it (1 ms: a step takes longer) the answer ends once a line has.
    timed = post(server, "/completion", {**body, "t_max_predict_ms": 1})
    assert timed["content"].startswith("x = 1\n") and "y" not in timed["content"]
    assert timed["stop_type"] == "limit"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"mirostat": 2}, "mirostat"),
        ({"dry_multiplier": 0.8}, "dry_multiplier"),
        ({"typical_p": 0.9}, "typical_p"),
        ({"repeat_last_n": -2}, "repeat_last_n"),
        ({"lora": [{"id": 0, "scale": 0.5}]}, "lora"),
        ({"logit_bias": [[1, 2, 3]]}, "logit_bias"),
        ({"prompt": [10**9]}, "prompt"),
        ({"grammar": 'root ::= "a"', "json_schema": {}}, "grammar"),
    ],
)
def test_what_is_not_honoured_is_a_400_naming_it(
    server: RunningServer, fields: dict[str, Any], param: str
) -> None:
    reply = httpx.post(f"{server.base_url}/completion", json={"prompt": PROMPT, **fields})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    neutral = {"mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0}
    assert httpx.post(f"{server.base_url}/completion",
                      json={"prompt": PROMPT, "n_predict": 1, **neutral}).status_code == 200  # fmt: skip


def test_indent_cut_is_llama_servers_rule() -> None:
    assert indent_cut("a\n    b\n  c", 4) == len("a\n    b\n  ")
    assert indent_cut("a\n    b\n  ", 4) is None  # whitespace alone may still grow
    assert indent_cut("  first line\n    b", 4) is None  # the cursor's line is not checked
    assert indent_cut("a\n\tb\nc", 1) == len("a\n\tb\n")
    assert indent_cut("a\nb", 0) is None


def test_infill_cuts_far_from_the_cursor_first() -> None:
    """Within its budget: the other files' start goes first, then the prefix's start and
    the suffix's end, 3:1."""
    tokenizer_markers = {m: 1000 + i for i, m in enumerate(QWEN_CODER.markers)}

    def encode_chars(text: str) -> list[int]:
        return [ord(c) for c in text]

    def layout(budget: int, extra: list[ExtraFile]) -> list[int]:
        return infill_tokens(QWEN_CODER, encode_chars, tokenizer_markers.__getitem__,
                             "P" * 40, "S" * 40, extra, "", budget)  # fmt: skip

    whole = layout(1000, [ExtraFile("E" * 30, "f")])
    assert whole.count(ord("E")) == 30 and whole.count(ord("P")) == 40
    tight = layout(3 + 80 + 10, [ExtraFile("E" * 30, "f")])
    assert tight.count(ord("P")) == 40 and tight.count(ord("S")) == 40 and len(tight) == 93
    assert tight[-1] == tokenizer_markers["<|fim_middle|>"]
    cut = layout(3 + 40, [])
    assert cut.count(ord("S")) == 10 and cut.count(ord("P")) == 30
    plain = infill_tokens(QWEN_CODER.__class__("<a>", "<b>", "<c>"), encode_chars,
                          {"<a>": 1, "<b>": 2, "<c>": 3}.__getitem__, "p", "s",
                          [ExtraFile("x")], "m", 100)  # fmt: skip
    assert plain == [*encode_chars("\n\n--- snippet ---\n\nx"), 1, ord("p"), ord("m"), 2,
                     ord("s"), 3]  # fmt: skip


def test_fim_format_keeps_repository_markers_only_when_both_are_there(
    tokenizer_dir: Path,
) -> None:
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    three = [QWEN_CODER.prefix, QWEN_CODER.suffix, QWEN_CODER.middle, "<|repo_name|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": three})  # type: ignore[dict-item]
    found = fim_format(tokenizer)
    assert found is not None and found.prefix == QWEN_CODER.prefix
    assert found.repository is None and found.file_separator is None


def test_kept_fields_lifts_nested_ones() -> None:
    result = {"content": "x", "timings": {"predicted_n": 3}}
    assert kept_fields(result, ["timings/predicted_n", "content", "timings/nope"]) == {
        "timings/predicted_n": 3, "content": "x",
    }  # fmt: skip


def test_llama_servers_tokenize_template_and_props(server: RunningServer) -> None:
    """Its /tokenize shape (`content`; pieces, a piece that is part of a UTF-8 character as
    its bytes), /detokenize's `content`, /apply-template and /props."""
    text = "héllo wörld 龘 <|fim_prefix|>"
    plain = post(server, "/tokenize", {"content": text})
    assert plain["tokens"] == encode(server, text, special=False)
    split = post(server, "/tokenize", {"content": text, "parse_special": False})["tokens"]
    assert len(split) > len(plain["tokens"])  # the marker's text read as plain text
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == plain["tokens"]
    joined = b"".join(
        p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces
    )
    assert joined.decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces)  # 龘 is three tokens of a byte each
    back = post(server, "/detokenize", {"tokens": plain["tokens"]})
    assert back["content"] == back["prompt"] == text
    messages = [{"role": "user", "content": "Hi"}]
    rendered = post(server, "/apply-template", {"messages": messages})["prompt"]
    assert (
        encode(server, rendered, special=False)
        == post(server, "/tokenize", {"messages": messages})["tokens"]
    )
    props = httpx.get(f"{server.base_url}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 512
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["default_generation_settings"]["params"]["samplers"][-1] == "temperature"
    assert props["model_alias"] == MODEL_NAME


@pytest.fixture(scope="module")
def editor_server(coder_dir: Path) -> Iterator[RunningServer]:
    """As an editor's README starts llama-server: `--cache-reuse`, and any model name."""
    settings = ServerSettings(served_model_names=[MODEL_NAME, "*"])
    with running_server(coder_dir, settings, cache_reuse=16) as running:
        yield running


def test_infill_after_the_cursor_moved_reuses_what_moved(
    server: RunningServer, editor_server: RunningServer
) -> None:
    """llama.vscode's next request after the cursor moved down: the window of lines above it
    lost its first lines and the rest came back earlier. The prefix cache finds nothing of
    it; --cache-reuse copies it and computes the new lines and the markers only."""
    lines = [f"def f{i}(x):\n    return x * {i} + {i * 7}\n" for i in range(60)]

    def body(cursor: int) -> dict[str, Any]:
        return {"input_prefix": "".join(lines[cursor - 24 : cursor]),
                "input_suffix": "".join(lines[cursor + 1 : cursor + 8]), "prompt": "def",
                "n_predict": 4, "temperature": 0}  # fmt: skip

    for running in (server, editor_server):
        post(running, "/infill", body(30))
    plain, reused = (post(running, "/infill", body(33)) for running in (server, editor_server))
    evaluated = reused["tokens_evaluated"]
    assert plain["tokens_evaluated"] == evaluated
    assert plain["tokens_cached"] < 16
    assert reused["tokens_cached"] > 0.8 * evaluated
    assert reused["timings"]["prompt_n"] == evaluated - reused["tokens_cached"]
    counted = editor_server.metrics().get("iterserve:cache_reuse_tokens_total", 0.0)
    assert counted >= reused["tokens_cached"] - 16


def test_any_model_name_when_served_as_star(
    server: RunningServer, editor_server: RunningServer
) -> None:
    """`--served-model-name NAME '*'`: llama-server's clients send names of their own
    ("GPT-4" for llama.vscode's embeddings); without the star that is OpenAI's 404."""
    body = {"model": "GPT-4", "prompt": "def", "max_tokens": 2, "temperature": 0}
    answer = post(editor_server, "/v1/completions", body)
    assert answer["model"] == MODEL_NAME
    refused = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
    models = httpx.get(f"{editor_server.base_url}/v1/models").json()["data"]
    assert [card["id"] for card in models] == [MODEL_NAME]


def llama_params(**body: Any) -> SamplingParams:
    request = LlamaCompletionRequest(**body)
    request.check_supported()
    return request.sampling_params(None)


def test_samplers_is_llama_cpps_chain() -> None:
    """Only the samplers named run, in llama.cpp's order: its default chain ends with the
    temperature, so top-p and min-p judge the untempered distribution."""
    default = llama_params()
    assert (default.temperature, default.top_k, default.top_p, default.min_p) == (
        0.8,
        40,
        0.95,
        0.05,
    )
    assert default.temperature_last
    # llama.vscode's /infill: no temperature, no min-p in its chain, so neither applies; its
    # infill sampler ends at the tokens the route gives (the model's EOS first).
    vscode = llama_params(samplers=["top_k", "top_p", "infill"], top_p=0.99, temperature=0)
    assert (vscode.temperature, vscode.top_k, vscode.top_p, vscode.min_p) == (1.0, 40, 0.99, 0.0)
    infill = LlamaCompletionRequest(samplers=["top_k", "top_p", "infill"])
    assert infill.sampling_params(None, (2, 7)).infill_eog == (2, 7)
    assert LlamaCompletionRequest().sampling_params(None, (2, 7)).infill_eog == ()
    # ignore_eos bans the ends (llama-server's -inf bias), beside the request's own biases.
    endless = LlamaCompletionRequest(ignore_eos=True).sampling_params({5: 1.0}, (2, 7))
    assert endless.logit_bias == {5: 1.0, 2: -100.0, 7: -100.0} and not endless.stop_token_ids
    letters = llama_params(samplers="edkypmxt", repeat_penalty=1.1)
    assert letters.repetition_penalty == 1.1 and letters.temperature_last
    assert llama_params(samplers="kpmt", repeat_penalty=1.1).repetition_penalty == 1.0
    first = llama_params(samplers=["Temperature", "top-k", "nucleus", "minp"])
    assert not first.temperature_last and (first.top_k, first.top_p, first.min_p) == (
        40,
        0.95,
        0.05,
    )
    unknown = llama_params(samplers=["softmax", "k"])  # names it does not know: nothing runs
    assert (unknown.temperature, unknown.top_k, unknown.top_p) == (1.0, 0, 1.0)
    for samplers in (["top_p", "temperature", "min_p"], ["adaptive_p"]):
        with pytest.raises(InvalidRequestError) as refused:
            llama_params(samplers=samplers)
        assert refused.value.param == "samplers"
