"""Tiny random multimodal checkpoints with their vision towers, saved as transformers saves
them with the bundled tokenizer plus the family's image tokens, an image processor and a
chat template that writes the family's marker for an image part: Mistral 3 (Pixtral) and
Gemma 3 (SigLIP, whose image tokens attend to each other both ways); and what transformers'
own greedy generate makes of a prompt with images on each (fp32), built without iterserve's
code."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

from tiny_families import MINISTRAL3_ROPE
from tiny_gguf import llama_cpp_permute

# A multimodal checkpoint's tiny language model (the vocabulary and context set by each use).
TEXT_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)
IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
PATCH, MERGE = 14, 2
GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA3_IMAGE_ROWS = 16  # mm_tokens_per_image: 8 x 8 patches pooled 2 x 2
# Gemma 3 4B's: the full layers' RoPE scaled linearly, the sliding layers' plain.
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}


def template(marker: str) -> str:
    """A template that writes each content block in order, an image as `marker` (as
    Mistral's and Gemma's write theirs)."""
    return (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['content'] is string %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% else %}{{ m['role'] }}: {% for b in m['content'] %}"
        f"{{% if b['type'] == 'image' %}}{marker}{{% else %}}{{{{ b['text'] }}}}{{% endif %}}"
        "{% endfor %}\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )


def random_weights(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1) if "norm" not in name else param.uniform_(0.7, 1.3)
    return model.eval()


def save_tiny_mistral3(out: Path, tokenizer_dir: Path) -> Path:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    image_token = tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[0])
    text = transformers.Ministral3Config(
        **{**TEXT_SHAPE, "vocab_size": len(tokenizer) + 5, "max_position_embeddings": 512},
        rope_parameters=dict(MINISTRAL3_ROPE),
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = transformers.PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=16,
        image_size=112,
        patch_size=PATCH,
        hidden_act="silu",  # as Pixtral 12B's and Mistral Small 3.1's
    )
    config = transformers.Mistral3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=image_token,
        spatial_merge_size=MERGE,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    random_weights(transformers.Mistral3ForConditionalGeneration(config)).save_pretrained(out)
    tokenizer.chat_template = template(IMAGE_TOKENS[0])
    tokenizer.save_pretrained(out)
    PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size=PATCH).save_pretrained(out)
    return out


def gemma3_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerBase:
    names = dict(zip(("boi_token", "eoi_token", "image_token"), GEMMA3_TOKENS, strict=True))
    return transformers.AutoTokenizer.from_pretrained(directory, extra_special_tokens=names)


def save_tiny_gemma3(out: Path, tokenizer_dir: Path) -> Path:
    """Gemma 3 4B's shape in small: sliding layers (a window shorter than a prompt here)
    beside a full one, SigLIP, an image pooled to GEMMA3_IMAGE_ROWS soft tokens; saved with
    Gemma's own processor (Gemma3Processor over the Pillow image processor)."""
    tokenizer = gemma3_tokenizer(tokenizer_dir)
    ids = tokenizer.convert_tokens_to_ids(list(GEMMA3_TOKENS))
    text = transformers.Gemma3TextConfig(
        **{**TEXT_SHAPE, "vocab_size": len(tokenizer), "max_position_embeddings": 512},
        sliding_window=12,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=GEMMA3_ROPE,
        query_pre_attn_scalar=TEXT_SHAPE["head_dim"],  # as in 4B and 12B: the head's size
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=112, patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=GEMMA3_IMAGE_ROWS,
        boi_token_index=ids[0],
        eoi_token_index=ids[1],
        image_token_index=ids[2],
    )
    torch.manual_seed(0)
    random_weights(transformers.Gemma3ForConditionalGeneration(config)).save_pretrained(out)
    tokenizer.chat_template = template(GEMMA3_TOKENS[0])
    processor = transformers.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 112, "width": 112}),
        tokenizer=tokenizer,
        image_seq_length=GEMMA3_IMAGE_ROWS,
    )
    processor.save_pretrained(out)
    return out


def gemma3_greedy(
    directory: Path, text: str, images: list[Image.Image], max_tokens: int
) -> list[int]:
    """`text` holds <start_of_image> once per image; Gemma's processor lays the images out
    and marks their soft tokens (token_type_ids), by which transformers attends within each
    image both ways."""
    processor = transformers.Gemma3Processor.from_pretrained(
        directory, tokenizer=gemma3_tokenizer(directory)
    )
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32
    )
    generated = model.generate(
        **inputs, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
        pad_token_id=0,
    )  # fmt: skip
    return generated[0, inputs["input_ids"].shape[1] :].tolist()


