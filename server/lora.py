"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` names an adapter (or the
base model), `/v1/models` lists the adapters with the base model as `parent`, and with
`--allow-runtime-lora-updating` `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
load and drop adapters while serving (vLLM's bodies: `lora_name`, `lora_path`,
`load_inplace`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from jaxpaged.engine.async_llm_engine import AsyncLLMEngine
from jaxpaged.lora import LoRARequest
from jaxpaged.server import protocol as api
from jaxpaged.server.errors import APIError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of that name (a new version)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


class LoRAServing:
    """The served model's adapters (`LLMEngine.lora`, None without `enable_lora`)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    @property
    def manager(self):
        return self.engine.engine.lora

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name).

        Raises:
          APIError: 404 for a name that is neither.
        """
        if model is None or model == self.model_name:
            return None
        if self.manager is not None and model in self.manager.adapters:
            return LoRARequest(model)
        raise APIError(f"The model `{model}` does not exist.", 404, "model", "model_not_found")

    def cards(self) -> list[api.ModelCard]:
        """The adapters' model cards (`parent`: the base model)."""
        if self.manager is None:
            return []
        return [api.ModelCard(id=r.lora_name, root=r.lora_path or None, parent=self.model_name,
                              max_model_len=self.engine.max_model_len)
                for r in self.manager.list()]

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        """Reads the folder on the engine's thread (between steps).

        Raises:
          APIError: 400 for LoRA not enabled, a name in use (without `load_inplace`) or a bad
            folder (`param` names the field).
        """
        manager = self._enabled()
        if req.lora_name == self.model_name:
            raise APIError(f"lora_name {req.lora_name!r} is the base model's name",
                           param="lora_name")
        if req.lora_name in manager.adapters and not req.load_inplace:
            raise APIError(f"The lora adapter '{req.lora_name}' has already been loaded; "
                           "send load_inplace: true to replace it", param="lora_name")
        try:
            await self.engine.run(manager.add, LoRARequest(req.lora_name, 1, req.lora_path))
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from e
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        """Raises APIError: 404 for an adapter not held."""
        manager = self._enabled()
        if not await self.engine.run(manager.remove, req.lora_name):
            raise APIError(f"The lora adapter '{req.lora_name}' cannot be found.", 404,
                           "lora_name", "model_not_found")
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def _enabled(self):
        if self.manager is None:
            raise APIError("this server has no LoRA support: start it with --enable-lora",
                           param="lora_name")
        return self.manager
