"""`KernelPlan`: which kernels one model runs, chosen once by the engine's platform
(`jaxpaged.platforms.interface.Platform.kernel_plan`) and handed to the model when it is built
(`ModelConfig.kernels`, read by its layers at call time). Immutable, and its repr is part of the
compilation cache's key: two models with different plans never share an executable.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The kernels of one model; the default is the portable one (XLA everywhere).

    attention: the attention backend's name (`backends.ATTENTION_BACKENDS`: "cpu", "pallas",
      "pallas-interpret", "xla").
    few_row_matmul: linear layers and a tied LM head run steps of a few rows on the CPU
      few-row kernel (`few_row_matmul`; `models.layers.Linear`, `Embed`).
    quantized_matmul: int8, w8a8 and q8_0 layers run the C++ matmul (`quantized_matmul`;
      `models.quantization`).
    moe_experts: Mixture-of-Experts layers run their experts on the C++ kernel
      (`moe_experts`; `models.moe.SparseMoeBlock`).
    lora_matmul: adapter slots run on the CPU LoRA kernel (`lora_matmul`; `models.lora.LoRA`).
    """

    attention: str = "xla"
    few_row_matmul: bool = False
    quantized_matmul: bool = False
    moe_experts: bool = False
    lora_matmul: bool = False

    def __post_init__(self):
        if not isinstance(self.attention, str) or not self.attention:
            raise ValueError(f"KernelPlan.attention must be a backend name, "
                             f"got {self.attention!r}")
        for field in dataclasses.fields(self)[1:]:
            if not isinstance(getattr(self, field.name), bool):
                raise ValueError(f"KernelPlan.{field.name} must be a bool, "
                                 f"got {getattr(self, field.name)!r}")
