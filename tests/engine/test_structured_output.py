"""Structured output: the constraint decides the text whatever the batching does.

Every check is against the constraint itself (a regex, a JSON schema through pydantic,
the list of choices), not against outputs recorded from this code. The tiny random
model would write anything; only the grammar keeps its text in shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel

from draft_llms import draft_llm
from iterserve import LLM, SamplingParams
from iterserve.engine.async_engine import AsyncEngine
from iterserve.sampling_params import InvalidRequestError
from iterserve.structured_output import StructuredOutput
from server_fixtures import serving
from transformers_reference import PROMPTS

# Bounded, so the grammar itself ends every output (in at most 59 tokens); the digits
# (one token each in this vocabulary) make every output long enough to be preempted.
WORDS = r"[a-z]{1,6}( [a-z]{1,6}){2,5} [0-9]{12,16}\."


def _words(seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=64, structured_output=StructuredOutput(regex=WORDS)
    )


# Beside the constrained requests, one free one, whose rows (several a step when it
# speculates) shift the constrained rows within the step's logits.
FREE_PROMPT = "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3"
FREE = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _run(llm: LLM) -> list:
    prompts = [FREE_PROMPT, *PROMPTS]  # first: its rows come before theirs
    params = [FREE, *(_words(i) for i in range(len(PROMPTS)))]
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", compile=False)


@pytest.fixture(scope="module")
def reference_run(tiny_llm: LLM) -> list[str]:
    """The texts with plenty of memory and budget: no preemption, chunking or drafts."""
    outputs = _run(tiny_llm)
    for output in outputs[1:]:
        assert re.fullmatch(WORDS, output.text), output.text
        assert output.finish_reason == "stop"  # the grammar completed: EOS was all it allowed
    return [output.text for output in outputs]


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 7, "max_num_seqs": 7},  # chunked prefill, decodes mixed in
        {"num_kv_blocks": 28, "block_size": 4},  # preemption: prompts fit, outputs do not
        {"speculative_method": "ngram", "num_speculative_tokens": 3},
    ],
    ids=["chunked", "preemption", "ngram-speculation"],
)
def test_matchers_follow_the_output_through_the_scheduler(
    tiny_llama_dir: Path, reference_run: list[str], settings: dict
) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False, **settings)
    outputs = _run(llm)
    # Seeded draws do not depend on the batch, and a matcher that lost its place would
    # mask differently: the same texts prove every matcher stayed where its output was.
    assert [output.text for output in outputs] == reference_run
    if "speculative_method" in settings:
        # Guesses cut at the grammar's first refusal, rows masked after each guess: the
        # constrained requests speculate too, and their seeded texts do not change.
        assert outputs[0].num_draft_tokens > 0, "the free request speculated beside them"
        assert sum(output.num_accepted_tokens for output in outputs[1:]) > 0
    if "num_kv_blocks" in settings:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.step()  # the executor hears of the last finished requests with the next step
    assert len(llm.engine.executor.structured) == 0, "every finished request's matcher dropped"


# Greedy constraints whose outputs repeat themselves (so prompt lookup has guesses to make).
GREEDY_CONSTRAINTS = [
    StructuredOutput(regex=r"(ab|cd|[0-9]){8,40}"),
    StructuredOutput.from_json_schema(
        {
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"type": "integer"}}},
            "required": ["items"],
        }
    ),
    StructuredOutput(choice=["one two three one two three", "four five"]),
]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_constrained_text_is_the_same_with_speculation(
    tiny_llama_dir: Path, tiny_llm: LLM, method: str
) -> None:
    """Every guess is checked against the grammar (n-gram guesses cut, the draft model's
    drawn from masked logits) and each verified position masked after the guesses before
    it: the greedy texts are those of one token per step, and guesses are kept."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, structured_output=spec)
        for spec in GREEDY_CONSTRAINTS
    ]
    prompts = ["1 2 3 1 2 3 1 2", "A list of numbers:", "Count:"]
    want = tiny_llm.generate(prompts, params, use_tqdm=False)
    extra = {"draft_model": str(tiny_llama_dir)} if method == "draft" else {}
    spec_llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        compile=False,
        speculative_method=method,
        num_speculative_tokens=3,
        **extra,
    )
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(r"(ab|cd|[0-9]){8,40}", got[0].text) or got[0].finish_reason == "length"
    assert sum(o.num_accepted_tokens for o in got) > 0, "constrained requests speculated"