def picture(seed: int, height: int, width: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_layout(size: tuple[int, int], tokens: list[int]) -> list[int]:
    """An image's tokens as Mistral's processor lays them out: a row of [IMG] per merged
    patch row, each ended by [IMG_BREAK], the last by [IMG_END]."""
    image, row_break, end = tokens
    height, width = (n // (PATCH * MERGE) for n in size)
    layout = ([image] * width + [row_break]) * height
    layout[-1] = end
    return layout


def transformers_greedy(
    directory: Path, text: str, images: list[Image.Image], max_tokens: int
) -> list[int]:
    """`text` holds [IMG] once per image and starts with the special tokens it needs."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokens = tokenizer.convert_tokens_to_ids(list(IMAGE_TOKENS))
    processor = PixtralImageProcessorPil.from_pretrained(directory)
    pixels = processor(images=images, patch_size=PATCH * MERGE, return_tensors="pt")
    pieces = text.split(IMAGE_TOKENS[0])
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        ids += tokenizer.encode(piece, add_special_tokens=False)
        if i < len(images):
            ids += image_layout(tuple(pixels["image_sizes"][i].tolist()), tokens)
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32
    )
    input_ids = torch.tensor([ids])
    generated = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        pixel_values=pixels["pixel_values"],
        image_sizes=pixels["image_sizes"],
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        pad_token_id=0,
    )
    return generated[0, len(ids) :].tolist()


def _mmproj_writer(
    path: Path,
    kind: str,
    model: transformers.PreTrainedModel,
    shape: dict[str, int],
    eps: float,
    processor: transformers.BaseImageProcessor,
    type_key: str = "clip.projector_type",
) -> gguf.GGUFWriter:
    """A vision projector file's header as llama.cpp's converter writes it (MmprojModel);
    `type_key`: where it says the projector's type (a file of vision and audio towers
    says each tower's: clip.vision.projector_type)."""
    vision = model.config.vision_config
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type("mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string(type_key, kind)
    writer.add_uint32("clip.vision.projection_dim", model.config.text_config.hidden_size)
    for key, value in {
        "image_size": getattr(vision, "image_size", 224),  # Gemma 4's: 224, "unused"
        "patch_size": vision.patch_size,
        "embedding_length": vision.hidden_size,
        "feed_forward_length": vision.intermediate_size,
        "block_count": vision.num_hidden_layers,
        "attention.head_count": vision.num_attention_heads,
        **shape,
    }.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", eps)
    writer.add_array("clip.vision.image_mean", list(processor.image_mean))
    writer.add_array("clip.vision.image_std", list(processor.image_std))
    return writer


def _write_parts(
    writer: gguf.GGUFWriter,
    layers: int,
    parts: dict[str, torch.nn.Module],
    stored: Callable[[str, torch.Tensor], np.ndarray | None],
) -> None:
    """Each part's tensors under llama.cpp's names (F32), as `stored(hf name, tensor)` makes
    them (None: left out), then the file closed."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(layers, 3))
    for prefix, module in parts.items():
        for name, value in module.state_dict().items():
            array = stored(prefix + name, value.detach().float())
            if array is None:
                continue
            theirs = (prefix + name).replace("_projection_weight", "_projection.weight")
            ours = names.get_name(theirs, try_suffixes=(".weight", ".bias"))
            assert ours is not None, theirs
            writer.add_tensor(ours, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gemma3_mmproj(path: Path, model: transformers.Gemma3ForConditionalGeneration) -> None:
    """The model's tower and projector as llama.cpp's converter writes Gemma 3's vision
    projector file (`convert_hf_to_gguf.py --mmproj`: its names, its metadata, the
    projector's norm stored as 1 + w), every tensor in F32."""
    vision = model.config.vision_config
    pool = vision.image_size // vision.patch_size // int(model.config.mm_tokens_per_image**0.5)
    processor = Gemma3ImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    shape = {"projector.scale_factor": pool}
    writer = _mmproj_writer(path, "gemma3", model, shape, vision.layer_norm_eps, processor)

    def stored(name: str, value: torch.Tensor) -> np.ndarray | None:
        if ".head." in name:
            return None  # SigLIP's pooling head, which the converter leaves out
        return (value + (1 if "soft_emb_norm" in name else 0)).numpy()

    parts = {
        "vision_tower.vision_model.": model.model.vision_tower,
        "multi_modal_projector.": model.model.multi_modal_projector,
    }
    _write_parts(writer, vision.num_hidden_layers, parts, stored)


def write_pixtral_mmproj(
    path: Path, model: transformers.Mistral3ForConditionalGeneration, directory: Path
) -> None:
    """The model's tower and projector as llama.cpp's converter writes Mistral 3's vision
    projector file (pixtral: its names and metadata, q/k rows permuted for its rope), every
    tensor in F32. Checked once by hand against llama.cpp 0.3.36's own `convert_hf_to_gguf.py
    --mmproj` on this checkpoint with 3 vision layers: the same tensors and metadata."""
    config, vision = model.config, model.config.vision_config
    processor = PixtralImageProcessorPil.from_pretrained(directory)
    shape = {"spatial_merge_size": config.spatial_merge_size}
    writer = _mmproj_writer(path, "pixtral", model, shape, 1e-5, processor)
    writer.add_bool(f"clip.use_{vision.hidden_act}", True)
    heads = vision.num_attention_heads

    def stored(name: str, value: torch.Tensor) -> np.ndarray | None:
        rope = name.endswith(("q_proj.weight", "k_proj.weight"))
        return llama_cpp_permute(value.numpy(), heads) if rope else value.numpy()

    parts = {
        "vision_tower.": model.model.vision_tower,
        "multi_modal_projector.": model.model.multi_modal_projector,
    }
    _write_parts(writer, vision.num_hidden_layers, parts, stored)


# Ollama's converter's renames of Gemma 3's tower and projector (convert/convert_gemma3.go),
# applied here one after the other.
_OLLAMA_RENAMES = (
    ("vision_tower.vision_model.embeddings", "v"), ("vision_tower.vision_model", "v"),
    ("encoder.layers", "blk"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"), ("self_attn.out_proj", "attn_output"),
    ("input_projection_weight", "input_projection.weight"), ("multi_modal_projector", "mm"),
)  # fmt: skip


def ollama_gemma3_tower(
    model: transformers.Gemma3ForConditionalGeneration,
) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """The model's tower and projector as Ollama's converter keeps them in the model's own
    GGUF: its `gemma3.vision.*` and `gemma3.mm.tokens_per_image` keys (without the arch's
    prefix) and its tensors (its names, F32, the projector's norm stored as 1 + w as it
    stores every non-vision `_norm.weight`)."""
    vision = model.config.vision_config
    keys: dict[str, object] = {
        "vision.block_count": vision.num_hidden_layers,
        "vision.embedding_length": vision.hidden_size,
        "vision.feed_forward_length": vision.intermediate_size,
        "vision.image_size": vision.image_size,
        "vision.patch_size": vision.patch_size,
        "vision.num_channels": 3,
        "vision.attention.head_count": vision.num_attention_heads,
        "vision.attention.layer_norm_epsilon": vision.layer_norm_eps,
        "mm.tokens_per_image": model.config.mm_tokens_per_image,
    }
    tensors = {}
    parts = {
        "vision_tower.vision_model.": model.model.vision_tower,
        "multi_modal_projector.": model.model.multi_modal_projector,
    }
    for prefix, module in parts.items():
        for name, value in module.state_dict().items():
            if name.startswith("head."):
                continue  # SigLIP's pooling head: not Gemma's
            ours = prefix + name
            for old, new in _OLLAMA_RENAMES:
                ours = ours.replace(old, new)
            norm = not ours.startswith("v.") and ours.endswith("_norm.weight")
            tensors[ours] = (value.detach().float() + (1 if norm else 0)).numpy()
    return keys, tensors


GEMMA4_TOKENS = ("<|image|>", "<|image>", "<image|>")  # the image's soft token, boi, eoi
GEMMA4_MAX_SOFT_TOKENS = 70  # the smallest budget the processor takes


def save_tiny_gemma4(
    out: Path, tokenizer_dir: Path, max_soft_tokens: int = GEMMA4_MAX_SOFT_TOKENS
) -> Path:
    """Gemma 4 E2B's shape in small (per-layer embeddings, K/V shared between layers,
    windowed and full layers), with a tiny Gemma 4 vision tower: an image resized within
    `max_soft_tokens` rows of 3 x 3 pooled 16-pixel patches."""
    from tiny_families import gemma4_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA4_TOKENS)})
    ids = tokenizer.convert_tokens_to_ids(list(GEMMA4_TOKENS))
    vocab = len(tokenizer)
    text = gemma4_model("e2b", vocab_size=vocab, vocab_size_per_layer_input=vocab).config
    text.max_position_embeddings = 1024
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, position_embedding_size=640,  # a side: <= 630 patches
        use_clipped_linears=True, standardize=True,  # their buffers read from the checkpoint
    )  # fmt: skip
    config = transformers.Gemma4Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        audio_config=None,
        image_token_id=ids[0],
        boi_token_id=ids[1],
        eoi_token_id=ids[2],
    )
    torch.manual_seed(0)
    model = random_weights(transformers.Gemma4ForConditionalGeneration(config))
    with torch.no_grad():  # buffers transformers leaves at one, infinite or unset
        for layer in model.model.language_model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
        for name, buffer in model.model.vision_tower.named_buffers():
            if name.endswith(("_min", "_max")):  # clipped linears: clamps that bite
                buffer.fill_(
                    float(torch.empty(()).uniform_(1.0, 3.0)) * (-1 if "min" in name else 1)
                )
        model.model.vision_tower.std_bias.normal_(0.0, 0.1)
        model.model.vision_tower.std_scale.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tokenizer.chat_template = template(GEMMA4_TOKENS[0])
    tokenizer.save_pretrained(out)
    Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens).save_pretrained(out)
    return out


