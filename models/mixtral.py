"""Mixtral (`transformers.models.mixtral.modeling_mixtral.MixtralForCausalLM`): Mistral's
decoder with a sparse Mixture-of-Experts MLP in every layer (`MixtralSparseMoeBlock`): a
router over `num_local_experts` experts, softmax then the top `num_experts_per_tok`,
renormalized (`MixtralTopKRouter`), each expert a SwiGLU MLP of `intermediate_size` units
(`models.moe`).

Checkpoints hold each expert's w1 (gate), w3 (up) and w2 (down) apart
(`block_sparse_moe.experts.{j}.w1.weight`, HF's hub layout, which `save_pretrained` writes):
the loader stacks them by expert (`EXPERT_TENSORS`, `loader.stack_experts`) into
`experts_gate_up: f[E, D, 2F]` and `experts_down: f[E, F, D]`. The router's training-time
jitter (`router_jitter_noise`) does not apply at inference.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flax import nnx

from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LLAMA_NAME_MAP, LlamaForCausalLM
from jaxpaged.models.moe import Routing, SparseMoeBlock

_MOE = "model.layers.{i}.block_sparse_moe"
MIXTRAL_NAME_MAP = tuple(e for e in LLAMA_NAME_MAP if ".mlp." not in e[0]) + (
    (f"{_MOE}.gate.weight", "layers.{i}.mlp.router.kernel", True, None),
    (f"{_MOE}.experts.w1", "layers.{i}.mlp.experts_gate_up", True, (0, 2)),
    (f"{_MOE}.experts.w3", "layers.{i}.mlp.experts_gate_up", True, (1, 2)),
    (f"{_MOE}.experts.w2", "layers.{i}.mlp.experts_down", True, None),
)


@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("MixtralForCausalLM",)
    DEFAULT_ROPE_THETA: ClassVar[float] = 1e6

    num_local_experts: int = 8  # E
    num_experts_per_tok: int = 2  # k

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "MixtralConfig":
        config = super().from_hf_dict(d)
        E, k = d.get("num_local_experts", 8), d.get("num_experts_per_tok", 2)
        if not (isinstance(E, int) and isinstance(k, int) and 1 <= k <= E):
            raise ValueError(f"num_experts_per_tok={k!r} and num_local_experts={E!r}: need "
                             "1 <= num_experts_per_tok <= num_local_experts")
        return dataclasses.replace(config, num_local_experts=E, num_experts_per_tok=k)


class MixtralForCausalLM(LlamaForCausalLM):
    config_class = MixtralConfig
    NAME_MAP = MIXTRAL_NAME_MAP
    # Per-expert checkpoint tensors -> one stacked tensor per layer (`loader.stack_experts`).
    EXPERT_TENSORS = tuple((f"{_MOE}.experts.{{j}}.{w}.weight", f"{_MOE}.experts.{w}")
                           for w in ("w1", "w2", "w3"))

    def make_mlp(self, config: MixtralConfig, layer: int, dtype, rngs: nnx.Rngs):
        return SparseMoeBlock(config, dtype=dtype, rngs=rngs,
                              routing=Routing(config.num_experts_per_tok),
                              num_experts=config.num_local_experts,
                              intermediate_size=config.intermediate_size)

    @staticmethod
    def part_widths(config: MixtralConfig) -> dict[str, tuple[int, ...]]:
        widths = LlamaForCausalLM.part_widths(config)
        del widths["mlp.gate_up_proj.kernel"]
        return {**widths, "mlp.experts_gate_up": (config.intermediate_size,) * 2}
