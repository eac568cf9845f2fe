"""Qwen2 and Qwen2.5 (`transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM`): Llama with
biases on q, k and v, and sliding windows only where the config asks: with
`use_sliding_window`, on the layers from `max_window_layers` on (transformers 5 writes this
out as `layer_types`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LLAMA_NAME_MAP, LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen2ForCausalLM",)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Qwen2Config":
        d = dict(d)
        if not d.get("use_sliding_window"):
            d.update(sliding_window=None, layer_types=None)
        elif d.get("layer_types") is None:  # transformers 4: windows from max_window_layers on
            first = d.get("max_window_layers", d["num_hidden_layers"])
            d["layer_types"] = ["sliding_attention" if i >= first else "full_attention"
                                for i in range(d["num_hidden_layers"])]
        return dataclasses.replace(super().from_hf_dict(d), qkv_bias=True)


class Qwen2ForCausalLM(LlamaForCausalLM):
    config_class = Qwen2Config
    NAME_MAP = LLAMA_NAME_MAP + tuple(
        (f"model.layers.{{i}}.self_attn.{p}_proj.bias", "layers.{i}.self_attn.qkv_proj.bias",
         False, (j, 3)) for j, p in enumerate("qkv"))
