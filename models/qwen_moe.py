"""Qwen2-MoE and Qwen3-MoE (`transformers.models.qwen2_moe.modeling_qwen2_moe`,
`qwen3_moe.modeling_qwen3_moe`): Qwen2's decoder (q/k/v biases) and Qwen3's (per-head q/k
RMSNorm) with a sparse Mixture-of-Experts MLP (`Qwen2MoeSparseMoeBlock`,
`Qwen3MoeSparseMoeBlock`) on the layers `decoder_sparse_step` and `mlp_only_layers` make sparse,
a dense MLP of `intermediate_size` on the others. The router takes the softmax over
`num_experts`, then the top `num_experts_per_tok`, renormalized when `norm_topk_prob`; each
expert is a SwiGLU MLP of `moe_intermediate_size` units. Qwen2-MoE adds a shared expert of
`shared_expert_intermediate_size` units that every token takes, scaled by
`sigmoid(shared_expert_gate(x))` (`models.moe.SparseMoeBlock`).

Checkpoints hold each expert's gate, up and down projections apart
(`mlp.experts.{j}.gate_proj.weight`); the loader stacks them by expert
(`models.moe.EXPERT_TENSORS`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxpaged.models.llama import LLAMA_NAME_MAP, QK_NORM_NAME_MAP, LlamaForCausalLM
from jaxpaged.models.moe import (EXPERT_TENSORS, EXPERTS_NAME_MAP, MoeConfig, MoeModel,
                                  MoeSpec, Routing)
from jaxpaged.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from jaxpaged.models.qwen3 import Qwen3Config

_MLP = "model.layers.{i}.mlp"
SHARED_EXPERT_NAME_MAP = (
    (f"{_MLP}.shared_expert.gate_proj.weight", "layers.{i}.mlp.shared_expert.gate_up_proj.kernel",
     True, (0, 2)),
    (f"{_MLP}.shared_expert.up_proj.weight", "layers.{i}.mlp.shared_expert.gate_up_proj.kernel",
     True, (1, 2)),
    (f"{_MLP}.shared_expert.down_proj.weight", "layers.{i}.mlp.shared_expert.down_proj.kernel",
     True, None),
    (f"{_MLP}.shared_expert_gate.weight", "layers.{i}.mlp.shared_expert_gate.kernel", True, None),
)


def qwen_moe_spec(d: dict[str, Any], defaults: tuple[int, int, int]) -> MoeSpec:
    """The MoE part of a Qwen2-MoE / Qwen3-MoE config.json; `defaults`: the HF config class's
    (experts, moe_intermediate_size, num_experts_per_tok) for keys it omits."""
    # transformers 5 writes `num_local_experts` for Qwen3-MoE, 4.x and Qwen2-MoE `num_experts`
    num_experts = d.get("num_local_experts") or d.get("num_experts", defaults[0])
    return MoeSpec(num_experts, d.get("moe_intermediate_size", defaults[1]),
                   Routing(d.get("num_experts_per_tok", defaults[2]),
                           renormalize=bool(d.get("norm_topk_prob", False))),
                   shared_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
                   sparse_step=d.get("decoder_sparse_step", 1),
                   mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))


@dataclasses.dataclass(frozen=True)
class Qwen2MoeConfig(MoeConfig, Qwen2Config):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen2MoeForCausalLM",)

    @staticmethod
    def read_moe(d: dict[str, Any], config) -> MoeSpec:
        return qwen_moe_spec(d, (60, 1408, 4))


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(MoeConfig, Qwen3Config):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen3MoeForCausalLM",)

    @staticmethod
    def read_moe(d: dict[str, Any], config) -> MoeSpec:
        if d.get("shared_expert_intermediate_size"):
            raise ValueError("Qwen3-MoE has no shared expert: shared_expert_intermediate_size="
                             f"{d['shared_expert_intermediate_size']!r}")
        return qwen_moe_spec(d, (128, 768, 8))


class Qwen2MoeForCausalLM(MoeModel, Qwen2ForCausalLM):
    config_class = Qwen2MoeConfig
    NAME_MAP = Qwen2ForCausalLM.NAME_MAP + EXPERTS_NAME_MAP + SHARED_EXPERT_NAME_MAP
    EXPERT_TENSORS = EXPERT_TENSORS


class Qwen3MoeForCausalLM(MoeModel, LlamaForCausalLM):
    config_class = Qwen3MoeConfig
    NAME_MAP = LLAMA_NAME_MAP + QK_NORM_NAME_MAP + EXPERTS_NAME_MAP
    EXPERT_TENSORS = EXPERT_TENSORS
    QK_NORM = True
