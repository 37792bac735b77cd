"""The shape of a Llama-family network, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from iterserve.model.family import FAMILIES, FamilyTraits

# The families whose files carry Granite's multipliers (dense and MoE).
GRANITE_FAMILIES = ("granite", "granitemoe")
# The families of LFM2's hybrid layers (short convolutions and attention), dense and MoE.
LFM2_FAMILIES = ("lfm2", "lfm2_moe")
# Granite's ModelConfig fields, under the names its config.json gives them.
GRANITE_MULTIPLIERS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)


def rope_every_layer_but(interval: int, layers: int) -> tuple[bool, ...]:
    """ModelConfig.rope_layers with every `interval`-th layer left without RoPE (SmolLM3's
    NoPE layers: its config's no_rope_layer_interval, llama.cpp's fixed step of 4)."""
    return tuple((i + 1) % interval != 0 for i in range(layers))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters in Hugging Face `config.json` terms.

    `architecture` is a key of model/family.py's FAMILIES (SmolLM is "llama").
    `rope_scaling` is the HF dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None;
    model/rope.py lists the variants. `max_position_embeddings` is the longest sequence
    served (for dynamic NTK and YaRN, the scaled length).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mistral's sliding window: a query at position p sees keys p - window + 1 .. p only.
    sliding_window: int | None = None
    # A sparse mixture-of-experts MLP on every layer (Mixtral, Qwen3-MoE; model/moe.py):
    # experts per layer (0: a dense MLP) and how many of them each token is routed to.
    # `intermediate_size` is then one expert's width. `norm_topk_prob`: whether a token's k
    # weights are renormalised to sum to one (Mixtral always; Qwen3-MoE's config says).
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    # With experts: the width of a dense expert every token runs beside its routed ones
    # (Qwen2-MoE's shared expert, model/shared_expert.py); 0: none.
    shared_expert_intermediate_size: int = 0
    # With experts: how many leading layers have a dense MLP instead, and its width (LFM2-MoE's
    # num_dense_layers and intermediate_size; llama.cpp's leading_dense_block_count).
    leading_dense_layers: int = 0
    dense_intermediate_size: int = 0
    # With experts: every layer's experts run beside a dense MLP of `dense_intermediate_size`
    # (Gemma 4 26B-A4B: each output normed, their sum normed again before the residual add).
    experts_beside_dense: bool = False
    # How the router scores a token's experts: a softmax over all of them (Mixtral and most),
    # or each by its own sigmoid (LFM2-MoE, whose top-k weights are renormalised with an
    # epsilon of 1e-6 where norm_topk_prob says). With `expert_selection_bias`, a learned bias
    # a layer (an expert's `expert_bias`) joins the scores to pick the top k but not to weigh
    # them. The weights are finally scaled by `routed_scaling_factor`.
    router_scoring: Literal["softmax", "sigmoid"] = "softmax"
    expert_selection_bias: bool = False
    routed_scaling_factor: float = 1.0
    # gpt-oss's expert SwiGLU (alpha, limit): gate clamped to <= limit, up to [-limit, limit],
    # then (up + 1) * gate * sigmoid(alpha * gate). None: silu(gate) * up.
    swiglu_clamp: tuple[float, float] | None = None
    # Which layers the window applies to (Gemma: alternating); None: every layer.
    sliding_window_layers: tuple[bool, ...] | None = None
    # Gemma 2: scores -> cap * tanh(scores / cap) in attention, and likewise the logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma: attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma 3: the sliding-window layers' own (plain) RoPE base; None: all layers share one.
    local_rope_theta: float | None = None
    # Phi-4-mini: RoPE turns only the first rotary_dim dimensions of each head; None: all.
    rotary_dim: int | None = None
    # Which layers rotate q and k (SmolLM3: three in four, its "NoPE" layers not); None: all.
    rope_layers: tuple[bool, ...] | None = None
    # Granite: embeddings times embedding_multiplier, each attention and MLP output times
    # residual_multiplier before its residual add, scores times attention_multiplier (instead
    # of head_dim ** -0.5), logits divided by logits_scaling. None: not done.
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    # Ministral 3 (Llama 4's attention temperature): a query at position p is scaled by
    # 1 + beta * ln(1 + floor(p / length)) after RoPE, (beta, length); 1 below `length` (its
    # original context). None: not done.
    query_temperature: tuple[float, int] | None = None
    # LFM2: which layers mix tokens by a short causal convolution (model/short_conv.py)
    # instead of attention, and the convolution's width in tokens (its conv_L_cache: 3).
    conv_layers: tuple[bool, ...] | None = None
    conv_kernel: int = 0
    # Gemma 4: the full-attention layers' (those outside the window) own head size and kv
    # heads (its global_head_dim, num_global_key_value_heads); None: head_dim and
    # num_key_value_heads, as on every other layer.
    full_head_dim: int | None = None
    full_kv_heads: int | None = None
    # Gemma 4 (31B, 26B-A4B): the full layers' keys are their values too (attention_k_eq_v):
    # no v_proj; V is the key projection before its norm and rotation.
    full_keys_as_values: bool = False
    # Gemma 4 (E2B, E4B): the last `kv_shared_layers` layers store no K/V of their own; each
    # attends over the cache of the last earlier layer of its kind (windowed or full). With
    # `shared_layers_double_mlp` (use_double_wide_mlp) their MLPs are twice as wide.
    kv_shared_layers: int = 0
    shared_layers_double_mlp: bool = False
    # Gemma 4's per-layer embeddings (E2B, E4B): a second table gives each token a row of
    # `per_layer_input_size` values for every layer, mixed with a projection of its embedding,
    # which each layer gates into its output (model/per_layer_inputs.py). 0: none.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # The token whose per-layer row is looked up where a row is given in a token's place
    # (an image's soft tokens: transformers looks them up as padding).
    per_layer_pad_id: int = 0
    # M-RoPE (Qwen3-VL): how many of a head's rotary frequencies turn by each of a token's
    # three positions (time, height, width), and whether the three take turns among the
    # frequencies (Qwen3-VL's `mrope_interleaved`) or take a run each. Text rotates as
    # plain RoPE (its three positions are one); an image's tokens by their grid positions.
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = False

    def layer_window(self, index: int) -> int:
        """Layer `index`'s sliding window; 0: full attention."""
        if not self.sliding_window:
            return 0
        if self.sliding_window_layers is None or self.sliding_window_layers[index]:
            return self.sliding_window
        return 0

    def layer_rotates(self, index: int) -> bool:
        """Whether layer `index` applies RoPE to its queries and keys."""
        return self.rope_layers is None or self.rope_layers[index]

    def layer_has_experts(self, index: int) -> bool:
        """Whether layer `index`'s MLP is a mixture of experts (model/moe.py)."""
        return self.num_local_experts > 0 and index >= self.leading_dense_layers

    def layer_mlp_width(self, index: int) -> int:
        """Layer `index`'s (dense) MLP width: a leading dense layer's or the one beside the
        experts (Gemma 4 26B-A4B), a KV-sharing layer's doubled one (Gemma 4 E2B), else
        `intermediate_size` (one expert's in a layer of experts)."""
        if self.num_local_experts and (
            index < self.leading_dense_layers or self.experts_beside_dense
        ):
            return self.dense_intermediate_size
        if self.shared_layers_double_mlp and self.layer_kv_source(index) != index:
            return 2 * self.intermediate_size
        return self.intermediate_size

    def layer_is_full(self, index: int) -> bool:
        """Whether layer `index` attends over the whole context (Gemma's full layers)."""
        return self.layer_window(index) == 0

    def layer_head_dim(self, index: int) -> int:
        """Layer `index`'s head size (Gemma 4's full layers: their own)."""
        if self.full_head_dim is not None and self.layer_is_full(index):
            return self.full_head_dim
        return self.head_dim

    def layer_kv_heads(self, index: int) -> int:
        """Layer `index`'s kv heads (Gemma 4's full layers: their own)."""
        if self.full_kv_heads is not None and self.layer_is_full(index):
            return self.full_kv_heads
        return self.num_key_value_heads

    def layer_keys_as_values(self, index: int) -> bool:
        """Whether layer `index`'s values are its keys (Gemma 4's attention_k_eq_v)."""
        return self.full_keys_as_values and self.layer_is_full(index)

    def layer_kv_source(self, index: int) -> int:
        """The layer whose KV cache layer `index` reads: itself, or for one of the last
        `kv_shared_layers` layers (Gemma 4 E2B, E4B) the last layer of its kind before them."""
        first_shared = self.num_hidden_layers - self.kv_shared_layers
        if index < first_shared:
            return index
        full = self.layer_is_full(index)
        sources = [i for i in range(first_shared) if self.layer_is_full(i) == full]
        if not sources:
            raise ValueError(f"layer {index} shares the cache of no earlier layer of its kind")
        return sources[-1]

    def layer_is_conv(self, index: int) -> bool:
        """Whether layer `index` is a short convolution (LFM2) rather than attention."""
        return self.conv_layers is not None and self.conv_layers[index]

    @property
    def conv_history(self) -> int:
        """How many earlier tokens' convolution inputs a token reads (0: no conv layers)."""
        return self.conv_kernel - 1 if self.conv_layers is not None and any(self.conv_layers) else 0

    @property
    def stream_norm_eps(self) -> float:
        """The eps of the norms that read the residual stream. model/llama.py carries a
        residual_multiplier m (Granite) as the stream h / m, so each block's output adds
        unscaled: an RMS norm of h / m with eps / m^2 is exactly the norm of h with eps."""
        m = self.residual_multiplier or 1.0
        return self.rms_norm_eps / (m * m)

    @property
    def embed_scale(self) -> float | None:
        """What the token embeddings are multiplied by before the layers (None: nothing).
        Gemma: sqrt(hidden), as transformers does. Granite: its embedding multiplier, over
        its residual multiplier m: the stream is carried as h / m (`stream_norm_eps`), so no
        block output needs scaling by m."""
        if self.traits.embed_scale:
            return self.hidden_size**0.5
        if self.embedding_multiplier or self.residual_multiplier:
            return (self.embedding_multiplier or 1.0) / (self.residual_multiplier or 1.0)
        return None

    @property
    def given_rows_scale(self) -> float | None:
        """What rows given in place of token embeddings (prompt_embeds) are multiplied by,
        to be what transformers' `inputs_embeds` is: Gemma's embedding module scales its own
        output (`get_input_embeddings()(ids)` is scaled already, and given rows are taken as
        they are); Granite scales `inputs_embeds` in its forward, given or looked up."""
        return None if self.traits.embed_scale else self.embed_scale

    @property
    def rope_dim(self) -> int:
        """How many dimensions of each head RoPE turns: the width of the rotary tables (of
        the full layers' where their heads have a size of their own: Gemma 4)."""
        return self.rotary_dim or self.full_head_dim or self.head_dim

    @property
    def local_rope_dim(self) -> int:
        """The width of the second rotary tables (Gemma's windowed layers')."""
        return self.rotary_dim or self.head_dim

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer has the same attention shape and keeps its own K/V (what
        the C++ layer ops, tensor parallelism and LoRA take for granted)."""
        return (
            self.full_head_dim in (None, self.head_dim)
            and self.full_kv_heads in (None, self.num_key_value_heads)
            and not self.full_keys_as_values
            and not self.kv_shared_layers
            and not self.per_layer_input_size
        )

    @property
    def traits(self) -> FamilyTraits:
        return FAMILIES[self.architecture]
