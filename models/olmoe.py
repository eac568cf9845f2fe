"""OLMoE (`transformers.models.olmoe.modeling_olmoe.OlmoeForCausalLM`): Llama's decoder with
one RMSNorm over all of q's heads and one over all of k's before RoPE (`OlmoeAttention.q_norm`
of `hidden_size` features, `k_norm` of the KV heads'), q, k and v clamped to `clip_qkv` where
the config sets it, and a sparse Mixture-of-Experts MLP in every layer
(`OlmoeSparseMoeBlock`): softmax over `num_experts`, the top `num_experts_per_tok`, renormalized
only when `norm_topk_prob` (OLMoE-1B-7B: not), each expert a SwiGLU MLP of
`intermediate_size` units (`models.moe`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LLAMA_NAME_MAP, QK_NORM_NAME_MAP, LlamaForCausalLM
from jaxpaged.models.moe import (EXPERT_TENSORS, EXPERTS_NAME_MAP, MoeConfig, MoeModel, MoeSpec,
                                  Routing)


@dataclasses.dataclass(frozen=True)
class OlmoeConfig(MoeConfig, LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("OlmoeForCausalLM",)

    clip_qkv: float | None = None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "OlmoeConfig":
        clip = d.get("clip_qkv")
        return dataclasses.replace(super().from_hf_dict(d),
                                   clip_qkv=None if clip is None else float(clip))

    def for_tensor_parallel(self, tp: int, expert_parallel: bool = False) -> "OlmoeConfig":
        """`LlamaConfig.for_tensor_parallel`, but with the KV heads never repeated.

        Raises:
          ValueError: as the base's, and tp above the KV heads: `k_norm` spans all of them,
            so a device's repeated copy would not hold its norm's weights (named).
        """
        K = self.num_key_value_heads
        if isinstance(tp, int) and tp > K:
            raise ValueError(f"tensor_parallel_size={tp} exceeds OLMoE's num_key_value_heads="
                             f"{K}: its k_norm spans all KV heads, which are not repeated per "
                             f"device; use tensor_parallel_size <= {K}")
        return super().for_tensor_parallel(tp, expert_parallel)

    @staticmethod
    def read_moe(d: dict[str, Any], config) -> MoeSpec:
        return MoeSpec(d.get("num_experts", 64), config.intermediate_size,
                       Routing(d.get("num_experts_per_tok", 8),
                               renormalize=bool(d.get("norm_topk_prob", False))))


class OlmoeForCausalLM(MoeModel, LlamaForCausalLM):
    config_class = OlmoeConfig
    NAME_MAP = (tuple(e for e in LLAMA_NAME_MAP if ".mlp." not in e[0]) + QK_NORM_NAME_MAP
                + EXPERTS_NAME_MAP)
    EXPERT_TENSORS = EXPERT_TENSORS
    QK_NORM = "full"