def gemma4_greedy(
    directory: Path, text: str, images: list[Image.Image], max_tokens: int
) -> list[int]:
    """`text` holds <|image|> once per image (and its special tokens); each becomes the
    image's boi, soft tokens and eoi, as Gemma4Processor lays it out, and transformers'
    whole model generates from the ids, pixels and patch positions."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    image, boi, eoi = tokenizer.convert_tokens_to_ids(list(GEMMA4_TOKENS))
    pixels = Gemma4ImageProcessorPil.from_pretrained(directory)(images=images, return_tensors="pt")
    ids: list[int] = []
    for i, piece in enumerate(text.split(GEMMA4_TOKENS[0])):
        ids += tokenizer.encode(piece, add_special_tokens=False)
        if i < len(images):
            ids += [boi, *[image] * int(pixels["num_soft_tokens_per_image"][i]), eoi]
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32
    )
    input_ids = torch.tensor([ids])
    generated = model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
        pixel_values=pixels["pixel_values"], image_position_ids=pixels["image_position_ids"],
        do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0,
    )  # fmt: skip
    return generated[0, len(ids) :].tolist()


def write_gemma4_mmproj(path: Path, model: transformers.Gemma4ForConditionalGeneration) -> None:
    """The model's vision tower and embedder as llama.cpp's converter writes Gemma 4's
    projector file (gemma4v under clip.vision.projector_type, its image size "unused" 224;
    the patch projection as a convolution's kernel, each clamp a one-value tensor, the
    encoder's layers renamed before its map names them), every tensor in F32."""
    vision = model.config.vision_config
    processor = Gemma4ImageProcessorPil()  # its mean 0 and deviation 1: pixels as they are
    writer = _mmproj_writer(
        path, "gemma4v", model, {}, vision.rms_norm_eps, processor, "clip.vision.projector_type"
    )
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision.num_hidden_layers, 3))
    suffixes = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
    for name, value in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.embed_vision.")):
            continue
        data = value.detach().float()
        if data.ndim == 0:
            data = data.unsqueeze(0)
        name = name.replace("model.vision_tower.encoder.", "vision_model.model.")
        name = name.replace(".linear.weight", ".weight")
        if name.endswith("position_embedding_table"):
            name += ".weight"
        if name.endswith("patch_embedder.input_proj.weight"):
            patch = vision.patch_size
            data = data.reshape(len(data), patch, patch, 3).permute(0, 3, 1, 2)
        ours = names.get_name(name, try_suffixes=suffixes)
        assert ours is not None, name
        writer.add_tensor(ours, np.ascontiguousarray(data.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
