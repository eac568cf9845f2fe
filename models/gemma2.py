"""Gemma 2 (`transformers.models.gemma2.modeling_gemma2.Gemma2ForCausalLM`).

Differs from Llama in: RMSNorm scaling by (1 + w) in float32; embeddings scaled by
sqrt(hidden_size) in the weight dtype; four norms per layer (the attention and MLP outputs are
normalized before their residual adds); the attention scale `query_pre_attn_scalar ** -0.5`;
attention and final logit soft-caps; sliding windows on the layers `layer_types` marks
(transformers 4: every even layer); the tanh-approximated GELU in the MLP; tied embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LLAMA_NAME_MAP, LlamaForCausalLM


def _gemma_fields(d: dict[str, Any], default_layer_types) -> dict[str, Any]:
    """The HF dict with Gemma's names mapped to the shared config's."""
    d = dict(d)
    d["hidden_act"] = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if d.get("layer_types") is None:
        d["layer_types"] = [default_layer_types(i) for i in range(d["num_hidden_layers"])]
    return d


@dataclasses.dataclass(frozen=True)
class Gemma2Config(LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Gemma2ForCausalLM",)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Gemma2Config":
        return super().from_hf_dict(_gemma_fields(
            d, lambda i: "sliding_attention" if i % 2 == 0 else "full_attention"))


GEMMA_NAME_MAP = LLAMA_NAME_MAP + tuple(
    (f"model.layers.{{i}}.{n}.weight", f"layers.{{i}}.{n}.weight", False, None)
    for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"))


class Gemma2ForCausalLM(LlamaForCausalLM):
    config_class = Gemma2Config
    NAME_MAP = GEMMA_NAME_MAP
    UNIT_OFFSET_NORMS = True
    SANDWICH_NORMS = True
    EMBED_SCALE = True
