"""Engine configuration: one validated dataclass tree; CLI flags map onto its fields.

Every field that a user may set carries a `help` string in its metadata; the
CLI builds `--flag-name` options from those, so adding a setting is one line.
A setting with a fixed set of values has a Literal type: the CLI's choices and
the check at construction both come from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from iterserve.core.kv_cache import PrefixHashAlgo
from iterserve.sampling_defaults import SamplingDefaults, read_generation_config

Batching = Literal["continuous", "static", "dynamic"]
StepPolicy = Literal["mixed", "prefill-first"]
WeightFormat = Literal["auto", "bf16", "int4", "int8"]
Kernels = Literal["auto", "torch"]
DType = Literal["auto", "bfloat16", "float32"]
KVCacheDType = Literal["auto", "int8"]
# --kv-cache-memory: GiB, or "auto" (a share of the memory left once the weights are in).
KVCacheMemory = float | Literal["auto"]
SpeculativeMethod = Literal["ngram", "draft"]
Task = Literal["auto", "generate", "embed", "both", "score"]
# --generation-config: "auto", "none" ("vllm": vLLM's name for it), or a folder.
GENERATION_CONFIG_WORDS = ("auto", "none", "vllm")
Pooling = Literal["auto", "last", "mean", "cls"]
SELF_INT4_DRAFT = "self-int4"  # --draft-model value: the model's own 4-bit weights
# --hf-overrides' keys (model/hf_overrides.py); "rope_parameters" is transformers 5's name.
HF_OVERRIDE_KEYS = ("rope_scaling", "rope_parameters", "max_position_embeddings")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def _context_length(text: str) -> int | None:
    """--max-model-len's value; 0, llama-server's "the model's own", is the default."""
    return int(text) or None


class ConfigError(ValueError):
    """A setting that cannot work, said so at start-up."""


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (--override-generation-config, --default-chat-template-kwargs)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _gib_or_auto(text: str) -> KVCacheMemory:
    """--kv-cache-memory's value on the command line: `auto` or a number of GiB."""
    if text == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected auto or a number of GiB, got {text!r}"
        ) from None


