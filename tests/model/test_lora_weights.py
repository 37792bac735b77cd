"""A llama.cpp LoRA GGUF reads as the PEFT adapter it was converted from: llama.cpp's names
and alpha, and its "llama" converter's rope permutation of q and k rows (B's rows, A's not)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file

from hub_cache import cache_repo
from iterserve.model.lora_weights import LoRAError, load_adapter
from lora_adapters import SPECS
from tiny_checkpoints import model_config_of, tiny_hf_model

_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


def _llama_cpp_permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's reordering of q/k rows for its pairwise rope."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(rows.shape)
    )


def _to_gguf(adapter: Path, out: Path, heads: int, kv_heads: int, alpha: float) -> Path:
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, tensor in load_file(adapter / "adapter_model.safetensors").items():
        parts = name.split(".")  # base_model.model.model.layers.{i}.{attn|mlp}.{proj}.lora_X.weight
        layer, proj, which = parts[4], parts[6], parts[7][-1].lower()
        if which == "b" and proj in ("q_proj", "k_proj"):
            tensor = _llama_cpp_permute(tensor, heads if proj == "q_proj" else kv_heads)
        writer.add_tensor(
            f"blk.{layer}.{_GGUF_NAMES[proj]}.weight.lora_{which}",
            tensor.numpy().astype(np.float32),
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_llama_cpp_gguf_reads_as_its_peft_adapter(
    tiny_llama_adapters: dict[str, Path], tmp_path: Path
) -> None:
    config = model_config_of(tiny_hf_model("llama", vocab_size=256))
    spec = SPECS[1]  # every linear layer, alpha / r
    peft = load_adapter(tiny_llama_adapters[spec.name], config)
    path = _to_gguf(
        tiny_llama_adapters[spec.name],
        tmp_path / "a.gguf",
        config.num_attention_heads,
        config.num_key_value_heads,
        spec.alpha,
    )
    converted = load_adapter(path, config)
    assert converted.modules.keys() == peft.modules.keys()
    for name, module in peft.modules.items():
        assert torch.allclose(converted.modules[name].a, module.a), name
        assert torch.allclose(converted.modules[name].b, module.b, atol=1e-6), name
    (tmp_path / "weights.bin").write_bytes(b"x")
    for bad in (tmp_path / "weights.bin", tmp_path / "missing"):
        try:
            load_adapter(bad, config)
        except LoRAError as error:
            assert str(bad) in str(error)
        else:
            raise AssertionError(f"{bad} was read as an adapter")


def test_an_adapter_is_found_by_its_repository_in_the_hugging_face_cache(
    tiny_llama_adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As vLLM's --lora-modules NAME=OWNER/REPO: a PEFT repository's snapshot, or the one
    GGUF adapter of a llama.cpp LoRA repository, where `hf download` left them."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    config = model_config_of(tiny_hf_model("llama", vocab_size=256))
    spec = SPECS[1]
    peft_dir = tiny_llama_adapters[spec.name]
    cache_repo(tmp_path / "hub", "acme/sql-lora", {p.name: p for p in peft_dir.iterdir()})
    heads = (config.num_attention_heads, config.num_key_value_heads)
    gguf_file = _to_gguf(peft_dir, tmp_path / "sql-F32-LoRA.gguf", *heads, spec.alpha)
    cache_repo(tmp_path / "hub", "acme/sql-lora-GGUF", {gguf_file.name: gguf_file})
    expected = load_adapter(peft_dir, config)
    for name in ("acme/sql-lora", "acme/sql-lora-GGUF"):
        found = load_adapter(name, config)
        assert found.modules.keys() == expected.modules.keys()
        for module, weights in expected.modules.items():
            assert torch.allclose(found.modules[module].b, weights.b, atol=1e-6), (name, module)
    with pytest.raises(LoRAError, match="hf download acme/none"):
        load_adapter("acme/none", config)