def test_sampled_guesses_of_a_draft_model_keep_the_grammar(
    tiny_llama_dir: Path, reference_run: list[str]
) -> None:
    """The draft samples its guesses from its logits masked by the grammar, the target
    accepts them by the ratio of the masked distributions: every text matches."""
    llm = draft_llm(tiny_llama_dir, tiny_llama_dir, num_speculative_tokens=3)
    outputs = _run(llm)
    for output in outputs[1:]:
        assert re.fullmatch(WORDS, output.text), output.text
        assert output.finish_reason == "stop"
    assert sum(output.num_accepted_tokens for output in outputs[1:]) > 0


def test_n_choices_each_have_their_own_matcher(tiny_llm: LLM) -> None:
    llm = tiny_llm
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=11,
        max_tokens=64,
        structured_output=StructuredOutput(json_schema={"enum": ["red", "green", "blue"]}),
    )
    (output,) = llm.generate(["Pick a colour:"], params, use_tqdm=False)
    texts = [o.text for o in output.outputs]
    assert len(texts) == 4
    assert all(json.loads(text) in ("red", "green", "blue") for text in texts), texts
    # Seeded choices are reproducible whatever runs beside them.
    again = llm.generate(["Other prompt", "Pick a colour:"], [_words(0), params], use_tqdm=False)
    assert [o.text for o in again[1].outputs] == texts


def test_bad_constraints_are_refused_naming_the_field(tiny_llm: LLM) -> None:
    llm = tiny_llm
    for spec, param in (
        (StructuredOutput(regex="a(b", param="guided_regex"), "guided_regex"),
        (
            StructuredOutput.from_json_schema({"type": "integer", "minimum": 5, "maximum": 1}),
            "json_schema",
        ),
        (
            StructuredOutput(grammar="start: undefined_rule", param="guided_grammar"),
            "guided_grammar",
        ),
        # U+B1BEC's first byte, 0xF2, has no token in this vocabulary (fuzzed by
        # tests/server/test_fuzz_api.py): nothing could ever match.
        (StructuredOutput(regex="\U000b1bec", param="guided_regex"), "guided_regex"),
    ):
        with pytest.raises(InvalidRequestError) as error:
            llm.generate(["x"], SamplingParams(structured_output=spec), use_tqdm=False)
        assert error.value.param == param
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput(json_object=True))
    assert error.value.param == "ignore_eos"


def test_a_grammar_the_vocabulary_cannot_finish_ends_only_its_request(tiny_llm: LLM) -> None:
    """After "a" the regex needs byte 0xF2, which no token writes; the library still
    allows one token there. The request ends at that token; its batch-mate is untouched."""
    stuck = SamplingParams(
        max_tokens=8, structured_output=StructuredOutput(regex="a\U000b1bec", param="guided_regex")
    )
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = tiny_llm.generate(["x", "y"], [stuck, free], use_tqdm=False)
    assert outputs[0].finish_reason == "stop"
    assert (
        outputs[0].token_ids[0]
        == tiny_llm.engine.tokenizer.encode("a", add_special_tokens=False)[0]
    )
    assert len(outputs[0].token_ids) <= 3  # "a", the refused token, EOS
    alone = tiny_llm.generate(["y"], free, use_tqdm=False)
    assert outputs[1].token_ids == alone[0].token_ids


# ---- the bundled model behind a real server, through the official client --------------


class City(BaseModel):
    name: str
    country: str
    population: int
    is_capital: bool


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    llm = LLM(max_num_seqs=8, compile=False)  # compiling costs a minute here, tested elsewhere
    with serving(AsyncEngine(llm.engine)) as server:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.mark.slow
def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    for city in ("Paris", "Tokyo", "Lima", "Oslo"):
        completion = client.beta.chat.completions.parse(
            model="tiny-llama",
            messages=[{"role": "user", "content": f"Describe the city of {city} as JSON."}],
            response_format=City,
            max_tokens=80,
            temperature=0.7,
            seed=1,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, City)


class CityPopulation(BaseModel):
    name: str
    country: str
    population_millions: float


