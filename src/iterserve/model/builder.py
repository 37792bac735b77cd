"""From loaded weights and the engine's settings to a ready network: which kernels, which
weight format, compiled or not. Every choice is made here, once, and said in one log line."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from iterserve import kernels
from iterserve.config import ConfigError, EngineConfig
from iterserve.model.config import ModelConfig
from iterserve.model.file_bytes import shared_slice_reader
from iterserve.model.gguf_blocks import QuantizedBlocks
from iterserve.model.host_memory import packed_weight_buffers, release_freed_memory
from iterserve.model.linear import Backend, WeightMode, onednn_usable
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loaded import LoadedModel
from iterserve.model.lora_model import LoRAModel

logger = logging.getLogger("iterserve.model")


@dataclass(frozen=True)
class ModelPlan:
    """What `build_model` chose, for logs, /health and benchmarks."""

    backend: Backend
    paged_attention_kernel: bool  # the C++ op serves every row; False: torch attention
    batch_invariant: bool
    weights: str  # "bfloat16", "Q4_K+Q6_K" (the checkpoint's blocks as they are), ...
    # How a step runs: "fused-layers" (one C++ op per layer), "compiled" (torch.compile'd
    # layer stack) or "eager".
    step: str
    linears: dict[str, str]
    dtype: str = "bfloat16"
    dtype_reason: str = ""
    kernels_isa: str | None = None  # the C++ kernels' ISA variant, when they run
    kv_cache_dtype: str = "bfloat16"  # how the pool stores K/V (model/kv_cache_format.py)
    weight_bytes: int = 0  # bytes of weights the network holds

    def describe(self) -> dict[str, str]:
        """The plan as /health reports it."""
        return {
            "dtype": self.dtype,
            "dtype_reason": self.dtype_reason,
            "kernels": self.backend,
            "kernels_isa": self.kernels_isa or "none",
            "attention": "paged-kernel" if self.paged_attention_kernel else "torch",
            "kv_cache_dtype": self.kv_cache_dtype,
            "weights": self.weights,
            "weight_bytes": str(self.weight_bytes),
            "step": self.step,
        }


def choose_dtype(config: EngineConfig, device: torch.device) -> tuple[torch.dtype, str]:
    """The model's dtype and why: `--dtype auto` keeps bf16 wherever it is computed without
    emulation, and takes fp32 where torch would emulate bf16 arithmetic (on such a CPU fp32
    decodes ~3x and prefills ~7x faster than torch's bf16: issue 22's measurements)."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype), f"--dtype {config.dtype}"
    if device.type != "cpu":
        return torch.bfloat16, f"bf16 on {device.type}"
    kernels_run = (
        config.kernels == "auto" and config.tensor_parallel_size == 1 and kernels.available()
    )
    if kernels_run:
        variant = kernels.describe()
        how = "bf16 dot products" if variant and variant.native_bf16 else "fp32 arithmetic"
        return torch.bfloat16, f"bf16 weights, iterserve's {kernels.isa()} kernels ({how})"
    if onednn_usable(torch.bfloat16, device):
        return torch.bfloat16, "bf16: oneDNN computes it natively on this CPU"
    reason = kernels.why_unavailable() if config.kernels == "auto" else "--kernels torch"
    return torch.float32, f"fp32: no native bf16 on this CPU and the kernels are off ({reason})"


