"""A gpt-oss GGUF rewritten as OpenAI ships gpt-oss: an HF directory whose experts are MXFP4
`_blocks`/`_scales` pairs and whose other weights are bf16, in shards with an index, and a
config.json with `quantization_config: {"quant_method": "mxfp4"}`. The experts' blocks keep
their exact values (nibbles put back in OpenAI's order: model/safetensors_mxfp4.py says
how); the rest is the GGUF's dequantized to bf16. So big_models.py can run the same model
from both files (`--files GGUF,DIR --engines iterserve`): load time, memory and speed of the
HF road against the GGUF's. Written a few layers a shard, so no more than a shard is held.

    .venv/bin/python benchmarks/openai_layout.py \\
        ~/.cache/iterserve-bench/big_models/gpt-oss-20b-real-vocab-random-blocks.MXFP4_MOE.gguf
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from iterserve.bench.transformers_checkpoint import hf_config_json
from iterserve.model.loader import load_model

LAYERS_A_SHARD = 4


def openai_blocks(gguf_rows: np.ndarray, inputs: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 rows [rows, inputs / 32 x 17] as OpenAI's blocks [rows, inputs / 32, 16]
    (input 2i in byte i's low nibble) and E8M0 scales [rows, inputs / 32]."""
    blocks = gguf_rows.reshape(len(gguf_rows), inputs // 32, 17)
    codes = blocks[..., 1:]
    values = np.concatenate((codes & 15, codes >> 4), axis=-1)  # GGUF: inputs i, i + 16
    return values[..., 0::2] | (values[..., 1::2] << 4), blocks[..., 0]


def layer_experts(loaded: object, layer: int, experts: int) -> dict[str, torch.Tensor]:
    """A layer's expert stacks in OpenAI's layout: gate_up's rows interleave gate's and up's."""
    prefix = f"model.layers.{layer}.mlp.experts"
    quantized = loaded.quantized  # type: ignore[attr-defined]
    weights = loaded.weights  # type: ignore[attr-defined]
    out: dict[str, torch.Tensor] = {}
    for stack, projections in (
        ("gate_up_proj", ("gate_proj", "up_proj")),
        ("down_proj", ("down_proj",)),
    ):
        codes, scales = [], []
        for e in range(experts):
            parts = [quantized[f"{prefix}.{e}.{p}.weight"] for p in projections]
            pairs = [openai_blocks(part.read(), part.shape[1]) for part in parts]
            codes.append(
                np.stack([c for c, _ in pairs], axis=1).reshape(-1, *pairs[0][0].shape[1:])
            )
            scales.append(np.stack([s for _, s in pairs], axis=1).reshape(-1, pairs[0][1].shape[1]))
        out[f"{prefix}.{stack}_blocks"] = torch.from_numpy(np.ascontiguousarray(np.stack(codes)))
        out[f"{prefix}.{stack}_scales"] = torch.from_numpy(np.ascontiguousarray(np.stack(scales)))
        biases = [
            torch.stack([weights[f"{prefix}.{e}.{p}.bias"] for p in projections], dim=-1).flatten()
            for e in range(experts)
        ]
        out[f"{prefix}.{stack}_bias"] = torch.stack(biases).bfloat16().contiguous()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: beside the GGUF, named -openai"
    )
    args = parser.parse_args()
    gguf = args.gguf.expanduser()
    out = args.out or gguf.with_name(gguf.stem + "-openai")
    start = time.perf_counter()
    loaded = load_model(gguf, torch.bfloat16)
    config = loaded.config
    if config.architecture != "gpt_oss":
        raise SystemExit(f"{gguf} is {config.architecture}, not gpt-oss")
    out.mkdir(parents=True, exist_ok=True)
    expert_names = {name for name in loaded.weights if ".mlp.experts." in name}
    dense = [name for name in loaded.weights if name not in expert_names]
    layers = config.num_hidden_layers
    shards = [
        list(range(i, min(i + LAYERS_A_SHARD, layers))) for i in range(0, layers, LAYERS_A_SHARD)
    ]
    weight_map: dict[str, str] = {}
    for index, shard_layers in enumerate(shards):
        shard = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for layer in shard_layers:
            tensors.update(layer_experts(loaded, layer, config.num_local_experts))
            mine = [n for n in dense if n.startswith(f"model.layers.{layer}.")]
            tensors.update({n: loaded.weights[n].bfloat16().contiguous() for n in mine})
        if index == len(shards) - 1:  # the rest: embedding, final norm, head
            rest = [n for n in dense if not n.startswith("model.layers.")]
            tensors.update({n: loaded.weights[n].bfloat16().contiguous() for n in rest})
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        print(
            f"{shard}: layers {shard_layers[0]}-{shard_layers[-1]}, {len(tensors)} tensors",
            flush=True,
        )
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    raw = hf_config_json(config)
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    raw["eos_token_id"] = list(config.eos_token_ids)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    loaded.tokenizer.save_pretrained(out)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out}: {size / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
