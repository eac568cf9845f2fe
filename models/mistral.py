"""Mistral (`transformers.models.mistral.modeling_mistral.MistralForCausalLM`): Llama with a
sliding window on every layer when the config sets `sliding_window` (Mistral 7B v0.1: 4,096
tokens; later versions set none), and an explicit `head_dim`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("MistralForCausalLM",)


class MistralForCausalLM(LlamaForCausalLM):
    config_class = MistralConfig