@pytest.mark.slow
def test_parse_ends_objects_whose_numbers_would_loop(client: openai.OpenAI) -> None:
    """Greedy, the bundled model loops on the population's digits for these four cities
    (`"population_millions": 3111111...`): before numbers were bounded, all four ran
    to max_tokens (`length`; checked on the commit before the bound). With a number's
    digits bounded as llama.cpp's JSON grammar bounds them, each is a complete object,
    as llama-server returns for the same requests."""
    for city in ("Paris", "Lagos", "Oslo", "Cairo"):
        # parse() raises LengthFinishReasonError for an answer cut by max_tokens.
        completion = client.beta.chat.completions.parse(
            model="tiny-llama",
            messages=[{"role": "user", "content": f"Describe {city} as JSON."}],
            response_format=CityPopulation,
            max_tokens=200,
            temperature=0,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, CityPopulation)


@pytest.mark.slow
def test_json_object_choice_and_regex_always_hold(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "A JSON object with a cat's name and age."}],
        response_format={"type": "json_object"},
        max_tokens=400,
        n=4,
        seed=5,
    )
    # Every finished answer is a JSON object, and most finish. Sampled at temperature 1, the
    # bundled model can loop inside an object past any room (a list counting up, a string
    # that rambles on): one of the 4 did once a change of the kernels' rounding order moved
    # the logits, so a cut one (a prefix of an object, which proves nothing) is allowed.
    texts = [c.message.content or "" for c in chat.choices]
    finished = [t for t, c in zip(texts, chat.choices, strict=True) if c.finish_reason == "stop"]
    assert len(finished) >= 3, texts
    assert all(isinstance(json.loads(text), dict) for text in finished), texts
    assert all(text.startswith("{") for text in texts), texts
    choices = ["positive", "negative", "neutral"]
    answer = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
        max_tokens=10,
        n=4,
        seed=2,
        extra_body={"guided_choice": choices},
    )
    assert all(c.message.content in choices for c in answer.choices)
    streamed = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Sentiment of 'meh'?"}],
        max_tokens=10,
        stream=True,
        extra_body={"structured_outputs": {"choice": choices}},  # vLLM's newer spelling
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) in choices
    regex = r"\d{3}-\d{3}-\d{4}"
    completion = client.completions.create(
        model="tiny-llama",
        prompt="Call me at",
        max_tokens=20,
        n=3,
        seed=3,
        extra_body={"guided_regex": regex},
    )
    assert all(re.fullmatch(regex, c.text) for c in completion.choices), completion.choices


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
        ),  # a keyword the grammar cannot enforce
        ({"guided_json": {"type": "object", "x-guidance": {"lenient": True}}}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "\U000b1bec"}, "guided_regex"),  # byte 0xF2 has no token
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ],
)
def test_bad_constraint_is_a_400_naming_the_field(
    client: openai.OpenAI, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=4, extra_body=extra)
    assert error.value.body["param"] == param, error.value.body  # type: ignore[index]


def test_mask_allows_exactly_the_tokens_the_grammar_accepts(tokenizer_dir: Path) -> None:
    """The one-pass mask against the matcher asked token by token, on rows scattered
    through a batch (the runner's mixed steps) and on a slice (all-constrained steps)."""
    import torch

    from iterserve.model.tokenizer import load_hf_tokenizer
    from iterserve.sample.structured import GrammarCompiler, StructuredBatch

    tokenizer = load_hf_tokenizer(tokenizer_dir)
    vocab = 49152
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    grammars = {
        "digits": compiler.compile(StructuredOutput(regex=r"[0-9]{2,4}")),
        "colour": compiler.compile(StructuredOutput(choice=["red", "green"])),
    }
    batch = StructuredBatch()
    batch.add("digits", grammars["digits"])
    batch.add("colour", grammars["colour"])
    batch.advance("digits", tokenizer.encode("7", add_special_tokens=False))
    probe = torch.randint(vocab, (400,)).tolist() + tokenizer.encode(
        "0 1 g r re", add_special_tokens=False
    )
    probe.append(tokenizer.eos_token_id)
    for rows in ([3, 1], [0, 1]):
        logits = torch.zeros(4, vocab)
        batch.mask(logits, ["digits", "colour"], rows)
        for request_id, row in zip(["digits", "colour"], rows, strict=True):
            matcher = batch._matchers[request_id]
            for token in probe:
                accepted = matcher.deep_copy().consume_token(token)
                assert (logits[row, token] == 0) == accepted, (request_id, token)
        untouched = ({0, 1, 2, 3} - set(rows)).pop()
        assert bool((logits[untouched] == 0).all())


