"""Prompts with images against transformers' whole model on the same weights (tiny random
checkpoints, fp32): Mistral 3's Pixtral tower, Gemma 3's SigLIP, whose image tokens
attend to each other both ways, and Gemma 4 E2B's tower, its images of their own aspect
ratios; the tower's rows given at the image tokens, through compiled
token steps, small chunks (ending inside Mistral's images; Gemma's taken whole) and
preemption; the prefix cache names an image's blocks by its pixels; and what cannot be taken
is refused by name."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import pytest
import transformers
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from iterserve import LLM, SamplingParams
from iterserve.engine.images import ImagesPrompt
from iterserve.sampling_params import InvalidRequestError
from tiny_qwen_vl import (
    QWEN3VL_MARKER,
    QWEN3VL_PIXELS,
    qwen_vl_greedy,
    save_tiny_qwen3vl,
    save_tiny_qwen25vl,
)
from tiny_vision import (
    PATCH,
    gemma3_greedy,
    gemma4_greedy,
    picture,
    save_tiny_gemma3,
    save_tiny_gemma4,
    save_tiny_mistral3,
    transformers_greedy,
)

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Images of other sizes and shapes: 2 x 2, 1 x 2 and 2 x 1 merged patches (with the bos).
ONE = ("<s>user: Describe [IMG] in a few words.\nassistant:", [(0, 50, 60)])
TWO = ("<s>user: [IMG] and then [IMG], which is larger?\nassistant:", [(1, 20, 50), (2, 56, 30)])


@pytest.fixture(scope="module")
def mistral3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_mistral3(tmp_path_factory.mktemp("mistral3"), tokenizer_dir)


@pytest.fixture(scope="module")
def references(mistral3_dir: Path) -> list[list[int]]:
    return [
        transformers_greedy(mistral3_dir, text, [picture(*s) for s in sizes], MAX_TOKENS)
        for text, sizes in (ONE, TWO)
    ]


def _prompts() -> list[dict]:
    return [
        {"prompt": text, "multi_modal_data": {"image": [picture(*s) for s in sizes]}}
        for text, sizes in (ONE, TWO)
    ]


@pytest.mark.parametrize(
    "settings",
    [
        {"compile": True},  # token steps compiled; the image chunks run eager
        {"max_num_batched_tokens": 3, "max_num_seqs": 3},  # chunks end inside the images
        {"num_kv_blocks": 14, "block_size": 4},  # preemption: the images computed again
    ],
    ids=["default", "chunked", "preemption"],
)
def test_images_answer_as_transformers(
    mistral3_dir: Path, references: list[list[int]], settings: dict
) -> None:
    llm = LLM(str(mistral3_dir), dtype="float32", **{"compile": False, **settings})
    outputs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == references
    assert llm.engine.scheduler.kv_cache_stats().num_used_blocks == 0, "every block back"
    if "num_kv_blocks" in settings:
        assert llm.engine.scheduler.num_preemptions > 0


# Gemma 3: the image pooled to 16 soft tokens; a window of 12 cuts into it.
GEMMA3_PROMPTS = [
    ("<s>user: Describe <start_of_image> in a few words.\nassistant:", [(0, 50, 60)]),
    (
        "<s>user: <start_of_image> then <start_of_image>: which?\nassistant:",
        [(1, 20, 50), (2, 90, 30)],
    ),
]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), tokenizer_dir)


@pytest.mark.parametrize(
    "settings",
    [
        {},  # eager (the compiled token steps are Mistral's case: images run eager anyway)
        {"max_num_batched_tokens": 3, "max_num_seqs": 3},  # an image's 16 tokens in one chunk
        {"num_kv_blocks": 22, "block_size": 4},  # preemption
    ],
    ids=["eager", "chunked", "preemption"],
)
def test_gemma3_images_attend_within_themselves_as_transformers(
    gemma3_dir: Path, settings: dict
) -> None:
    want = [
        gemma3_greedy(gemma3_dir, text, [picture(*s) for s in sizes], MAX_TOKENS)
        for text, sizes in GEMMA3_PROMPTS
    ]
    _answers_as(gemma3_dir, GEMMA3_PROMPTS, want, settings)


def _answers_as(
    directory: Path, cases: list[tuple[str, list]], want: list[list[int]], settings: dict
) -> None:
    """The engine under `settings` answers each (prompt, image sizes) as `want` says, gives
    every block back, and preempts where its pool is cut short."""
    llm = LLM(str(directory), dtype="float32", **{"compile": False, **settings})
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": [picture(*s) for s in sizes]}}
        for text, sizes in cases
    ]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == want
    assert llm.engine.scheduler.kv_cache_stats().num_used_blocks == 0, "every block back"
    if "num_kv_blocks" in settings:
        assert llm.engine.scheduler.num_preemptions > 0


# Gemma 4's images keep their aspect ratio (81 and 131 prompt tokens in all).
GEMMA4_PROMPTS = [
    ("<s>user: Describe <|image|> in a few words.\nassistant:", [(0, 50, 60)]),
    ("<s>user: <|image|> or <|image|>, which?\nassistant:", [(1, 40, 45), (2, 30, 90)]),
]


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_gemma4(tmp_path_factory.mktemp("gemma4"), tokenizer_dir)


@pytest.fixture(scope="module")
def gemma4_references(gemma4_dir: Path) -> list[list[int]]:
    return [
        gemma4_greedy(gemma4_dir, text, [picture(*s) for s in sizes], MAX_TOKENS)
        for text, sizes in GEMMA4_PROMPTS
    ]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_num_batched_tokens": 5, "max_num_seqs": 3},  # chunks end inside the images
        {"num_kv_blocks": 55, "block_size": 4},  # preemption
    ],
    ids=["whole", "chunked", "preemption"],
)
def test_gemma4_images_answer_as_transformers(
    gemma4_dir: Path, gemma4_references: list[list[int]], settings: dict
) -> None:
    """Gemma 4 E2B's shape (per-layer embeddings, looked up as padding at an image's soft
    tokens; K/V shared between layers) with its vision tower."""
    _answers_as(gemma4_dir, GEMMA4_PROMPTS, gemma4_references, settings)


# Qwen3-VL's images keep their aspect ratio: 1 x 3, 3 x 2, 2 x 2, 3 x 1 and 4 x 4 merged
# patches (21, 29 and 38 prompt tokens in all).
QWEN3VL_PROMPTS = [
    (f"<s>user: Describe {QWEN3VL_MARKER} in a few words.\nassistant:", [(0, 40, 100)]),
    (
        f"<s>user: {QWEN3VL_MARKER} or {QWEN3VL_MARKER}, which?\nassistant:",
        [(1, 90, 60), (2, 64, 64)],
    ),
    (
        f"<s>user: {QWEN3VL_MARKER} then {QWEN3VL_MARKER}: which?\nassistant:",
        [(3, 100, 40), (4, 130, 130)],
    ),
]


@pytest.fixture(scope="module")
def qwen3vl_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_qwen3vl(tmp_path_factory.mktemp("qwen3vl"), tokenizer_dir)


@pytest.fixture(scope="module")
def qwen3vl_references(qwen3vl_dir: Path) -> list[list[int]]:
    return [
        qwen_vl_greedy(qwen3vl_dir, text, [picture(*s) for s in sizes], MAX_TOKENS)
        for text, sizes in QWEN3VL_PROMPTS
    ]


@pytest.mark.parametrize(
    "settings",
    [
        {"compile": True},  # the text after the images compiled, turned by shifted positions
        {"max_num_batched_tokens": 5, "max_num_seqs": 3},  # chunks end inside the images
        {"num_kv_blocks": 14, "block_size": 4},  # preemption
    ],
    ids=["whole", "chunked", "preemption"],
)
def test_qwen3vl_images_answer_as_transformers(
    qwen3vl_dir: Path, qwen3vl_references: list[list[int]], settings: dict
) -> None:
    """Qwen3-VL: an image's tokens turned by their grid positions (M-RoPE), the text after
    it by positions that go on from the grid's, the tower's DeepStack rows added after the
    first layers."""
    _answers_as(qwen3vl_dir, QWEN3VL_PROMPTS, qwen3vl_references, settings)


@pytest.fixture(scope="module")
def qwen25vl_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl"), tokenizer_dir)


@pytest.fixture(scope="module")
def qwen25vl_references(qwen25vl_dir: Path) -> list[list[int]]:
    return [
        qwen_vl_greedy(qwen25vl_dir, text, [picture(*s) for s in sizes], MAX_TOKENS)
        for text, sizes in QWEN3VL_PROMPTS
    ]


@pytest.mark.parametrize(
    "settings",
    [{}, {"max_num_batched_tokens": 5, "max_num_seqs": 3}, {"num_kv_blocks": 14, "block_size": 4}],
    ids=["whole", "chunked", "preemption"],
)
def test_qwen25vl_images_answer_as_transformers(
    qwen25vl_dir: Path, qwen25vl_references: list[list[int]], settings: dict
) -> None:
    """Qwen2.5-VL as its released files are: Qwen2's layers, M-RoPE's frequencies a run
    each, a tower attending within windows on most layers (28-pixel units: the same images
    take other grids)."""
    _answers_as(qwen25vl_dir, QWEN3VL_PROMPTS, qwen25vl_references, settings)


def test_qwen3vl_image_max_tokens_and_images_run_together(
    qwen3vl_dir: Path, tmp_path: Path
) -> None:
    """--image-max-tokens answers as a processor whose pixel bound says the same (a 130 x 130
    image's 4 x 4 merged patches capped at 4: 2 x 2); two images whose tokens would run
    together, with no text between them to tell them apart, are refused by name."""
    capped = tmp_path / "qwen3vl-4"
    shutil.copytree(qwen3vl_dir, capped)
    Qwen2VLImageProcessorPil(
        patch_size=16, size={**QWEN3VL_PIXELS, "longest_edge": 4 * 32 * 32},
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    ).save_pretrained(capped)  # fmt: skip
    text, image = QWEN3VL_PROMPTS[0][0], picture(4, 130, 130)
    llm = LLM(str(qwen3vl_dir), dtype="float32", compile=False, image_max_tokens=4)
    answer = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False
    )[0]
    assert answer.token_ids == qwen_vl_greedy(capped, text, [image], MAX_TOKENS)
    assert answer.prompt_token_ids.count(llm.engine.images.encoder.image_token_id) == 4
    together = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
    prompt = {"prompt": together, "multi_modal_data": {"image": [image, image]}}
    with pytest.raises(InvalidRequestError, match="each image's tokens must stand apart"):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_a_gemma4_whose_images_attend_both_ways_serves_its_text(
    gemma4_dir: Path, tmp_path: Path
) -> None:
    """The larger Gemma 4's images attend both ways on the windowed layers alone, which is
    not read: the text is served, an image refused by name."""
    shutil.copytree(gemma4_dir, tmp_path / "both-ways")
    config = json.loads((tmp_path / "both-ways" / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (tmp_path / "both-ways" / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path / "both-ways"), dtype="float32", compile=False)
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    text, sizes = GEMMA4_PROMPTS[0]
    prompt = {"prompt": text, "multi_modal_data": {"image": [picture(*sizes[0])]}}
    with pytest.raises(InvalidRequestError, match="images"):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_image_max_tokens_is_a_processor_that_says_so(
    mistral3_dir: Path,
    gemma4_references: list[list[int]],
    tmp_path: Path,
    tokenizer_dir: Path,
) -> None:
    """--image-max-tokens answers as a checkpoint whose processor says the same: Mistral 3's
    longer side cut (a 100 x 90 image's 4 x 4 merged patches capped at 4: 2 x 2), Gemma 4's
    budget the largest that fits (280 rows capped at 100: 70, the tiny one's own)."""
    capped = tmp_path / "mistral3-56px"
    shutil.copytree(mistral3_dir, capped)
    PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size=PATCH).save_pretrained(capped)
    text, image = "<s>user: Describe [IMG] in a few words.\nassistant:", picture(3, 100, 90)
    llm = LLM(str(mistral3_dir), dtype="float32", compile=False, image_max_tokens=4)
    prompt = {"prompt": text, "multi_modal_data": {"image": [image]}}
    answer = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert answer.outputs[0].token_ids == transformers_greedy(capped, text, [image], MAX_TOKENS)
    assert answer.prompt_token_ids.count(llm.engine.images.encoder.image_token_id) == 4
    wide = save_tiny_gemma4(tmp_path / "gemma4-280", tokenizer_dir, max_soft_tokens=280)
    llm = LLM(str(wide), dtype="float32", compile=False, image_max_tokens=100)
    text, sizes = GEMMA4_PROMPTS[0]
    prompt = {"prompt": text, "multi_modal_data": {"image": [picture(*sizes[0])]}}
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == gemma4_references[0]


def test_a_chat_with_an_image_url_answers_as_transformers(mistral3_dir: Path) -> None:
    image = picture(3, 40, 90)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "text", "text": "Describe "}, {"type": "text", "text": " briefly."}]
    content = [parts[0], {"type": "image_url", "image_url": {"url": url}}, parts[1]]
    llm = LLM(str(mistral3_dir), dtype="float32", compile=False)
    chat = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(mistral3_dir)
    as_template_takes = [{"role": "user", "content": [parts[0], {"type": "image"}, parts[1]]}]
    text = tokenizer.apply_chat_template(
        as_template_takes, add_generation_prompt=True, tokenize=False
    )
    want = transformers_greedy(mistral3_dir, text, [image], MAX_TOKENS)
    assert chat[0].outputs[0].token_ids == want
    given = [parts[0], {"type": "image_pil", "image_pil": image}, parts[1]]  # vLLM's
    again = llm.chat([{"role": "user", "content": given}], GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == want


def test_the_prefix_cache_names_an_image_by_its_pixels(mistral3_dir: Path) -> None:
    """The same image hits its blocks; another image behind the same text hits only the
    blocks before it, and answers as in a fresh engine."""
    llm = LLM(str(mistral3_dir), dtype="float32", compile=False, block_size=4)
    text = "<s>user: a long enough question about the picture: [IMG] what is it?\nassistant:"
    start = llm.engine.images.prompt(ImagesPrompt(text, (picture(0, 50, 60),), True))
    first_image = start.embeds.first_position
    first = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": picture(0, 50, 60)}}, GREEDY
    )
    again = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": picture(0, 50, 60)}}, GREEDY
    )
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert again[0].num_cached_tokens > first_image, "past the image, its blocks hit"
    other = {"prompt": text, "multi_modal_data": {"image": picture(5, 50, 60)}}
    hit = llm.generate(other, GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == first_image // 4 * 4, "the blocks before the image only"
    alone = LLM(str(mistral3_dir), dtype="float32", compile=False).generate(other, GREEDY)
    assert hit.outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_what_images_cannot_be_is_refused_by_name(mistral3_dir: Path, tiny_llama_dir: Path) -> None:
    llm = LLM(str(mistral3_dir), dtype="float32", compile=False)
    with pytest.raises(InvalidRequestError, match="1 images but 2 places") as refused:
        llm.generate({"prompt": "[IMG][IMG]", "multi_modal_data": {"image": picture(0, 30, 30)}})
    assert refused.value.param == "prompt"
    for url, why in [
        ("https://example.com/cat.png", "fetches no https URL"),
        ("data:image/png;base64,bm90IGFuIGltYWdl", "not an image file"),
        ("data:image/png,raw", "must be base64"),
    ]:
        content = [{"type": "image_url", "image_url": {"url": url}}]
        with pytest.raises(InvalidRequestError, match=why) as refused:
            llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
        assert refused.value.param == "messages.0.content.0.image_url"
    text_only = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    with pytest.raises(InvalidRequestError, match="takes no images") as refused:
        text_only.generate({"prompt": "[IMG]", "multi_modal_data": {"image": picture(0, 30, 30)}})
    assert refused.value.param == "images"


def test_an_image_sent_again_is_not_encoded_again(mistral3_dir: Path) -> None:
    """A chat sends its image at every turn: the engine keeps the last few encoded."""
    llm = LLM(str(mistral3_dir), dtype="float32", compile=False)
    images = llm.engine.images
    encoded = []
    encode = images.encoder.encode
    images.encoder.encode = lambda image: encoded.append(image) or encode(image)  # type: ignore[method-assign]
    text = "<s>user: [IMG] what?\nassistant:"
    for seed in (0, 0, 1, 0):  # the same pixels, another image, the first again
        llm.generate({"prompt": text, "multi_modal_data": {"image": picture(seed, 40, 40)}}, GREEDY)
    assert len(encoded) == 2
