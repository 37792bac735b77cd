"""Tensor parallelism for the Llama family (Megatron-style): what one rank holds and the
one collective its layers call.

Each of T ranks holds whole KV heads (T divides the KV heads) and the query heads of their
groups, so attention runs rank-locally on its own slice of the paged KV cache. q/k/v and
gate/up are split by output rows (column-parallel); o_proj and down_proj by input columns
(row-parallel), whose partial products one all-reduce sums: one after attention, one after
the MLP. Norms and RoPE are replicated. Mixtral's and Qwen3-MoE's experts are each split the same way
(the router replicated), so an MoE layer also ends in one all-reduce. The embedding and the LM
head stay replicated too: at the sizes this engine serves they are a small share of the
weights, and keeping them whole spares a gather of logits every step (only rank 0, which
samples, runs the head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from iterserve.config import ConfigError
from iterserve.model.config import ModelConfig
from iterserve.model.moe import EXPERT_NAMES

TP_FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks, and the group the layers all-reduce over."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None: torch.distributed's default group

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial products, in place."""
        dist.all_reduce(partial, group=self.group)
        return partial


def check_shardable(config: ModelConfig, size: int) -> None:
    """Refuse a size the model's shapes do not divide by, naming the flag and the counts."""
    if size < 1:
        raise ConfigError(f"{TP_FLAG} must be at least 1, got {size}")
    traits = config.traits
    one_rank = (
        traits.fused_checkpoint
        or traits.sandwich_norms
        or traits.attention_sinks
        or traits.qk_norm_whole
        or config.shared_expert_intermediate_size > 0
        or config.conv_history > 0
    )
    if size > 1 and one_rank:
        # Fused checkpoint projections would need splitting per rank, sandwich norms and q/k
        # norms over all heads (OLMoE) an all-reduce before the norm, sinks and expert biases
        # their own shares (gpt-oss), a shared expert (Qwen2-MoE) or a short convolution
        # (LFM2) its slices: none is written.
        raise ConfigError(f"{TP_FLAG} {size}: {config.architecture} runs on one rank only")
    counts = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{name}={count}" for name, count in counts.items() if count % size]
    if bad:
        raise ConfigError(
            f"{TP_FLAG} {size} does not divide this model's {', '.join(bad)}: each rank must "
            f"hold whole KV heads and an equal share of the heads and MLP (model has "
            f"{config.num_attention_heads} attention heads, {config.num_key_value_heads} KV "
            f"heads, intermediate size {config.intermediate_size})"
        )


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank's network has: 1/size of the heads and of the MLP width."""
    check_shardable(config, size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size,
        intermediate_size=config.intermediate_size // size,
    )


def shard_weights(
    weights: Mapping[str, torch.Tensor], config: ModelConfig, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of HF-named weights (copies, so the full tensors may be freed).

    Contiguous slices are right for GQA: query heads are stored grouped by their KV head, so
    rank r's KV heads [r*kv/T, (r+1)*kv/T) own exactly query heads [r*H/T, (r+1)*H/T).
    """
    check_shardable(config, size)
    q_rows = config.num_attention_heads * config.head_dim // size
    kv_rows = config.num_key_value_heads * config.head_dim // size
    inter = config.intermediate_size // size
    experts = EXPERT_NAMES.get(config.architecture) if config.num_local_experts else None

    def is_expert(name: str, *projections: Literal["gate", "up", "down"]) -> bool:
        # Each rank holds every expert, split like the dense MLP, so a token's experts all
        # run on every rank over its 1/T width.
        return experts is not None and experts.is_expert(name, *projections)

    def rows(tensor: torch.Tensor, n: int) -> torch.Tensor:
        return tensor[rank * n : (rank + 1) * n]

    def cols(tensor: torch.Tensor, n: int) -> torch.Tensor:
        return tensor[:, rank * n : (rank + 1) * n]

    shard: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if ".self_attn.q_proj." in name:
            part = rows(tensor, q_rows)
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            part = rows(tensor, kv_rows)
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name or is_expert(name, "gate", "up"):
            part = rows(tensor, inter)
        elif name.endswith("self_attn.o_proj.weight"):
            part = cols(tensor, q_rows)
        elif name.endswith("mlp.down_proj.weight") or is_expert(name, "down"):
            part = cols(tensor, inter)
        elif name.endswith("self_attn.o_proj.bias"):
            # Added once to the sum, like the residual: rank 0 holds it, the others zeros.
            part = tensor if rank == 0 else torch.zeros_like(tensor)
        else:  # embedding, LM head, norms, MoE routers: replicated
            part = tensor
        shard[name] = part.clone()
    return shard