def test_draft_positions_are_masked_after_the_guesses_before_them(tokenizer_dir: Path) -> None:
    """Speculation's masks against matchers advanced by hand: position j of a request
    allows what its grammar allows after its first j guesses; after a guess that
    completes the grammar only EOS; past a refused guess nothing is masked (verification
    never gets there); and the matchers are left where they were."""
    import torch

    from iterserve.model.tokenizer import load_hf_tokenizer
    from iterserve.sample.structured import GrammarCompiler, StructuredBatch

    tokenizer = load_hf_tokenizer(tokenizer_dir)
    vocab, eos = 49152, tokenizer.eos_token_id
    compiler = GrammarCompiler(tokenizer, vocab, [eos])
    batch = StructuredBatch()
    batch.add("digits", compiler.compile(StructuredOutput(regex=r"[0-9]{2,4}")))
    batch.add("dot", compiler.compile(StructuredOutput(regex=r"[0-9]\.")))

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    batch.add("done", compiler.compile(StructuredOutput(regex=r"[0-9]\.")))
    batch.advance("done", ids("1") + ids("."))  # complete: EOS is its guess
    drafts = {"digits": ids("1") + ids("x") + ids("2"), "dot": ids("1") + ids(".")}
    starts = {"digits": 0, "dot": 4}  # rows 0-3 and 4-6; row 7 is another request's
    before = {name: batch._matchers[name].deep_copy() for name in drafts}
    logits = torch.zeros(10, vocab)
    batch.mask(logits, [*drafts, "done"], [*starts.values(), 8], [*drafts.values(), [eos]])
    for row in (8, 9):  # llguidance 1.9.1 leaves the row after that EOS unwritten
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == [eos], row
    probe = torch.randint(vocab, (300,)).tolist() + ids("0 1 9 . x a") + [eos]
    for name, draft in drafts.items():
        reachable = 1 + before[name].validate_tokens(draft)  # positions up to the refusal
        for j in range(len(draft) + 1):
            row = logits[starts[name] + j]
            if j >= reachable:
                assert bool((row == 0).all()), (name, j)
                continue
            state = before[name].deep_copy()
            assert state.consume_tokens(draft[:j])
            if state.is_stopped():  # complete: EOS is all that may follow
                assert torch.isfinite(row).nonzero().flatten().tolist() == [eos], (name, j)
                continue
            for token in probe:
                assert bool(row[token] == 0) == state.deep_copy().consume_token(token), (name, j)
    assert bool((logits[7] == 0).all())
    for name in before:  # rolled back: the same masks again
        again = torch.zeros(1, vocab)
        batch.mask(again, [name])
        assert torch.equal(again[0], logits[starts[name]])


def test_the_grammar_wins_where_the_controls_leave_it_no_token(tokenizer_dir: Path) -> None:
    """Penalties can send every token a grammar allows to -inf (a repetition penalty of
    1e308 on seen tokens with negative logits: the server fuzz test found it); a row left
    with no allowed token is drawn from the logits before the controls, under the grammar
    alone, rather than from a row of -inf whose draw breaks the grammar."""
    import torch

    from iterserve.model.tokenizer import load_hf_tokenizer
    from iterserve.sample.structured import GrammarCompiler, StructuredBatch

    tokenizer = load_hf_tokenizer(tokenizer_dir)
    vocab = 49152
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    batch = StructuredBatch()
    for name in ("emptied", "kept"):
        batch.add(name, compiler.compile(StructuredOutput(choice=["red", "green"])))
    raw = torch.randn(2, vocab)
    allowed = raw.clone()
    batch.mask(allowed, ["emptied", "kept"])
    allowed = torch.isfinite(allowed)
    controlled = raw.clone()
    controlled[0, allowed[0]] = float("-inf")  # the controls took all the grammar allows
    controlled[1, ~allowed[1]] = 0.0  # and moved only tokens the grammar forbids
    expected_kept = controlled[1].masked_fill(~allowed[1], float("-inf"))
    batch.mask(controlled, ["emptied", "kept"], fallback=raw)
    assert torch.equal(controlled[0], raw[0].masked_fill(~allowed[0], float("-inf")))
    assert torch.equal(controlled[1], expected_kept)
