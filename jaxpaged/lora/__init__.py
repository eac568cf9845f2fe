"""LoRA adapters: requests name one (`LoRARequest`), the engine holds them (`LoRAManager`),
PEFT folders are read by `lora.peft`; the batched product is `models.lora`."""

from jaxpaged.lora.manager import LoRAManager, check_lora_config, resolve_lora
from jaxpaged.lora.request import LoRARequest

__all__ = ["LoRAManager", "LoRARequest", "check_lora_config", "resolve_lora"]
