"""The research API's weights and memory (`LLM.get_params`, `update_params`, `load_weights`,
`sleep`, `wake_up`): what the engine serves, swapped between steps, released and restored."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.models.loader import flat_params, params_from_hf_weights
from jaxpaged.worker.model_runner import ModelRunner


class EngineWeights:
    """The served parameters and the KV pool's memory of one engine.

    Args:
      runner: the engine's model runner (holds the parameters and the pool).
      block_manager: the engine's blocks (its prefix cache is dropped when weights change).
      load_model: builds the model with its weights from the model folder again (`wake_up`).
      model_cls, model_config, dtype: what `load_weights` maps checkpoint names with.
      quantization: the engine's quantization (None: float weights).
      on_new_params: called after the parameters were replaced (the LoRA manager writes its
        adapters back into their slots, `LoRAManager.restore_slots`), or None.
    """

    def __init__(self, runner: ModelRunner, block_manager: BlockManager,
                 load_model: Callable[[], nnx.Module], model_cls: type, model_config, dtype,
                 quantization: str | None, on_new_params: Callable[[], None] | None = None):
        self.on_new_params = on_new_params or (lambda: None)
        self.runner = runner
        self.block_manager = block_manager
        self.load_model = load_model
        self.model_cls, self.model_config, self.dtype = model_cls, model_config, dtype
        self.quantization = quantization
        self.sleep_level = 0  # 0 awake, 1 without the KV pool, 2 without the weights too

    def get_params(self) -> nnx.State:
        """The parameter tree the engine serves (`LLM.get_params`).

        Raises:
          RuntimeError: the weights were released by `sleep(level=2)` and not restored.
        """
        if self.runner.params is None:
            raise RuntimeError("the weights were released by sleep(level=2): restore them with "
                               "update_params(...) or wake_up()")
        # A new tree of the same arrays: changing it in place changes nothing served.
        return jax.tree.map(lambda x: x, self.runner.params)

    def update_params(self, params) -> None:
        """Serves with `params` from the next step (`ModelRunner.replace_params`) and drops the
        prefix cache, whose K/V the old weights computed. Sequences already running keep the
        K/V they have."""
        self.runner.replace_params(params)
        self.on_new_params()
        self.block_manager.reset_prefix_cache(force=True)

    def load_weights(self, weights) -> None:
        """Replaces the parameters that `(HF name, array)` pairs name
        (`models.loader.params_from_hf_weights`), the others kept, as `update_params` does.
        Stacked parameters are read back to the host to write a part.

        Raises:
          ValueError: the engine's weights are quantized (use `update_params` with quantized
            arrays), or see `params_from_hf_weights`.
        """
        if self.quantization is not None:
            raise ValueError(f"load_weights takes float checkpoint tensors, and this engine's "
                             f"weights are quantized ({self.quantization!r}): build the engine "
                             "without quantization, or pass quantized arrays to update_params")
        current = flat_params(self.get_params())
        changed = params_from_hf_weights(self.model_cls, self.model_config, current, weights,
                                         self.dtype)
        self.update_params({**current, **changed})

    def sleep(self, level: int, busy: bool) -> None:
        """Releases the KV pool (level 1) and the weights too (level 2); see `LLM.sleep`.

        Raises:
          ValueError: a level other than 1 or 2.
          RuntimeError: `busy` (requests are still running).
        """
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if busy:
            raise RuntimeError("sleep needs an idle engine: requests are still running")
        self.block_manager.reset_prefix_cache()
        self.runner.release(kv_cache=True, params=level == 2)
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        """Restores what `sleep` released: a new (empty) KV pool, and the weights read again from
        the model folder unless `update_params` gave new ones meanwhile."""
        if self.runner.params is None:
            self.runner.replace_params(nnx.split(self.load_model())[1])
            self.on_new_params()
        self.runner.restore_kv_cache()
        self.sleep_level = 0

    def check_awake(self) -> None:
        """Raises `RuntimeError` while the engine sleeps."""
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (sleep level {self.sleep_level}): call "
                               "wake_up() before generating")
