"""Model configuration read from a Hugging Face `config.json`.

Only the fields the forward pass needs are kept. Values are checked when the config is built, so a
checkpoint this code cannot run fails at load time with the field and value named, not with a shape
error deep inside a jitted step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from jaxpaged.pallas_kernels.backends import AttentionSpec
from jaxpaged.pallas_kernels.plan import KernelPlan
# RoPE lives in `models.rope`; RopeScaling and SUPPORTED_ROPE_TYPES are re-exported from here.
from jaxpaged.models.rope import (SUPPORTED_ROPE_TYPES, RopeScaling, RopeTables, parse_hf_rope,
                                  rope_tables)

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # HF `hidden_act` names
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF `layer_types` values


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family decoder (Llama 2/3, SmolLM2): GQA, RoPE, RMSNorm, SwiGLU. Families that
    add to it subclass it (see `models.qwen3`); the engine reads only `base.ModelConfig`."""

    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)  # HF names it reads
    # The rope types this family's forward applies (`LlamaForCausalLM` rotates with
    # `rope_tables()` through `models.rope.rope_cos_sin`, which computes them all).
    ROPE_TYPES: ClassVar[tuple[str, ...]] = SUPPORTED_ROPE_TYPES
    # How the family's HF config class reads RoPE (see `models.rope.parse_hf_rope`): its
    # `default_theta`, the rope types it renames (Phi-3: {"su": "longrope", "yarn": "longrope"}),
    # and config.json keys its class defaults when absent (Phi-3:
    # {"original_max_position_embeddings": 4096}).
    DEFAULT_ROPE_THETA: ClassVar[float] = 10000.0
    ROPE_TYPE_ALIASES: ClassVar[dict[str, str]] = {}
    HF_ROPE_DEFAULTS: ClassVar[dict[str, Any]] = {}

    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_hidden_layers: int  # L
    num_attention_heads: int  # N
    num_key_value_heads: int  # K; N % K == 0
    head_dim: int  # H
    max_position_embeddings: int  # tokens
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # RoPE rotates the first int(head_dim * partial_rotary_factor) features of each head (Phi-3).
    partial_rotary_factor: float = 1.0
    # What the families built on this config change (defaults: Llama):
    hidden_act: str = "silu"  # the MLP's activation, one of SUPPORTED_ACTIVATIONS
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    sliding_window: int | None = None  # tokens a sliding layer attends to, itself included
    # Per layer, "full_attention" or "sliding_attention" (HF `layer_types`); None: every layer
    # slides when `sliding_window` is set (Mistral, Phi-3).
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None  # attention scale its ** -0.5 (Gemma)
    attn_logit_softcapping: float | None = None  # attention logit soft-cap (Gemma 2)
    final_logit_softcapping: float | None = None  # output logit soft-cap (Gemma 2)
    # Granite's multipliers: embeddings times `embedding_multiplier`, attention scaled by
    # `attention_multiplier` (in place of head_dim ** -0.5), each block's output times
    # `residual_multiplier` before its residual add, logits divided by `logits_scaling`.
    embedding_multiplier: float | None = None
    attention_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    # The sliding layers' own RoPE (theta, scaling), when they have one (Gemma 3's local base).
    local_rope: tuple[float, RopeScaling] | None = None
    # How the model is split over devices, not read from config.json (`for_tensor_parallel`):
    tensor_parallel_size: int = 1  # tp: devices on the mesh's "model" axis
    # Copies of each checkpoint KV head: num_key_value_heads is the checkpoint's times this
    # (> 1 where tp exceeds the checkpoint's KV heads).
    kv_head_replicas: int = 1
    # The kernels the engine's platform chose (`Platform.kernel_plan`), not read from
    # config.json either: the layers built from this config read it at call time.
    kernels: KernelPlan = KernelPlan()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        rope_type = self.rope_scaling.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES or rope_type not in self.ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported by {type(self).__name__}; "
                             f"supported: {self.ROPE_TYPES} (models.rope computes "
                             f"{SUPPORTED_ROPE_TYPES})")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"config.partial_rotary_factor must be in (0, 1], got "
                             f"{self.partial_rotary_factor!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary dim int(head_dim * partial_rotary_factor) = "
                             f"{self.rotary_dim} must be even and >= 2")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: "
                             f"{SUPPORTED_ACTIVATIONS}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"config.sliding_window must be a positive int or null, got "
                             f"{self.sliding_window!r}")
        if self.layer_types is not None:
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad or len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"config.layer_types must give one of {LAYER_TYPES} for each "
                                 f"of the {self.num_hidden_layers} layers, got "
                                 f"{list(self.layer_types)}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Builds the config from the fields of a HF `LlamaConfig` (transformers 4 or 5 layout)."""
        architectures = d.get("architectures") or []
        if not any(a in cls.ARCHITECTURES for a in architectures):
            raise ValueError(f"architectures {architectures} are not read by {cls.__name__}, "
                             f"which reads {list(cls.ARCHITECTURES)}")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ValueError(f"{flag}=True is not supported by {cls.__name__}")
        num_heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in `rope_theta` and
        # `rope_scaling` (`models.rope.parse_hf_rope` reads both). Parameters nested by layer
        # type (transformers 5's Gemma 3) give the full layers' and the sliding layers' own.
        d_rope = {**cls.HF_ROPE_DEFAULTS, **d}
        kw = dict(default_theta=cls.DEFAULT_ROPE_THETA, type_aliases=cls.ROPE_TYPE_ALIASES)
        params = d.get("rope_parameters") or {}
        nested = "full_attention" in params and isinstance(params["full_attention"], dict)
        rope = parse_hf_rope(d_rope, layer_type="full_attention" if nested else None, **kw)
        local = (parse_hf_rope(d_rope, layer_type="sliding_attention", **kw)
                 if nested and isinstance(params.get("sliding_attention"), dict) else None)
        layer_types = d.get("layer_types")
        optional = lambda key: None if d.get(key) is None else float(d[key])
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            partial_rotary_factor=rope.partial_rotary_factor,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=d.get("hidden_act") or "silu",
            sliding_window=d.get("sliding_window"),
            layer_types=None if layer_types is None else tuple(layer_types),
            query_pre_attn_scalar=optional("query_pre_attn_scalar"),
            attn_logit_softcapping=optional("attn_logit_softcapping"),
            final_logit_softcapping=optional("final_logit_softcapping"),
            embedding_multiplier=optional("embedding_multiplier"),
            attention_multiplier=optional("attention_multiplier"),
            residual_multiplier=optional("residual_multiplier"),
            logits_scaling=optional("logits_scaling"),
            local_rope=None if local is None else (local.theta, local.scaling),
        )

    def for_tensor_parallel(self, tp: int, expert_parallel: bool = False) -> "LlamaConfig":
        """This config split over tp devices: heads, the MLP's hidden units and the vocabulary
        in tp equal parts (`models.layers`). Where tp exceeds the KV heads K, each KV head is
        repeated tp / K times (tpu-inference does the same), so every device holds one: the
        KV pool and the k/v projections then cost tp / K times their memory, and each device
        reads only its own copy.

        A Mixture-of-Experts model's experts are split too (`MoeSpec.for_tensor_parallel`):
        each expert's hidden units, or with `expert_parallel` whole experts per device.

        Raises:
          ValueError: tp does not divide the query heads, the MLP's hidden units, the
            vocabulary (or the experts, or their hidden units), or neither tp nor K divides the
            other (named); `expert_parallel` on a model without experts.
        """
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if self.tensor_parallel_size != 1:
            raise ValueError("the config is already split for tensor parallelism")
        N, K = self.num_attention_heads, self.num_key_value_heads
        for name, value in (("num_attention_heads", N), ("intermediate_size",
                            self.intermediate_size), ("vocab_size", self.vocab_size)):
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                                 f"{name}={value}")
        if K % tp and tp % K:
            raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={K}: one must "
                             "divide the other (KV heads are split, or repeated to one per "
                             "device)")
        replicas = max(1, tp // K)
        moe = getattr(self, "moe", None)  # a Mixture-of-Experts family's (`models.moe.MoeSpec`)
        if expert_parallel and moe is None:
            raise ValueError("enable_expert_parallel needs a Mixture-of-Experts model; "
                             f"{type(self).__name__} has no experts")
        split = {} if moe is None else {"moe": moe.for_tensor_parallel(tp, expert_parallel)}
        return dataclasses.replace(self, num_key_value_heads=K * replicas, tensor_parallel_size=tp,
                                   kv_head_replicas=replicas, **split)

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends to the last `sliding_window` tokens only."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def attention_spec(self, layer: int) -> AttentionSpec:
        """Layer `layer`'s attention: scale head_dim ** -0.5 (or query_pre_attn_scalar ** -0.5,
        or attention_multiplier),
        the sliding window on sliding layers, the attention logit soft-cap."""
        scale = (self.attention_multiplier if self.attention_multiplier is not None
                 else (self.query_pre_attn_scalar or self.head_dim) ** -0.5)
        return AttentionSpec(scale=scale,
                             sliding_window=self.sliding_window if self.is_sliding(layer) else None,
                             soft_cap=self.attn_logit_softcapping)

    def rope_kind(self, layer: int) -> str:
        """Which RoPE tables `layer` rotates with: "local" (its sliding layers' own base) or
        "global"."""
        return "local" if self.local_rope is not None and self.is_sliding(layer) else "global"

    @property
    def rope_switch_length(self) -> int | None:
        """longrope's `original_max_position_embeddings`: a sequence longer than this rotates
        with the long factors, all its tokens (transformers' Phi-3 computes the cache again when
        a sequence passes it); None for the other types."""
        if self.rope_scaling.rope_type != "longrope":
            return None
        return self.rope_scaling.original_max_position_embeddings

    @property
    def num_queries_per_kv(self) -> int:
        """G: query heads sharing one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rotary_dim(self) -> int:
        """R: the rotated features of each head, int(head_dim * partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_tables(self, kind: str = "global") -> RopeTables:
        """RoPE's tables (of `rope_kind` `kind`) for `models.rope.rope_cos_sin`: inverse
        frequencies f32[R // 2], the attention factor, and for longrope the long frequencies and
        their threshold."""
        theta, scaling = ((self.rope_theta, self.rope_scaling) if kind == "global"
                          else self.local_rope)
        return rope_tables(self.rotary_dim, theta, scaling, self.max_position_embeddings)

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies f32[R // 2] after scaling (R = H unless partial).

        `rope_tables().inv_freq`: transformers' `ROPE_INIT_FUNCTIONS` computed in float32 as HF
        does (bit for bit but for the power's last ulp on a few elements; see `models.rope`).
        Only for types whose cos/sin need nothing else.

        Raises:
          ValueError: the type also needs an attention factor != 1 or longrope's switch; use
            `rope_tables()` with `models.rope.rope_cos_sin`.
        """
        tables = self.rope_tables()
        if tables.is_longrope or tables.attention_factor != 1.0:
            raise ValueError(
                f"rope type {self.rope_scaling.rope_type!r} needs more than inverse frequencies "
                f"(attention factor {tables.attention_factor}"
                f"{', long/short factors' if tables.is_longrope else ''}); use rope_tables() "
                "with models.rope.rope_cos_sin")
        return tables.inv_freq