def choose_backend(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> Backend:
    if config.kernels == "torch" or device.type != "cpu" or dtype != torch.bfloat16:
        return "torch"
    if kernels.available():
        return "tiled"
    return "onednn" if onednn_usable(dtype, device) else "torch"


@dataclass(frozen=True)
class WeightChoice:
    """How the projections are held (see model/linear.py)."""

    quantized: dict[str, QuantizedBlocks]  # checkpoint blocks kept as they are, by HF name
    mode: WeightMode


def choose_weights(config: EngineConfig, loaded: LoadedModel, backend: Backend) -> WeightChoice:
    if config.weights in ("int4", "int8") and backend != "tiled":
        reason = kernels.why_unavailable() or "they are off on this device/dtype"
        raise ConfigError(f"--weights {config.weights} needs iterserve's C++ kernels ({reason})")
    if config.weights == "int4" and not loaded.quantized:
        raise ConfigError(
            "--weights int4 needs a checkpoint with quantized weights (a GGUF in a block format: "
            "Q4_0, Q4_K, Q6_K, IQ4_XS, ...)"
        )
    if config.weights == "int8":
        return WeightChoice({}, "int8")
    if config.weights == "bf16" or backend != "tiled":
        return WeightChoice({}, "bf16")
    # The checkpoint's blocks at every step size, run on int8 activations (weight bytes are
    # a decode step's cost; arithmetic a prefill's, which the kernels meet by decoding each
    # block once a step for all its rows: csrc/tiles.h); dense weights stay 16-bit.
    return WeightChoice(dict(loaded.quantized), "blocks")


def build_model(
    config: EngineConfig,
    loaded: LoadedModel,
    dtype: torch.dtype,
    device: torch.device,
    dtype_reason: str = "",
) -> tuple[LlamaForCausalLM, ModelPlan]:
    if config.lora.enabled and (loaded.config.conv_history or not loaded.config.uniform_layers):
        # LFM2's adapters name conv.in_proj, feed_forward.w1...: modules no slot is made for;
        # Gemma 4's layers have q/k/v of different shapes (or none of k and v), which the
        # slots take to be alike.
        raise ConfigError(f"--enable-lora: {loaded.config.architecture} takes no LoRA adapters")
    model = LlamaForCausalLM(loaded.config, dtype, device)
    backend = choose_backend(config, dtype, device)
    choice = choose_weights(config, loaded, backend)
    with packed_weight_buffers(), shared_slice_reader():
        model.load(loaded.weights, backend, choice.quantized, choice.mode)
    release_freed_memory()
    if config.lora.enabled:  # slotted projections (lora_model.py)
        lora = LoRAModel(model, config.lora.max_loras, config.lora.max_lora_rank)
        logger.info(
            "LoRA: %d slots of rank %d, %.0f MiB",
            lora.max_loras,
            lora.max_rank,
            lora.nbytes / 2**20,
        )
    use_kernel = _attends_in_kernel(config, loaded.config, device)
    if use_kernel:
        model.use_kernel_ops(kernels.ops())
    # With iterserve's kernels each layer is one C++ op already: a step is ~32 calls with
    # nothing between them to fuse, and wrapping those in a compiled graph measured ~1 ms a
    # step slower at one token (its runtime wrapper), besides a minute of compiling (measured once). So the
    # fused layers are the compiled step there; torch.compile serves the other backends.
    fused = use_kernel and model.fused_layers
    if config.batch_invariant and not fused:
        reason = kernels.why_unavailable() or "this model or dtype does not fit them"
        raise ConfigError(
            f"--batch-invariant needs iterserve's fused kernels (bf16 on a CPU they run on): "
            f"{reason}"
        )
    compiled = config.compile and not fused and model.lora is None and _can_compile(device)
    if compiled:
        cache = _use_persistent_compile_cache()
        model.compile_layers()
        # The warm-up is otherwise a silent wait: Gemma 4 E2B's 35 unlike layers, when they
        # were compiled, took 144 s the first time (docs/benchmarks.md, 2026-12-03), 30 s from
        # the cache.
        logger.info(
            "the layer stack compiles at warm-up (torch.compile): minutes on a model's first "
            "start, then loaded from %s; --enforce-eager runs without it",
            cache,
        )
    formats = _held_formats(model)
    plan = ModelPlan(
        backend=backend,
        paged_attention_kernel=use_kernel,
        batch_invariant=config.batch_invariant,
        weights="+".join(formats) if formats else str(dtype).removeprefix("torch."),
        step="fused-layers" if fused else "compiled" if compiled else "eager",
        linears=model.describe_linears(),
        dtype=str(dtype).removeprefix("torch."),
        dtype_reason=dtype_reason,
        kernels_isa=kernels.isa() if backend == "tiled" or use_kernel else None,
        weight_bytes=model.weight_bytes(),
    )
    logger.info(
        "model %s: %s linears, %s attention, weights %s (%.2f GiB), step %s; %s",
        loaded.name,
        f"{plan.backend} ({plan.kernels_isa})" if plan.kernels_isa else plan.backend,
        "paged-kernel" if use_kernel else "torch",
        plan.weights,
        plan.weight_bytes / 2**30,
        plan.step,
        dtype_reason,
    )
    return model, plan


def _attends_in_kernel(config: EngineConfig, model: ModelConfig, device: torch.device) -> bool:
    """Whether the C++ paged attention op serves this model (else torch attends)."""
    head_dims = {model.layer_head_dim(i) for i in range(model.num_hidden_layers)}
    return (
        config.kernels == "auto"
        and device.type == "cpu"
        and head_dims <= set(kernels.ATTENTION_HEAD_DIMS)  # what the attention loops are built for
        and kernels.available()
    )


def _held_formats(model: LlamaForCausalLM) -> list[str]:
    """The weight formats the tiled kernels run, as the projections hold them: blocks first,
    then dense ones."""
    linears = [model.head] if model.head is not None else []
    for layer in model.layers:
        linears.extend(layer.linears.values())
        if layer.moe is not None:
            linears.extend([*layer.moe.gate_up, *layer.moe.down])
    held = {f for lin in linears for f in lin.held_formats()}
    return sorted(held - {"bf16", "f16"}) + sorted(held & {"bf16", "f16"})


def _can_compile(device: torch.device) -> bool:
    """torch.compile's CPU backend writes C++; without a compiler the engine runs eager."""
    if device.type != "cpu":
        return True
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # noqa: BLE001  any failure to find one means eager
        logger.warning("no C++ compiler for torch.compile (%s); running eager", error)
        return False
    return True


def _use_persistent_compile_cache() -> str:
    """Keep inductor's compiled graphs next to our kernels, across runs and reboots of /tmp;
    returns the directory in use (a TORCHINDUCTOR_CACHE_DIR of the user's own stays)."""
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kernels.cache_dir() / "inductor"))
