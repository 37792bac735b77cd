"""A Gemma 3 GGUF with its vision projector file (llama.cpp's `--mmproj`): the tower and
projector read from llama.cpp's names and metadata answer a prompt with images as the same
weights do from their HF checkpoint (fp32); a file that is not Gemma 3's projector is
refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from iterserve import LLM, SamplingParams
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_images import load_mmproj
from iterserve.model.loader import load_model
from tiny_families import gguf_metadata
from tiny_gguf import write_gguf
from tiny_vision import picture, save_tiny_gemma3, write_gemma3_mmproj

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# No punctuation right after an image: the test GGUF's tokenizer (tiny_gguf, a "default"
# pre-tokenizer) splits "\n\n," otherwise than the bundled tokenizer.json does.
PROMPT = "<s>user: <start_of_image> and <start_of_image> which one?\nassistant:"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, ...]:
    out = tmp_path_factory.mktemp("gemma3-gguf")
    directory = save_tiny_gemma3(out / "hf", tokenizer_dir)
    whole = transformers.Gemma3ForConditionalGeneration.from_pretrained(directory).eval()
    text = transformers.Gemma3ForCausalLM(whole.config.text_config)
    text.model.load_state_dict(whole.model.language_model.state_dict())
    text.lm_head.load_state_dict(whole.lm_head.state_dict())
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    metadata, _ = gguf_metadata(text)
    write_gguf(
        out / "text.gguf", "gemma3", text.eval(), tokenizer, rope_freq_base=1e6, metadata=metadata
    )
    write_gemma3_mmproj(out / "mmproj.gguf", whole)
    return directory, out / "text.gguf", out / "mmproj.gguf"


def test_a_gguf_and_its_mmproj_answer_as_the_hf_checkpoint(files: tuple[Path, ...]) -> None:
    directory, text, mmproj = files
    prompt = {
        "prompt": PROMPT,
        "multi_modal_data": {"image": [picture(4, 70, 40), picture(5, 30, 30)]},
    }
    from_hf = LLM(str(directory), dtype="float32", compile=False)
    from_gguf = LLM(str(text), mmproj=str(mmproj), dtype="float32", compile=False)
    want = from_hf.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert from_gguf.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


def test_what_is_not_gemma3s_projector_is_refused(files: tuple[Path, ...], tmp_path: Path) -> None:
    _, text, _ = files
    loaded = load_model(text, torch.float32)
    with pytest.raises(ModelLoadError, match="not a vision projector"):
        load_mmproj(text, loaded.config, loaded.tokenizer, torch.float32)
    with pytest.raises(ModelLoadError, match="a 'pixtral' projector"):
        import gguf

        writer = gguf.GGUFWriter(tmp_path / "other.gguf", "clip")
        writer.add_string("clip.projector_type", "pixtral")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        load_mmproj(tmp_path / "other.gguf", loaded.config, loaded.tokenizer, torch.float32)
