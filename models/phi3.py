"""Phi-3 (`transformers.models.phi3.modeling_phi3.Phi3ForCausalLM`): Llama with q/k/v fused in
one `qkv_proj` and gate/up in one `gate_up_proj` in the checkpoint (the same stacking as ours,
so they load as they are), rotary embeddings on `partial_rotary_factor` of each head, `longrope`
scaling (short and long factors) in the long-context checkpoints, and a sliding window on every
layer when the config sets one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.llama import LLAMA_NAME_MAP, LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Phi3ForCausalLM",)
    # As `transformers.Phi3Config` reads RoPE: "su" and "yarn" mean longrope, and
    # original_max_position_embeddings defaults to 4096.
    ROPE_TYPE_ALIASES: ClassVar[dict[str, str]] = {"su": "longrope", "yarn": "longrope"}
    HF_ROPE_DEFAULTS: ClassVar[dict[str, Any]] = {"original_max_position_embeddings": 4096}


class Phi3ForCausalLM(LlamaForCausalLM):
    config_class = Phi3Config
    NAME_MAP = tuple(entry for entry in LLAMA_NAME_MAP if entry[3] is None) + (
        ("model.layers.{i}.self_attn.qkv_proj.weight", "layers.{i}.self_attn.qkv_proj.kernel",
         True, None),
        ("model.layers.{i}.mlp.gate_up_proj.weight", "layers.{i}.mlp.gate_up_proj.kernel", True,
         None))
