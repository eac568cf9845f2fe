"""Model configuration read from a Hugging Face `config.json`.

Only the fields the forward pass needs are kept. Values are checked when the config is built, so a
checkpoint this code cannot run fails at load time with the field and value named, not with a shape
error deep inside a jitted step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import numpy as np

from jaxpaged.pallas_kernels.backends import AttentionSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as `transformers.modeling_rope_utils` defines it."""

    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family decoder (Llama 2/3, SmolLM2): GQA, RoPE, RMSNorm, SwiGLU. Families that
    add to it subclass it (see `models.qwen3`); the engine reads only `base.ModelConfig`."""

    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)  # HF names it reads

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
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_scaling.rope_type!r} is not supported; "
                             f"supported: {SUPPORTED_ROPE_TYPES}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Builds the config from the fields of a HF `LlamaConfig` (transformers 4 or 5 layout)."""
        architectures = d.get("architectures") or []
        if not any(a in cls.ARCHITECTURES for a in architectures):
            raise ValueError(f"architectures {architectures} are not read by {cls.__name__}, "
                             f"which reads {list(cls.ARCHITECTURES)}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; only 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ValueError(f"{flag}=True is not supported by the Llama definition")
        num_heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in `rope_theta` and
        # `rope_scaling`.
        rope = dict(d.get("rope_scaling") or {})
        rope.update(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling_fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type"}
        scaling = RopeScaling(rope_type=rope_type,
                              **{k: v for k, v in rope.items() if k in scaling_fields})
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
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def attention_spec(self, layer: int) -> AttentionSpec:
        """Every Llama layer attends to the whole context, scaled by head_dim ** -0.5."""
        return AttentionSpec(scale=self.head_dim ** -0.5)

    @property
    def num_queries_per_kv(self) -> int:
        """G: query heads sharing one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies f32[H // 2] after scaling.

        Follows transformers' `ROPE_INIT_FUNCTIONS` ("default", "linear", "llama3"), computed in
        float32 as HF does, so angles match HF's to the bit.
        """
        h = self.head_dim
        inv = 1.0 / (np.float32(self.rope_theta) ** (np.arange(0, h, 2, dtype=np.float32) / h))
        s = self.rope_scaling
        if s.rope_type == "linear":
            inv = inv / np.float32(s.factor)
        elif s.rope_type == "llama3":
            old_len = s.original_max_position_embeddings
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > old_len / s.low_freq_factor, inv / s.factor, inv)
            smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor
                                                                - s.low_freq_factor)
            smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
            medium = ((wavelen >= old_len / s.high_freq_factor)
                      & (wavelen <= old_len / s.low_freq_factor))
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)