@dataclass
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV cache block")
    kv_cache_memory: KVCacheMemory = _opt(
        "auto",
        "memory for the KV cache: a number of GiB, or auto: --kv-cache-memory-fraction of the "
        "memory available once the weights are loaded (the smaller of MemAvailable and the "
        "cgroup's limit less its usage, less what other iterserve engines' pools on this "
        "host have reserved and not yet written; free device memory on CUDA), at most what "
        "--max-num-seqs sequences of the full context need. Pages are committed as blocks "
        "are first used",
        parse=_gib_or_auto,
    )
    kv_cache_memory_fraction: float = _opt(
        0.5,
        "--kv-cache-memory auto: the share of the available memory the KV cache takes. Half, "
        "not vLLM's 0.9 of a GPU: on a CPU the pool shares the host with the step's "
        "activations, the compile cache, the OS's page cache (the weights' files) and other "
        "processes, which MemAvailable counts as free but may need back",
    )
    num_kv_blocks: int | None = _opt(
        None, "exact number of KV blocks (overrides --kv-cache-memory)"
    )
    enable_prefix_caching: bool = _opt(
        True, "share KV blocks between requests with a common prefix"
    )
    kv_cache_dtype: KVCacheDType = _opt(
        "auto",
        "how K and V are stored: auto (the model's dtype) or int8 (a scale per token and kv "
        "head; half the bytes a decode step reads, ~1.9x the tokens in the same memory)",
    )
    prefix_caching_hash_algo: PrefixHashAlgo = _opt(
        "sha256",
        "how a cached block is named: sha256 (collision-resistant) or builtin (Python's "
        "64-bit hash: faster, but crafted prompts can collide and share another's KV)",
    )

    cache_reuse: int = _opt(
        0,
        "llama-server's: copy a recent sequence's cached K/V for every run of at least this "
        "many tokens a new prompt repeats at another position (an editor's prompt after the "
        "cursor moved), the keys rotated to their new places, instead of computing it again. "
        "Approximate after the first layer, as llama-server's: 0 (off) computes every prompt "
        "exactly",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_choices(self)
        _check_at_least_one(self, "block_size")
        if isinstance(self.cache_reuse, bool) or self.cache_reuse < 0:
            raise ConfigError(
                f"--cache-reuse must be 0 (off) or more tokens, got {self.cache_reuse}"
            )
        if self.cache_reuse and not self.enable_prefix_caching:
            raise ConfigError(
                "--cache-reuse finds its K/V through the prefix cache: keep "
                "--enable-prefix-caching on"
            )
        memory = self.kv_cache_memory
        if memory != "auto" and (
            isinstance(memory, bool)
            or not isinstance(memory, int | float)
            or not 0 < memory < math.inf
        ):
            raise ConfigError(
                f"--kv-cache-memory must be auto or a positive number of GiB, got {memory!r}"
            )
        if not 0 < self.kv_cache_memory_fraction <= 1:  # also refuses NaN
            raise ConfigError(
                f"--kv-cache-memory-fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        _check_at_least_one(self, "num_kv_blocks")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = _opt(64, "most requests running at once", aliases=("-np", "--parallel"))
    max_num_batched_tokens: int = _opt(512, "token budget of one step (prefill chunks + decodes)")
    enable_chunked_prefill: bool = _opt(True, "split long prompts across steps under the budget")
    max_model_len: int | None = _opt(
        None,
        "context length limit (default, or 0 as llama-server's -c takes it: the model's, cut "
        "to what the KV cache holds)",
        aliases=("-c", "--ctx-size"),
        parse=_context_length,
    )
    batching: Batching = _opt("continuous", "batching mode")
    batch_size: int = _opt(8, "requests per batch for static and dynamic batching")
    max_wait_ms: float = _opt(
        50.0, "dynamic batching: start a partial batch once its oldest request waited this long"
    )
    static_max_wait_ms: float = _opt(
        10_000.0,
        "static batching: start a partial batch once its oldest request waited this long "
        "(a backstop so a server's last requests never wait for ever, not a latency knob)",
    )
    step_policy: StepPolicy = _opt("mixed", "step composition")
    long_prefill_token_threshold: int = _opt(
        0, "at most this many tokens of one prompt per step (0: no limit)"
    )
    max_long_partial_prefills: int = _opt(
        0, "at most this many prompts over the threshold prefill at once (0: no limit)"
    )
    enable_lanes: bool = _opt(
        True, "honour request lanes (off: every request waits in one interactive queue)"
    )
    batch_lane_min_share: float = _opt(
        0.1,
        "share of each step's token budget, and of the seats, the batch lane is guaranteed "
        "while it waits",
    )
    max_running_batch_lane: int | None = _opt(None, "most batch-lane requests running at once")
    embed_lane_share: float = _opt(
        0.02,
        "share of each step's token budget embedding requests (the embed lane) take while "
        "generation runs: at most that much, so a burst of them cannot slow decodes much, and "
        "at least that much, so prompts cannot starve them; alone they take the whole budget. "
        "The default (11 of 512 tokens) keeps 8 streams' steps within 2x on a CPU, where a "
        "prompt token costs ~1/16 of an 8-row decode step (docs/embeddings.md); raise it "
        "where prompts are cheaper (a GPU)",
    )
    async_scheduling: bool | None = _opt(
        None,
        "plan each step while the one before it computes, so the forward never waits for "
        "scheduling, detokenizing and streaming (a request ending with a stop token or string "
        "costs one discarded step); default: what measures faster on this device "
        "(docs/async_scheduling.md). Off with speculative decoding",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse settings that cannot work, or that would starve or hang a request."""
        _check_choices(self)
        _check_at_least_one(self, "max_num_seqs", "max_num_batched_tokens")
        if self.max_num_seqs > self.max_num_batched_tokens:
            # Every running request needs one token of a step's budget to decode; with
            # more seats than tokens, the requests at the tail would wait for ever.
            raise ConfigError(
                f"--max-num-seqs ({self.max_num_seqs}) must not exceed --max-num-batched-tokens "
                f"({self.max_num_batched_tokens}): a step could not give every running request "
                "its decode token; lower --max-num-seqs or raise --max-num-batched-tokens"
            )
        _check_at_least_one(self, "max_model_len")
        if self.batching != "continuous":
            if self.batch_size < 1:
                raise ConfigError(f"{self.batching} batching needs --batch-size >= 1")
            if self.batch_size > self.max_num_seqs:
                raise ConfigError(
                    f"--batch-size ({self.batch_size}) must not exceed --max-num-seqs "
                    f"({self.max_num_seqs}): a {self.batching} batch runs all its requests at "
                    "once; lower --batch-size or raise --max-num-seqs"
                )
        for flag, wait in (
            ("--max-wait-ms", self.max_wait_ms),
            ("--static-max-wait-ms", self.static_max_wait_ms),
        ):
            if not 0 <= wait < math.inf:  # also refuses NaN
                raise ConfigError(f"{flag} must be a finite number >= 0, got {wait}")
        if not 0.0 <= self.batch_lane_min_share < 1.0:
            raise ConfigError(
                "--batch-lane-min-share must be in [0, 1) (1 would leave interactive prompts "
                f"nothing while batch work waits), got {self.batch_lane_min_share}"
            )
        if not 0.0 < self.embed_lane_share < 1.0:
            raise ConfigError(
                "--embed-lane-share must be in (0, 1) (0 would never run an embedding beside "
                f"generation, 1 would leave prompts nothing), got {self.embed_lane_share}"
            )
        if self.max_running_batch_lane is not None and self.max_running_batch_lane < 1:
            raise ConfigError(
                "--max-running-batch-lane must be at least 1 (leave it unset for no cap; 0 "
                f"would never run a batch-lane request), got {self.max_running_batch_lane}"
            )
        if self.long_prefill_token_threshold < 0 or self.max_long_partial_prefills < 0:
            raise ConfigError(
                "--long-prefill-token-threshold and --max-long-partial-prefills must be >= 0"
            )


@dataclass
class SpeculativeConfig:
    speculative_method: SpeculativeMethod | None = _opt(
        None,
        "propose draft tokens each decode step and verify them in the same forward: "
        "ngram (prompt lookup: the tokens that followed the latest earlier occurrence of the "
        "context's last n-gram) or draft (a smaller model's greedy guesses: --draft-model)",
    )
    draft_model: str | None = _opt(
        None,
        "draft: HF directory or GGUF file of a smaller model with the target's tokenizer "
        "(its KV pool has as many blocks as the target's), or self-int4: the model's own "
        "quantized GGUF blocks guessing for it (useful with --weights bf16)",
    )
    num_speculative_tokens: int = _opt(4, "most draft tokens per request per step")
    ngram_min: int = _opt(2, "ngram: shortest suffix n-gram to look up")
    ngram_max: int = _opt(4, "ngram: longest suffix n-gram to look up (tried first)")
    speculative_disable_by_batch_size: int | None = _opt(
        None,
        "no drafts in a step while this many requests or more are running (large batches are "
        "compute-bound: a rejected draft then costs what it was meant to save)",
    )

    def __post_init__(self) -> None:
        self.validate()

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None

    def validate(self) -> None:
        if self.speculative_method is not None:
            _check_choices(self)
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ConfigError(
                "--speculative-method draft needs --draft-model PATH, and --draft-model "
                "needs --speculative-method draft"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                "--num-speculative-tokens must be between 1 and 16, "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(
                f"--ngram-min ({self.ngram_min}) must be at least 1 and at most --ngram-max "
                f"({self.ngram_max})"
            )
        if (
            self.speculative_disable_by_batch_size is not None
            and self.speculative_disable_by_batch_size < 1
        ):
            raise ConfigError(
                "--speculative-disable-by-batch-size must be at least 1 (leave it unset to "
                f"always speculate), got {self.speculative_disable_by_batch_size}"
            )


def _lora_module(text: str) -> str:
    """One --lora-modules entry on the command line: name=path."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return text


@dataclass
class LoRAConfig:
    enable_lora: bool = _opt(
        False,
        "serve LoRA adapters (implied by --lora-modules): the model keeps --max-loras of them "
        "in slots and rows of several adapters and of the base share a step (docs/lora.md)",
    )
    lora_modules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "LoRA adapters to serve from the start, as name=path (a PEFT directory or "
            "a llama.cpp LoRA GGUF, or OWNER/NAME already in the local Hugging Face cache); a "
            "request picks one by its `model`",
            "parse": _lora_module,
            "nargs": "+",
        },
    )
    max_loras: int = _opt(1, "LoRA adapters resident at once (least recently used evicted)")
    max_lora_rank: int = _opt(16, "highest LoRA rank an adapter may have")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def modules(self) -> dict[str, str]:
        """--lora-modules as {name: path}, in order."""
        return dict(entry.partition("=")[::2] for entry in self.lora_modules)

    def validate(self) -> None:
        _check_at_least_one(self, "max_loras", "max_lora_rank")
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules takes name=path entries, got {entry!r}")
        if len(self.modules()) != len(self.lora_modules):
            raise ConfigError("--lora-modules names an adapter twice")


@dataclass
class PoolingConfig:
    task: Task = _opt(
        "auto",
        "what the server does: generate (completions, chat, responses), embed "
        "(/v1/embeddings only), both, score (a reranker or classifier: /v1/rerank, /v1/score "
        "and /classify only), or auto: score for a reranker (a *ForSequenceClassification, a "
        "GGUF of pooling type "
        "rank, --classifier-from-tokens, a Qwen3-Reranker directory), embed for an embedding "
        "checkpoint (a sentence-transformers directory, a bare *Model architecture without an "
        "LM head, a GGUF with a pooling type), both otherwise",
    )
    pooling: Pooling = _opt(
        "auto",
        "how an embedding is pooled from the final-norm hidden states: last (token), mean, "
        "cls (first token), or auto: the checkpoint's metadata (sentence-transformers "
        "1_Pooling, GGUF pooling_type), else mean (docs/embeddings.md)",
    )
    normalize: bool | None = _opt(
        None,
        "L2-normalize embeddings; default: the checkpoint's metadata (a sentence-transformers "
        "Normalize module), else on",
    )
    classifier_from_tokens: str | None = _opt(
        None,
        "score with a causal LM's head rows of these tokens (vLLM's classifier_from_token): "
        "one token, its logit (bge-reranker-v2-gemma: Yes), or two, false and true, the "
        "second's logit less the first's (Qwen3-Reranker: no,yes, taken without asking from a "
        "directory named so); the score is its sigmoid",
    )
    rerank_template: str | None = _opt(
        None,
        "the prompt a (query, document) pair is scored in, with {query} and {document} (text, "
        "or a file holding it); default: the GGUF's rerank template (llama.cpp's), "
        "Qwen3-Reranker's own, else the tokenizer's pair encoding (query, then document)",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_choices(self)


@dataclass
class EngineConfig:
    model: str | None = _opt(
        None,
        "HF directory or GGUF file, or a repository already in the local Hugging Face cache "
        "(never downloaded): OWNER/NAME, or OWNER/NAME:QUANT for one GGUF of a repository of "
        "several, as llama.cpp's -hf takes it (no tag: Q4_K_M); or a model `ollama pull` "
        "fetched, by its Ollama name (llama3.2:3b) (default: bundled SmolLM2-135M)",
        aliases=("-m", "-hf", "--hf-repo"),
    )
    revision: str | None = _opt(
        None,
        "the revision of a model named by its repository: a branch, tag or commit the Hugging "
        "Face cache holds (default: main), as vLLM's --revision",
    )
    mmproj: str | None = _opt(
        None,
        "the vision projector file (mmproj-*.gguf, as llama.cpp writes it) of a GGUF model, "
        "whose prompts then take images, as llama-server's --mmproj (Gemma 3's, Mistral 3's, "
        "Gemma 4's)",
        aliases=("-mm",),
    )
    image_max_tokens: int | None = _opt(
        None,
        "at most this many rows an image, as llama-server's --image-max-tokens: a smaller "
        "image, fewer tokens, a faster tower (Mistral 3: the longer side cut to fit; Gemma 4: "
        "the largest of its budgets 70-1120 that fits; Gemma 3's are always 256); default: "
        "the model's own processor's",
    )
    mmproj_auto: bool = _opt(
        True,
        "read the vision projector that comes with a GGUF model (an mmproj file beside it in "
        "its Hugging Face repository, an Ollama model's projector layer, the tower in Ollama's "
        "Gemma 3 files), as llama-server's --mmproj-auto; --no-mmproj-auto: text alone",
    )
    hf_overrides: dict[str, Any] | None = _opt(
        None,
        "the model's context set at serve time, as vLLM's flag sets it, for an HF directory "
        "or a GGUF alike: a JSON object of rope_scaling (HF terms, in place of the "
        "checkpoint's) and max_position_embeddings, e.g. Qwen3's 128K: "
        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
        '"original_max_position_embeddings": 32768}}\' (llama.cpp: --rope-scaling yarn '
        "--rope-scale 4 --yarn-orig-ctx 32768)",
        parse=json_object,
    )
    chat_template: str | None = _opt(
        None,
        "the Jinja template chats are rendered with, in place of the model's own (a file "
        "holding it, or the template itself); default: the checkpoint's (a GGUF's "
        "tokenizer.chat_template), which a base model's file often lacks",
    )
    generation_config: str = _opt(
        "auto",
        "sampling settings for the fields a request leaves unset (temperature, top_k, top_p, "
        "min_p, repetition_penalty; max_new_tokens, a limit on every answer): auto takes the "
        "model's own, from its generation_config.json or a GGUF's general.sampling.* keys, "
        "as vLLM and llama.cpp do; none (or vllm) keeps OpenAI's (temperature 1, no cut); a "
        "folder holding a generation_config.json takes that one's, as vLLM's does",
    )
    override_generation_config: dict[str, Any] | None = _opt(
        None,
        "sampling settings over the model's for the fields a request leaves unset, as a JSON "
        "object of temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens "
        "(vLLM's flag; "
        'llama-server\'s --temp, --top-k...): \'{"temperature": 0.6, "top_k": 20}\'',
        parse=json_object,
    )
    dtype: DType = _opt(
        "auto",
        "weights and activations: auto is bfloat16 where this CPU computes it natively or "
        "iterserve's kernels run (they keep bf16 in memory and multiply in fp32 where the CPU "
        "has no bf16 arithmetic), float32 where only torch's emulated bf16 would be left",
    )
    device: str = _opt("auto", "cpu, cuda, or auto (cuda when present)")
    seed: int = _opt(0, "seed for requests that give none")
    num_threads: int | None = _opt(
        None, "torch CPU threads (default: torch's choice)", aliases=("-t", "--threads")
    )
    weights: WeightFormat = _opt(
        "auto",
        "weight format: auto (a quantized GGUF runs from its own blocks at every step size, "
        "on int8 activations, as llama.cpp does; fp16/bf16 weights stay 16-bit), int4 (auto, "
        "refused for a checkpoint without quantized blocks), int8 (every projection made "
        "Q8_0 at load: int8 weights and activations, any checkpoint), bf16 (everything "
        "dense bf16: exact to the dequantized weights, 2-4x the memory of a 4-bit file)",
    )
    kernels: Kernels = _opt(
        "auto",
        "auto: iterserve's C++ kernels and oneDNN-packed weights where this CPU runs them; "
        "torch: plain torch ops everywhere (the reference path)",
    )
    batch_invariant: bool = _opt(
        False,
        "insist that a request's logits are the same bits whatever else shares its steps and "
        "however its prompt was chunked or cached (so a seeded request samples the same "
        "text): iterserve's fused kernels always compute so; start only where they run",
    )
    enable_prompt_embeds: bool = _opt(
        False,
        "take prompts given as the model's input rows (vLLM's prompt_embeds: /v1/completions' "
        "`prompt_embeds`, base64 of a torch.save'd [tokens, hidden] tensor; offline "
        "{'prompt_embeds': tensor}). Off by default, as in vLLM: a request then carries a "
        "tensor the server unpickles (torch.load with weights_only)",
    )
    compile: bool = _opt(
        True,
        "compile the layer stack into one graph at start-up (torch.compile; cached)",
        off_alias="--enforce-eager",
    )
    tensor_parallel_size: int = _opt(
        1,
        "shard attention heads, KV cache and MLP across this many processes (torch.distributed: "
        "gloo on CPU, NCCL on CUDA, one GPU per rank); the heads and intermediate size must "
        "divide by it. Over 1 runs torch's projections and attention eager (the C++ kernels and "
        "compiled graphs are set aside; --weights int4/int8, --batch-invariant and draft "
        "models are refused)",
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> EngineConfig:
        """Check every section; called when a config is built and again before an engine
        uses it, since callers may change fields in between."""
        _check_choices(self)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be cpu, cuda or auto, got {self.device!r}")
        _check_at_least_one(self, "num_threads", "image_max_tokens")
        if self.weights in ("int4", "int8") and (
            self.dtype == "float32" or self.kernels == "torch"
        ):
            raise ConfigError(
                f"--weights {self.weights} runs on iterserve's kernels: it needs --dtype "
                "bfloat16 and --kernels auto"
            )
        self._validate_tensor_parallel()
        self._validate_hf_overrides()
        self.given_generation_config()
        self.sampling_overrides()
        self.cache.validate()
        self.scheduler.validate()
        self.speculative.validate()
        self.pooling.validate()
        self.lora.validate()
        return self

    def _validate_hf_overrides(self) -> None:
        given = self.hf_overrides or {}
        if unknown := [key for key in given if key not in HF_OVERRIDE_KEYS]:
            raise ConfigError(
                f"--hf-overrides: {', '.join(map(repr, unknown))} cannot be set here; only "
                f"{', '.join(HF_OVERRIDE_KEYS)} (the model's context) are taken"
            )
        scaling = given.get("rope_scaling", given.get("rope_parameters"))
        if scaling is not None and not isinstance(scaling, dict):
            raise ConfigError("--hf-overrides: rope_scaling must be a JSON object")
        positions = given.get("max_position_embeddings")
        if positions is not None and (not isinstance(positions, int) or positions < 1):
            raise ConfigError("--hf-overrides: max_position_embeddings must be a positive integer")

    def given_generation_config(self) -> SamplingDefaults | None:
        """The settings of --generation-config FOLDER; None for auto and none (the model's,
        OpenAI's). ConfigError naming the flag if the folder has no usable file."""
        if self.generation_config in GENERATION_CONFIG_WORDS:
            return None
        try:
            return SamplingDefaults.from_generation_config(
                read_generation_config(self.generation_config)
            )
        except ValueError as error:
            raise ConfigError(f"--generation-config: {error}") from None

    def sampling_overrides(self) -> SamplingDefaults:
        """--override-generation-config as settings; ConfigError naming what it cannot take."""
        try:
            return SamplingDefaults().with_overrides(self.override_generation_config or {})
        except ValueError as error:
            raise ConfigError(f"--override-generation-config: {error}") from None

    def _validate_tensor_parallel(self) -> None:
        _check_at_least_one(self, "tensor_parallel_size")
        size = self.tensor_parallel_size
        if size == 1:
            return
        # Each of these runs on iterserve's C++ kernels or a second network, not sharded.
        refused = {
            f"--weights {self.weights}": self.weights in ("int4", "int8"),
            "--batch-invariant": self.batch_invariant,
            "--enable-prompt-embeds": self.enable_prompt_embeds,
            "--speculative-method draft": self.speculative.speculative_method == "draft",
            # The adapters' deltas are not sharded (a slice of B per rank would do; not yet).
            "LoRA (--enable-lora, --lora-modules)": self.lora.enabled,
        }
        for flag, given in refused.items():
            if given:
                raise ConfigError(
                    f"{flag} is not supported with --tensor-parallel-size {size}: tensor "
                    "parallelism shards the torch path only"
                )
        if self.cache.cache_reuse:
            raise ConfigError(
                f"--cache-reuse is not supported with --tensor-parallel-size {size}: its copies "
                "run on rank 0's share of the KV pool only"
            )


# ---- CLI mapping ---------------------------------------------------------------

# EngineConfig's sub-sections; every leaf setting's name is unique across all of them.
SECTIONS: dict[str, type] = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "pooling": PoolingConfig,
    "lora": LoRAConfig,
}


def engine_config(settings: dict[str, Any]) -> EngineConfig:
    """An EngineConfig from flat settings ({"max_num_seqs": 8, "block_size": 32, ...}),
    each routed to the section that owns its name; unknown names raise TypeError."""
    split: dict[str, dict[str, Any]] = {name: {} for name in ("", *SECTIONS)}
    owners = {f.name: "" for f in _leaf_fields(EngineConfig)}
    for section, cls in SECTIONS.items():
        owners.update({f.name: section for f in _leaf_fields(cls)})
    for key, value in settings.items():
        if key not in owners:
            raise TypeError(f"unknown setting {key!r}")
        split[owners[key]][key] = value
    sections = {name: cls(**split[name]) for name, cls in SECTIONS.items()}
    return EngineConfig(**split[""], **sections).validate()


def _leaf_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[type, tuple[str, ...] | None]]:
    """Each setting's value type (None stripped from an optional one) and, for a Literal,
    its allowed values."""
    out: dict[str, tuple[type, tuple[str, ...] | None]] = {}
    for name, hint in get_type_hints(cls).items():
        if get_origin(hint) in (Union, types.UnionType):
            kinds = [arg for arg in get_args(hint) if arg is not type(None)]
            if len(kinds) > 1:  # a value of several kinds: the field's `parse` reads it
                out[name] = (object, None)
                continue
            (hint,) = kinds
        if get_origin(hint) is Literal:
            out[name] = (str, get_args(hint))
        else:
            out[name] = (hint, None)
    return out


def _check_choices(config: Any) -> None:
    for f in _leaf_fields(type(config)):
        choices = _field_types(type(config))[f.name][1]
        value = getattr(config, f.name)
        if choices is not None and value not in choices:
            raise ConfigError(f"{_flag(f.name)} must be one of {choices}, got {value!r}")


def _check_at_least_one(config: Any, *names: str) -> None:
    """Refuse a count below 1, naming its flag; None (unset) passes."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"{_flag(name)} must be at least 1, got {value}")


def resolve_async_scheduling(config: EngineConfig, device_type: str) -> tuple[bool, str]:
    """Whether an engine on `device_type` ("cpu", "cuda") plans each step while the one
    before computes, and why. Not given: on where the host's work runs beside the device's
    (a GPU), off on a CPU, whose forward computes on every core the host's work would take
    (measured: docs/async_scheduling.md)."""
    if config.speculative.enabled:
        return False, "speculative decoding plans each step from the last one's accepted tokens"
    chosen = config.scheduler.async_scheduling
    if chosen is not None:
        return chosen, "--async-scheduling" if chosen else "--no-async-scheduling"
    if device_type == "cpu":
        return False, "the default on a CPU: its forward uses the cores the overlap would need"
    return True, f"the default on {device_type}"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one `--flag` per EngineConfig setting."""
    for cls in (EngineConfig, *SECTIONS.values()):
        group = parser.add_argument_group(cls.__name__)
        for f in _leaf_fields(cls):
            kwargs: dict[str, Any] = {
                "dest": f.name,
                # (a list's default comes from its factory)
                "default": f.default_factory() if f.default is dataclasses.MISSING else f.default,  # type: ignore[misc]
                "help": f.metadata["help"],
            }
            value_type, choices = _field_types(cls)[f.name]
            if value_type is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = f.metadata.get("parse", value_type)
                if choices is not None:
                    kwargs["choices"] = choices
                if "nargs" in f.metadata:  # a list of values: --lora-modules a=x b=y
                    kwargs["nargs"] = f.metadata["nargs"]
            # llama-server's names beside vLLM's (-c, -np, -t, -m, -hf), so its command line
            # starts iterserve as it is.
            group.add_argument(_flag(f.name), *f.metadata.get("aliases", ()), **kwargs)
            if "off_alias" in f.metadata:  # e.g. vLLM's --enforce-eager for --no-compile
                group.add_argument(
                    f.metadata["off_alias"],
                    dest=f.name,
                    action="store_false",
                    help=f"same as --no-{f.name.replace('_', '-')}",
                )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = [f.name for cls in (EngineConfig, *SECTIONS.values()) for f in _leaf_fields(cls)]
    return engine_config({name: getattr(args, name) for name in names if hasattr(args, name)})
