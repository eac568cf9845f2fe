"""Granite MoE (`transformers.models.granitemoe.modeling_granitemoe.GraniteMoeForCausalLM`):
Llama's decoder with Granite's multipliers (embeddings times `embedding_multiplier`, the
attention scaled by `attention_multiplier`, each block's output times `residual_multiplier`
before its residual add, logits divided by `logits_scaling`; `models.config.LlamaConfig`) and
a sparse Mixture-of-Experts MLP in every layer (`GraniteMoeMoE`): the top
`num_experts_per_tok` router logits, then a softmax over those (`GraniteMoeTopKRouter`), each
expert a SwiGLU MLP of `intermediate_size` units (`models.moe`).

Checkpoints hold the experts already stacked: `block_sparse_moe.input_linear.weight`
f[E, 2F, D] (gate, then up), `output_linear.weight` f[E, D, F] and the router's
`router.layer.weight` f[E, D].
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LLAMA_NAME_MAP, LlamaForCausalLM
from jaxpaged.models.moe import MoeConfig, MoeModel, MoeSpec, Routing

_MOE = "model.layers.{i}.block_sparse_moe"


@dataclasses.dataclass(frozen=True)
class GraniteMoeConfig(MoeConfig, LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("GraniteMoeForCausalLM",)

    @staticmethod
    def read_moe(d: dict[str, Any], config) -> MoeSpec:
        return MoeSpec(d.get("num_local_experts", 8), config.intermediate_size,
                       Routing(d.get("num_experts_per_tok", 2), softmax_first=False))


class GraniteMoeForCausalLM(MoeModel, LlamaForCausalLM):
    config_class = GraniteMoeConfig
    NAME_MAP = tuple(e for e in LLAMA_NAME_MAP if ".mlp." not in e[0]) + (
        (f"{_MOE}.router.layer.weight", "layers.{i}.mlp.router.kernel", True, None),
        (f"{_MOE}.input_linear.weight", "layers.{i}.mlp.experts_gate_up", True, None),
        (f"{_MOE}.output_linear.weight", "layers.{i}.mlp.experts_down", True, None),
        # transformers 5's module names (`load_weights` of a trainer's `state_dict()`)
        (f"{_MOE}.router.weight", "layers.{i}.mlp.router.kernel", True, None),
        (f"{_MOE}.experts.gate_up_proj", "layers.{i}.mlp.experts_gate_up", True, None),
        (f"{_MOE}.experts.down_proj", "layers.{i}.mlp.experts_down", True, None),
    )
