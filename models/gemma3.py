"""Gemma 3, text only (`transformers.models.gemma3.modeling_gemma3.Gemma3ForCausalLM`, with a
`Gemma3TextConfig`): Gemma 2 (see `models.gemma2`) plus a per-head (1 + w) RMSNorm on q and k,
local (sliding) and global layers as `layer_types` says (transformers 4: every
`sliding_window_pattern`-th layer global), and separate RoPE bases for each: the local layers
use `rope_local_base_freq` unscaled, the global ones `rope_theta` with the config's scaling.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxpaged.models.config import LlamaConfig, RopeScaling
from jaxpaged.models.gemma2 import GEMMA_NAME_MAP, _gemma_fields
from jaxpaged.models.llama import QK_NORM_NAME_MAP, LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Gemma3ForCausalLM",)
    DEFAULT_ROPE_THETA: ClassVar[float] = 1_000_000.0  # `Gemma3TextConfig`'s

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Gemma3Config":
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        config = super().from_hf_dict(_gemma_fields(
            d, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention"))
        if config.local_rope is None:  # transformers 4: the local base beside the global one
            config = dataclasses.replace(config, local_rope=(
                float(d.get("rope_local_base_freq", 10000.0)), RopeScaling()))
        return config


class Gemma3ForCausalLM(LlamaForCausalLM):
    config_class = Gemma3Config
    NAME_MAP = GEMMA_NAME_MAP + QK_NORM_NAME_MAP
    QK_NORM = True
    UNIT_OFFSET_NORMS = True
    SANDWICH_NORMS = True
    EMBED_SCALE = True
