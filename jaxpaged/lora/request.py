"""`LoRARequest`: which adapter a request runs under (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, with vLLM's fields.

    lora_name: the adapter's name (the key the engine knows it by; the server's `model`).
    lora_int_id: a positive id (vLLM's; kept for compatibility, not a key here).
    lora_path: a PEFT folder to read the adapter from when the engine does not hold it yet;
      "" for one added from memory (`LLM.update_lora`).

    Raises (when built):
      ValueError: an empty name or an id below 1.
    """

    lora_name: str
    lora_int_id: int = 1
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
