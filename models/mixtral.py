"""Mixtral (`transformers.models.mixtral.modeling_mixtral.MixtralForCausalLM`): Mistral's
decoder with a sparse Mixture-of-Experts MLP in every layer (`MixtralSparseMoeBlock`): a
router over `num_local_experts` experts, softmax then the top `num_experts_per_tok`,
renormalized (`MixtralTopKRouter`), each expert a SwiGLU MLP of `intermediate_size` units
(`models.moe`).

Checkpoints hold each expert's w1 (gate), w3 (up) and w2 (down) apart
(`block_sparse_moe.experts.{j}.w1.weight`, HF's hub layout, which `save_pretrained` writes):
the loader stacks them by expert (`EXPERT_TENSORS`, `loader.stack_experts`) into
`experts_gate_up: f[E, D, 2F]` and `experts_down: f[E, F, D]`. transformers 5's modules name
them `mlp.gate` and `mlp.experts.{gate_up,down}_proj` (stacked, gate and up fused), which
`load_weights` also reads. The router's training-time
jitter (`router_jitter_noise`) does not apply at inference.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LLAMA_NAME_MAP, LlamaForCausalLM
from jaxpaged.models.moe import RUNTIME_EXPERTS_NAME_MAP
from jaxpaged.models.moe import MoeConfig, MoeModel, MoeSpec, Routing

_MOE = "model.layers.{i}.block_sparse_moe"
MIXTRAL_NAME_MAP = tuple(e for e in LLAMA_NAME_MAP if ".mlp." not in e[0]) + (
    (f"{_MOE}.gate.weight", "layers.{i}.mlp.router.kernel", True, None),
    (f"{_MOE}.experts.w1", "layers.{i}.mlp.experts_gate_up", True, (0, 2)),
    (f"{_MOE}.experts.w3", "layers.{i}.mlp.experts_gate_up", True, (1, 2)),
    (f"{_MOE}.experts.w2", "layers.{i}.mlp.experts_down", True, None),
    # transformers 5's module names (`load_weights` of a trainer's `state_dict()`)
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.kernel", True, None),
    *RUNTIME_EXPERTS_NAME_MAP,
)


@dataclasses.dataclass(frozen=True)
class MixtralConfig(MoeConfig, LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("MixtralForCausalLM",)
    DEFAULT_ROPE_THETA: ClassVar[float] = 1e6

    @staticmethod
    def read_moe(d: dict[str, Any], config) -> MoeSpec:
        return MoeSpec(d.get("num_local_experts", 8), config.intermediate_size,
                       Routing(d.get("num_experts_per_tok", 2)))


class MixtralForCausalLM(MoeModel, LlamaForCausalLM):
    config_class = MixtralConfig
    NAME_MAP = MIXTRAL_NAME_MAP
    # Per-expert checkpoint tensors -> one stacked tensor per layer (`loader.stack_experts`).
    EXPERT_TENSORS = tuple((f"{_MOE}.experts.{{j}}.{w}.weight", f"{_MOE}.experts.{w}")
                           for w in ("w1", "w2", "w3"))
