"""The engine: schedule -> execute -> update (EngineCore, engine_core.py) -> detokenize
-> emit, with the model loaded and run by the torch runner.

Single-threaded and synchronous; `AsyncEngine` runs it in a background
thread for the server, `LLM` drives it to completion for offline use.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from iterserve.config import (
    SELF_INT4_DRAFT,
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoRAConfig,
    resolve_async_scheduling,
)
from iterserve.core.lora import LoRARequest, LoRASlots
from iterserve.core.outputs import RequestUpdate, TokenLogprobs
from iterserve.core.request import EMBED_LANE, FinishReason, PromptEmbeds, Request, RequestStatus
from iterserve.core.scheduler import Scheduler
from iterserve.core.speculation import NgramProposer
from iterserve.engine import available_memory, kv_pool_ledger
from iterserve.engine.chat_template import resolve_chat_template
from iterserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from iterserve.engine.engine_core import EngineCore, StepFailedError, StepStats
from iterserve.engine.images import ImageInputs, ImagesInput, ImagesPrompt
from iterserve.engine.kv_pool_size import (
    AvailableMemory,
    KVPoolSize,
    fit_max_model_len,
    size_kv_pool,
)
from iterserve.engine.lora_registry import LoRARegistry
from iterserve.engine.model_facts import ModelFacts
from iterserve.engine.outputs import EngineStep, RequestOutput
from iterserve.engine.pooling import (
    ModelPooling,
    finish_classification,
    finish_embedding,
    finish_score,
    model_pooling,
)
from iterserve.engine.prompt_embeds import FIELD as PROMPT_EMBEDS_FIELD
from iterserve.engine.prompt_embeds import EmbedsPrompt, checked_rows, prompt_embeds
from iterserve.engine.prompts import Prompt, RenderedChat, encode_prompt
from iterserve.engine.sampling_controls import bad_words_token_ids, check_token_ids
from iterserve.engine.score_prompts import PairPrompts, rerank_template
from iterserve.engine.step_pipeline import StepPipeline
from iterserve.engine.token_bytes import token_text_reader
from iterserve.engine.weights_fit import check_weights_fit
from iterserve.executor.draft_model import DraftModelProposer
from iterserve.executor.grammar_checked_proposer import GrammarCheckedProposer
from iterserve.executor.paged_model import PagedModel
from iterserve.executor.tensor_parallel import launch_tensor_parallel
from iterserve.executor.torch_runner import TorchRunner
from iterserve.model.attention import allocate_kv_caches
from iterserve.model.builder import ModelPlan, build_model, choose_dtype
from iterserve.model.errors import ModelLoadError
from iterserve.model.hf_overrides import with_hf_overrides
from iterserve.model.images import ImageEncoder
from iterserve.model.kv_cache_format import cache_dtype, kv_bytes_per_token
from iterserve.model.kv_shift import UnsupportedKVShift
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loaded import LoadedModel
from iterserve.model.loader import load_model
from iterserve.model.model_source import find_model
from iterserve.model.score_head import prepare_score_head
from iterserve.pooling_params import PoolingParams
from iterserve.prompt_truncation import PromptTruncation
from iterserve.sample.structured import GrammarCompiler
from iterserve.sampling_defaults import SamplingDefaults
from iterserve.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger("iterserve.engine")


@dataclass
class _Stream:
    """Engine-side state of one request: text so far and stop-string matching."""

    request: Request
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    text: str = ""
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _check_fits_in_memory(kv_bytes: float, cache: CacheConfig) -> None:
    """A KV pool larger than the machine's memory is the user's setting, not an allocator
    failure deep in torch: say which flag asked for it."""
    machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if kv_bytes <= machine:
        return
    asked = (
        f"--num-kv-blocks {cache.num_kv_blocks}"
        if cache.num_kv_blocks
        else f"--kv-cache-memory {cache.kv_cache_memory:g} (GiB)"
    )
    raise ConfigError(
        f"{asked} asks for a {kv_bytes / 2**30:,.1f} GiB KV cache, more than this machine's "
        f"{machine / 2**30:,.1f} GiB of memory"
    )


def _projector(path: Path, loaded: LoadedModel, dtype: torch.dtype) -> ImageEncoder:
    """The image encoder a vision projector file (or a model file holding one) gives;
    ModelLoadError for whatever in it cannot be read."""
    # Deferred: transformers' vision modules cost ~120 MiB of imports (resident).
    from iterserve.model.gguf_images import load_mmproj

    try:
        return load_mmproj(path, loaded.config, loaded.tokenizer, dtype)
    except ModelLoadError:
        raise
    except Exception as error:  # a file cut short, a shape transformers' modules refuse
        raise ModelLoadError(f"{path} cannot be read as a vision projector: {error!r}") from error


class LLMEngine:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, warm_up: bool = True
    ) -> None:
        """Load the model and set everything up; `warm_up` also compiles (or loads compiled
        graphs) and runs each kernel once now, else `warm_up()` must be called before the
        first step that should be fast (the server does it on its engine thread)."""
        self.config = config.validate()
        self.device = resolve_device(config.device)
        overlap, why = resolve_async_scheduling(config, self.device.type)
        self._pipeline = StepPipeline() if overlap else None
        if self._pipeline is None:
            self._set_up(loaded, warm_up)
        else:
            # Every torch op of this engine on the thread its steps will run on
            # (engine/step_pipeline.py says why).
            self._pipeline.call(self._set_up, loaded, warm_up)
        logger.info("asynchronous scheduling: %s (%s)", "on" if overlap else "off", why)

    def _set_up(self, loaded: LoadedModel | None, warm_up: bool) -> None:
        """Everything that touches torch; with async scheduling it runs on the step thread
        (see `__init__`), so every step below does too."""
        config = self.config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype, dtype_reason = choose_dtype(config, self.device)
        self.dtype = dtype  # the layers' inputs' (prompt embeds are cast to it)
        loaded = loaded or load_model(config.model, dtype, config.revision)
        if config.mmproj:
            images = _projector(Path(config.mmproj), loaded, dtype)
            loaded = replace(loaded, images=images)
        elif loaded.projector_file is not None and config.mmproj_auto:
            # A projector that comes with the model (its repository's mmproj, an Ollama
            # projector layer, the tower in an Ollama Gemma 3 file): read if it can be, else
            # the text alone is served, as such a model was before its towers were read.
            try:
                images = _projector(loaded.projector_file, loaded, dtype)
            except ModelLoadError as error:
                logger.warning("the model's vision projector is not read (%s): text only", error)
            else:
                logger.info(
                    "the vision projector that comes with the model read: %s "
                    "(--no-mmproj-auto: not)",
                    loaded.projector_file,
                )
                loaded = replace(loaded, images=images)
        if config.hf_overrides:
            overridden = with_hf_overrides(loaded.config, config.hf_overrides)
            logger.info(
                "--hf-overrides: rope scaling %s, %d positions (the checkpoint's: %s, %d)",
                overridden.rope_scaling, overridden.max_position_embeddings,
                loaded.config.rope_scaling, loaded.config.max_position_embeddings,
            )  # fmt: skip
            loaded = replace(loaded, config=overridden)
        check_weights_fit(loaded, config.weights, self.device)
        self._take_model(loaded)
        path = find_model(config.model, config.revision).path
        # A reranker's score head, and the prompt its (query, document) pairs go into.
        prepare_score_head(loaded, path, config.pooling.classifier_from_tokens)
        self.pair_prompts = PairPrompts(
            loaded.tokenizer,
            rerank_template(config.pooling.rerank_template, loaded.rerank_template),
        )
        if loaded.score_source is not None:
            logger.info("scores: sigmoid of %s . the last token's state", loaded.score_source)
        # What it serves (generation, embeddings, scores) and how it pools (engine/pooling.py).
        self.pooling: ModelPooling = model_pooling(
            config.pooling, path, loaded.config.hidden_size, loaded.classifier_labels or ()
        )
        logger.info("tasks: %s", self.pooling.describe())
        # Engines started later on this host count what this engine's pools have not yet
        # written as taken (engine/kv_pool_ledger.py).
        self._pool_lines = kv_pool_ledger.PoolLines()
        network = self._network(loaded, dtype, dtype_reason)
        try:
            self._build_core(loaded, network, self.kv_pool.num_blocks, dtype)
            if (draft := self.draft) is not None:
                self._record_pool(
                    f"{self.model_name} (its draft)",
                    draft.network.kv_cache_bytes,
                    lambda: draft.pool.num_written_blocks,
                )
            self.warm_up_seconds = 0.0
            if warm_up:
                self._warm_up()
        except BaseException:
            network.close()  # no worker process outlives an engine that failed to start
            self._pool_lines.close()
            raise
        self._set_up_outputs(loaded)

    def _record_pool(self, model: str, reserved_bytes: int, written: Callable[[], int]) -> None:
        """A pool's line in the host's ledger, `written` its blocks written so far; none for
        a device's pool, taken whole when made (and seen so in the device's free memory)."""
        if self.device.type == "cpu":
            self._pool_lines.add(model, reserved_bytes, self.kv_pool.num_blocks, written)

    def _take_model(self, loaded: LoadedModel) -> None:
        self.model_config = loaded.config
        self.model_name = loaded.name
        self.model_facts = ModelFacts(
            loaded.config.architecture,
            loaded.parameter_count(),
            loaded.file_format,
            loaded.file_type,
            loaded.images.marker if loaded.images else None,
        )
        self.tokenizer = loaded.tokenizer
        self.images = ImageInputs(loaded.images, self.tokenizer) if loaded.images else None
        if loaded.images is not None and self.config.image_max_tokens is not None:
            rows = loaded.images.cap_rows(self.config.image_max_tokens)
            logger.info(
                "--image-max-tokens %d: an image takes at most %d rows",
                self.config.image_max_tokens, rows,
            )  # fmt: skip
        self.chat_template = resolve_chat_template(
            self.config.chat_template, loaded.chat_template, loaded.tokenizer
        )
        model_defaults = self.config.given_generation_config() or (
            loaded.sampling_defaults
            if self.config.generation_config == "auto"
            else SamplingDefaults()
        )
        overrides = self.config.override_generation_config or {}
        self.sampling_defaults = model_defaults.with_overrides(overrides)  # checked: validate()
        logger.info(
            "sampling defaults for unset fields: %s (--generation-config %s%s)",
            self.sampling_defaults.describe(),
            self.config.generation_config,
            ", --override-generation-config" if overrides else "",
        )

    def _size_kv_cache(
        self, loaded: LoadedModel, available: Callable[[], AvailableMemory]
    ) -> KVPoolSize:
        """The pool's blocks (from `available` for --kv-cache-memory auto) and the longest
        sequence, which the pool may cut; keeps both on the engine. Sized and recorded in the
        host's ledger in one turn (kv_pool_ledger.sizing)."""
        config = self.config
        cache = config.cache
        if (group := kv_pool_ledger.PoolGroup.from_env()) is not None:
            # One of a group of equals on this host (data-parallel replicas): their auto
            # pools share the fraction, none counting the others' lines.
            cache = replace(
                cache, kv_cache_memory_fraction=cache.kv_cache_memory_fraction / group.size
            )
        bytes_per_token = kv_bytes_per_token(loaded.config, self.kv_dtype)
        context = loaded.config.max_position_embeddings
        asked = config.scheduler.max_model_len
        with kv_pool_ledger.sizing():
            self.kv_pool = size_kv_pool(
                cache,
                bytes_per_token,
                config.scheduler.max_num_seqs,
                min(asked or context, context),
                available,
            )
            self._record_pool(
                self.model_name, self.kv_pool.bytes, lambda: self.scheduler.kv.num_written_blocks
            )
        if self.device.type == "cpu" and self.kv_pool.rule != "auto":  # auto fits by design
            _check_fits_in_memory(self.kv_pool.bytes, cache)
        self.max_model_len = fit_max_model_len(asked, context, self.kv_pool)
        return self.kv_pool

    def _network(self, loaded: LoadedModel, dtype: torch.dtype, dtype_reason: str) -> PagedModel:
        """The model over its paged KV cache, here or sharded over tensor-parallel ranks: the
        network first, then the pool sized from the memory it left, then allocated."""
        config = self.config
        self.kv_dtype = cache_dtype(config.cache.kv_cache_dtype, dtype)
        network: PagedModel
        if config.tensor_parallel_size > 1:
            # The worker ranks allocate their shares of the pool as they start, before any
            # shard exists to measure after: sized from an estimate (the checkpoint's
            # weight bytes off what is available now), not a measurement.
            size = config.tensor_parallel_size
            pool = self._size_kv_cache(
                loaded,
                lambda: available_memory.estimate_after_weights(
                    self.device, loaded.weights, dtype, size
                ),
            )
            # Rank 0 of T: the worker ranks start now and run their shards of every step.
            network, self.model_plan = launch_tensor_parallel(
                config, loaded, dtype, self.kv_dtype, self.device, pool.num_blocks
            )
        else:
            model, self.model_plan = build_model(config, loaded, dtype, self.device, dtype_reason)
            # The weights are in memory now: what is left is measured, not guessed.
            pool = self._size_kv_cache(loaded, lambda: available_memory.measure(self.device))
            network = self._paged(model, self.model_plan, loaded, pool.num_blocks)
            if config.cache.cache_reuse:
                try:
                    network.enable_kv_shift()
                except UnsupportedKVShift as error:
                    raise ConfigError(str(error)) from None
        kv_name = str(self.kv_dtype).removeprefix("torch.")
        self.model_plan = replace(self.model_plan, kv_cache_dtype=kv_name)
        logger.info(
            "KV cache: %s, %s",
            pool.describe(),
            kv_name if config.cache.kv_cache_dtype == "int8" else f"{kv_name} (the model's dtype)",
        )
        return network

    def _build_core(
        self, loaded: LoadedModel, network: PagedModel, num_blocks: int, dtype: torch.dtype
    ) -> None:
        """The runner (with a draft model if one guesses), the proposer and the engine core."""
        config = self.config
        self.draft: DraftModelProposer | None = None
        if config.speculative.speculative_method == "draft":
            self.draft = self._draft_proposer(loaded, num_blocks, dtype)
        self.executor = TorchRunner(network, config.seed, self.draft)
        spec = config.speculative
        # The draft model masks its guesses by a constrained request's grammar; prompt
        # lookup's are cut at the first token the grammar rejects.
        proposer = self.draft or GrammarCheckedProposer(
            NgramProposer(spec.ngram_min, spec.ngram_max), self.executor.structured
        )
        # The loop `iterserve simulate` runs too, here with the model as its executor.
        self.core = EngineCore.build(
            config,
            self.executor,
            num_blocks,
            self.max_model_len,
            proposer=proposer,
            async_scheduling=self._pipeline is not None,
            pipeline=self._pipeline,
        )
        self._set_up_loras(loaded)

    def _set_up_loras(self, loaded: LoadedModel) -> None:
        """The adapters' slots in the scheduler, and --lora-modules served from the start."""
        lora = self.config.lora
        self.scheduler.lora_slots = LoRASlots(lora.max_loras)
        self.loras = LoRARegistry(lora, self.executor.adapters, loaded.config, self.scheduler)
        for i, (name, path) in enumerate(lora.modules().items(), start=1):
            try:
                self.loras.add(LoRARequest(name, i, path))
            except InvalidRequestError as error:
                raise ConfigError(f"--lora-modules {name}={path}: {error}") from None

    def _set_up_outputs(self, loaded: LoadedModel) -> None:
        """What turns tokens into outputs: the stop tokens, grammars and request streams."""
        eos = set(loaded.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        # The texts llama.cpp's infill sampler compares (SamplingParams.infill_eog).
        self.executor.sampler.token_piece = token_text_reader(self.tokenizer)
        # Structured output's grammars; thread-safe, so the server compiles off this thread.
        self.grammars = GrammarCompiler(
            self.tokenizer, loaded.config.vocab_size, self.eos_token_ids
        )
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()

    def _paged(
        self,
        model: LlamaForCausalLM,
        plan: ModelPlan,
        loaded: LoadedModel,
        num_blocks: int,
    ) -> PagedModel:
        block_size = self.config.cache.block_size
        return PagedModel(
            model,
            allocate_kv_caches(loaded.config, num_blocks, block_size, self.kv_dtype, self.device),
            block_size,
            self.device,
            plan.paged_attention_kernel,
        )

    def _draft_proposer(
        self, target: LoadedModel, num_blocks: int, dtype: torch.dtype
    ) -> DraftModelProposer:
        path = self.config.speculative.draft_model
        config = self.config
        if path == SELF_INT4_DRAFT:
            # The model's own GGUF blocks guess for it; with --weights bf16 the text is the
            # bf16 model's, at part of the quantized speed.
            if not target.quantized:
                raise ConfigError(
                    f"--draft-model {SELF_INT4_DRAFT} needs a quantized GGUF model (Q4_K, "
                    "Q4_0, ...)"
                )
            path, config = self.config.model, replace(self.config, weights="int4")
        draft = load_model(path, dtype)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ConfigError(
                f"--draft-model {path} has a vocabulary of {draft.config.vocab_size} tokens but "
                f"the model's has {target.config.vocab_size}: a draft must share the model's "
                "tokenizer"
            )
        if draft.config.max_position_embeddings < self.max_model_len:
            raise ConfigError(
                f"--draft-model {path} handles {draft.config.max_position_embeddings} positions, "
                f"fewer than the {self.max_model_len} requests may reach; lower --max-model-len"
            )
        # The draft guesses with its own base weights, whatever adapter a request runs.
        model, plan = build_model(replace(config, lora=LoRAConfig()), draft, dtype, self.device)
        logger.info("draft model %s: %s kernels, step %s", draft.name, plan.backend, plan.step)
        return DraftModelProposer(self._paged(model, plan, draft, num_blocks), num_blocks)

    def close(self) -> None:
        """Release what outlives the engine object: the tensor-parallel worker processes and
        the pool's line in the host's ledger. Idempotent."""
        self.core.close()
        self.executor.close()
        self._pool_lines.close()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def stats(self) -> StepStats:
        return self.core.stats

    def warm_up(self) -> float:
        """Compile (or load compiled graphs) and run every kernel once, so that a user's first
        step is not the slow one; returns and records the seconds it took."""
        if self._pipeline is not None:
            return self._pipeline.call(self._warm_up)
        return self._warm_up()

    def _warm_up(self) -> float:
        self.warm_up_seconds = self.executor.warm_up()
        if self.draft is not None:
            self.warm_up_seconds += self.draft.warm_up()
        logger.info("engine warm: %.1f s", self.warm_up_seconds)
        return self.warm_up_seconds

    # ---- requests --------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, ImagesPrompt):
            return self.image_input(prompt).token_ids
        if isinstance(prompt, str | RenderedChat):
            return encode_prompt(self.tokenizer, prompt)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(prompt)

    def image_input(self, prompt: ImagesPrompt) -> ImagesInput:
        """A prompt's images encoded (engine/images.py), and its tokens around them."""
        if self.images is None:
            raise InvalidRequestError(
                f"images: {self.model_name} takes no images (text only)", "images"
            )
        return self.images.prompt(prompt)

    def _prompt_ids(self, prompt: Prompt, truncation: PromptTruncation | None) -> list[int]:
        token_ids = self.tokenize(prompt)
        if truncation is None:
            return token_ids
        return truncation.apply(token_ids, self.scheduler.max_model_len)

    def add_request(
        self,
        prompt: Prompt | ImagesInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lane: str = "interactive",
        priority: int = 0,
        arrival_time: float | None = None,
        pooling: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; raises InvalidRequestError (nothing queued) if it cannot run.
        With `pooling` it is an embedding request (`params` ignored): its prompt is computed
        and pooled into one vector, RequestOutput.embedding (with task "score", a reranker's
        pair, `pair_prompts`' ids: RequestOutput.score). `lora_request`: the adapter it
        runs (added first if the engine does not serve it)."""
        if pooling is not None:
            if isinstance(prompt, EmbedsPrompt):
                raise InvalidRequestError(
                    f"{PROMPT_EMBEDS_FIELD}: taken for generation only", PROMPT_EMBEDS_FIELD
                )
            if isinstance(prompt, ImagesPrompt | ImagesInput):
                raise InvalidRequestError("images: taken for generation only", "images")
            return self._add_embedding(
                prompt, pooling, request_id, priority, arrival_time, lora_request
            )
        if not self.pooling.generate:
            routes = "/v1/rerank and /v1/score" if self.pooling.score else "/v1/embeddings"
            raise InvalidRequestError(
                f"this server does not generate ({self.pooling.describe()}): use {routes}",
                "model",
            )
        params = params or SamplingParams()
        params.validate()
        if params.n != 1:
            raise InvalidRequestError(
                "the engine runs one sequence per request; fan out n above it"
            )
        vocab = self.model_config.vocab_size
        check_token_ids(params, vocab)
        if params.structured_output is not None:
            self.grammars.attach(params.structured_output)  # a cache hit from the server
        request_id = request_id or f"req-{next(self._ids)}"
        lora = self.loras.resolve(lora_request) if lora_request is not None else None
        embeds = None
        if isinstance(prompt, EmbedsPrompt):
            embeds = self._prompt_embeds(prompt, params)
            prompt_ids = [0] * len(embeds.rows)  # placeholders: the rows are the prompt
        elif isinstance(prompt, ImagesPrompt | ImagesInput):
            given = prompt if isinstance(prompt, ImagesInput) else self.image_input(prompt)
            prompt_ids, embeds = given.token_ids, given.embeds
            if (
                params.truncation is not None
                and params.truncation.apply(prompt_ids, self.scheduler.max_model_len) != prompt_ids
            ):
                raise InvalidRequestError(
                    "truncate_prompt_tokens: a prompt with images is not cut",
                    "truncate_prompt_tokens",
                )
        else:
            prompt_ids = self._prompt_ids(prompt, params.truncation)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            prompt_embeds=embeds,
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            lane=lane,
            priority=priority,
            bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words, vocab),
            lora_id=lora.lora_int_id if lora else 0,
            lora_name=lora.lora_name if lora else None,
        )
        self.scheduler.add_request(request)
        self._streams[request_id] = _Stream(
            request,
            IncrementalDetokenizer(
                self.tokenizer,
                [] if embeds and embeds.whole_prompt else request.prompt_token_ids,
                params.skip_special_tokens,
            ),
            StopStringMatcher(params.stop, params.include_stop_str_in_output),
        )
        return request_id

    def _prompt_embeds(self, prompt: EmbedsPrompt, params: SamplingParams) -> PromptEmbeds:
        """A prompt given as input rows, checked (engine/prompt_embeds.py): what it cannot
        give is InvalidRequestError naming the field."""
        field = PROMPT_EMBEDS_FIELD
        if not self.config.enable_prompt_embeds:
            raise InvalidRequestError(
                f"{field}: prompts given as input rows are off; start the server with "
                "--enable-prompt-embeds",
                field,
            )
        config = self.model_config
        if config.per_layer_input_size:
            raise InvalidRequestError(
                f"{field}: not taken for {config.architecture} with per-layer inputs, which "
                "are looked up by token id",
                field,
            )
        if params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt_logprobs: a prompt given as input rows has no tokens to score",
                "prompt_logprobs",
            )
        rows = checked_rows(prompt.prompt_embeds, config.hidden_size, self.dtype, field)
        if params.truncation is not None:
            kept = params.truncation.apply(list(range(len(rows))), self.scheduler.max_model_len)
            rows = rows[kept[0] : kept[-1] + 1]
        return prompt_embeds(rows)

    def _add_embedding(
        self,
        prompt: Prompt,
        pooling: PoolingParams,
        request_id: str | None,
        priority: int,
        arrival_time: float | None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """An embedding or scoring request, in the embed lane (its states computed with
        `lora_request`'s adapter, if any; a score head stays the base's); a bad input is
        InvalidRequestError naming `input` (the embeddings API's field; the scoring APIs
        name their own)."""
        pooling = self.pooling.request_params(pooling)
        request_id = request_id or f"{pooling.task}-{next(self._ids)}"
        lora = self.loras.resolve(lora_request) if lora_request is not None else None
        try:
            request = Request(
                request_id=request_id,
                prompt_token_ids=self._prompt_ids(prompt, pooling.truncation),
                sampling_params=SamplingParams(max_tokens=1),  # never samples
                arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                lane=EMBED_LANE,
                priority=priority,
                pooling_params=pooling,
                lora_id=lora.lora_int_id if lora else 0,
                lora_name=lora.lora_name if lora else None,
            )
            self.scheduler.add_request(request)
        except InvalidRequestError as error:
            field = "documents" if pooling.task == "score" else "input"
            param = field if error.param in ("prompt", "max_tokens") else error.param
            raise InvalidRequestError(str(error), param, error.code) from None
        # No text comes out of it: an empty context spares decoding the prompt's tail.
        self._streams[request_id] = _Stream(
            request, IncrementalDetokenizer(self.tokenizer, []), StopStringMatcher([])
        )
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now and free its KV blocks; None if it is unknown or done."""
        if self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is None:
            return None
        stream = self._streams.pop(request_id)
        return self._output(stream, [], [], "", "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (benchmarks start cold); returns
        how many."""
        return self.scheduler.reset_prefix_cache()

    def unfinished_request_ids(self) -> list[str]:
        return self.scheduler.request_ids()

    def max_request_tokens(self) -> int:
        """Most tokens (prompt + output) one request can hold here."""
        return self.scheduler.token_capacity()

    # ---- the loop ----------------------------------------------------------------

    def step(self, no_more_arrivals: bool = False) -> EngineStep:
        """One iteration: its outputs, and whether it computed anything. Raises
        StepFailedError, naming the step's requests, when running the planned step
        fails; the caller ends those requests (abort_request) and may step again: no
        other request was touched. `no_more_arrivals`: see Scheduler.schedule (an
        offline caller that has added everything says so)."""
        step = self.core.step(no_more_arrivals)
        self._pool_lines.record()
        try:
            outputs = [self._emit(update) for update in step.updates]
        except Exception as error:
            raise StepFailedError(step.request_ids, error) from error
        if not self.has_unfinished():
            # All that can be in flight now is ended requests' tokens: an idle engine keeps
            # no step pending, so its counters and the executor's state are settled.
            self.core.drain()
        return EngineStep(outputs, step.did_work, step.scheduled)

    def _emit(self, update: RequestUpdate) -> RequestOutput:
        request_id = update.request_id
        stream = self._streams[request_id]
        token_ids = update.new_token_ids
        finish_reason = update.finish_reason
        delta, stopped, kept = "", False, 0
        # A request the scheduler stopped ended on a stop token (EOS or stop_token_ids):
        # its text is not the answer's, as in vLLM (`<|im_end|>`, Harmony's `<|call|>` are
        # kept out even where special tokens are shown), unless asked for.
        params = stream.request.sampling_params
        shown = len(token_ids) if params.detokenize else 0
        if finish_reason == "stop" and not params.include_stop_str_in_output and shown:
            shown -= 1
        # Token by token, so a stop string ends the request at the token that completed
        # it even when a step produced several (accepted speculative drafts).
        for index, token_id in enumerate(token_ids):
            text = stream.detokenizer.add_tokens([token_id]) if index < shown else ""
            kept += 1
            if kept == len(token_ids) and finish_reason is not None:
                text += stream.detokenizer.flush()  # release a held-back partial character
            piece, stopped = stream.stops.feed(text)
            delta += piece
            if stopped:
                break
        if stopped and finish_reason is None:
            self.scheduler.finish_request(
                request_id, RequestStatus.FINISHED_STOPPED, num_dropped=len(token_ids) - kept
            )
            finish_reason = "stop"
        elif finish_reason is not None and not stopped:
            delta += stream.stops.flush()
        if finish_reason is not None:
            del self._streams[request_id]
        output = self._output(
            stream, token_ids[:kept], update.new_logprobs[:kept], delta, finish_reason
        )
        output.stop_reason = stream.stops.stop_reason
        stop_ids = params.stop_token_ids
        if finish_reason == "stop" and not stopped and token_ids and token_ids[-1] in stop_ids:
            output.stop_reason = token_ids[-1]
        pooling = stream.request.pooling_params
        if update.embedding is not None and pooling is not None and pooling.task == "score":
            output.score = finish_score(update.embedding)
        elif update.embedding is not None and pooling is not None and pooling.task == "classify":
            output.probs = finish_classification(update.embedding)
        elif update.embedding is not None and pooling is not None:
            output.embedding = finish_embedding(update.embedding, pooling)
        return output

    def _output(
        self,
        stream: _Stream,
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
        delta: str,
        finish_reason: FinishReason | None,
    ) -> RequestOutput:
        request = stream.request
        stream.text += delta
        wants_logprobs = request.sampling_params.logprobs is not None
        if wants_logprobs:
            stream.logprobs.extend(logprobs)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            text=stream.text,
            token_ids=list(request.output_token_ids),
            delta_text=delta,
            delta_token_ids=token_ids,
            finish_reason=finish_reason,
            # Copies: outputs may be read on another thread while later steps go on.
            logprobs=list(stream.logprobs) if wants_logprobs else None,
            delta_logprobs=logprobs if wants_logprobs else [],
            prompt_logprobs=None
            if request.sampling_params.prompt_logprobs is None
            else [None, *request.prompt_logprobs],
            num_cached_tokens=request.num_cached_tokens,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
            timings=replace(request.timings, token_times=request.timings.token_times[:]),
            lora_name=request.lora_name,
        )
