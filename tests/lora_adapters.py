"""LoRA adapters made with `peft` on a tiny checkpoint (random, B non-zero), and what
transformers + peft generate with them (fp32): the reference iterserve's adapters are
compared with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    targets: list[str]
    rank: int
    alpha: float
    rslora: bool = False


# Attention-only, all linear layers, and all linear with rsLoRA's scale and the highest rank.
SPECS = [
    AdapterSpec("attn", ATTENTION, 8, 16),
    AdapterSpec("mlp", ALL_LINEAR, 4, 8),
    AdapterSpec("rs", ALL_LINEAR, 16, 4, rslora=True),
]


def make_adapter(base_dir: Path, out: Path, spec: AdapterSpec, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=spec.targets,
        use_rslora=spec.rslora,
        init_lora_weights=False,  # B random too: an adapter that changes the output
    )
    model = get_peft_model(base, config)
    with torch.no_grad():  # big enough a change that greedy tokens differ from the base's
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    model.save_pretrained(out)
    return out


def make_adapters(base_dir: Path, out: Path) -> dict[str, Path]:
    return {
        spec.name: make_adapter(base_dir, out / spec.name, spec, seed)
        for seed, spec in enumerate(SPECS, start=1)
    }


@torch.inference_mode()
def peft_greedy(
    base_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """transformers (+ peft when `adapter`) greedy tokens and each one's logprob, fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        logprobs = [
            float(torch.log_softmax(step[0].float(), -1)[token])
            for step, token in zip(out.logits, tokens, strict=True)
        ]
        results.append((tokens, logprobs))
    return results
