"""Qwen3 (`transformers.models.qwen3.modeling_qwen3.Qwen3ForCausalLM`): Llama with a per-head
RMSNorm on q and k before RoPE (`Qwen3Attention.q_norm`, `k_norm`), and an explicit head size.

Qwen3's optional sliding window (`use_sliding_window`) is not implemented: such a config is
refused at load.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LLAMA_NAME_MAP, QK_NORM_NAME_MAP, LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen3ForCausalLM",)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Qwen3Config":
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported by the Qwen3 definition")
        return super().from_hf_dict(d)


class Qwen3ForCausalLM(LlamaForCausalLM):
    config_class = Qwen3Config
    NAME_MAP = LLAMA_NAME_MAP + QK_NORM_NAME_MAP
    QK_NORM = True
