"""`Platform`: what differs between the devices jaxpaged runs on (vLLM's `platforms/interface.py`).

One object per process (`jaxpaged.platforms.current_platform()`) answers every question that
depends on the device: the default dtype, the attention backend "auto" means, which custom
kernels exist and which a model runs (`kernel_plan`), whether and how batch-invariant mode runs, and what enters the compilation
cache's key. The rest of jaxpaged asks it instead of calling `jax.default_backend()`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jaxlib

from jaxpaged import envs
from jaxpaged.pallas_kernels.plan import KernelPlan

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Kernel names `Platform.kernels` may list.
CPU_ATTENTION, FEW_ROW_MATMUL, INT8_MATMUL = "cpu_attention", "few_row_matmul", "int8_matmul"
LORA_MATMUL, MOE_EXPERTS = "lora_matmul", "moe_experts"


class Platform:
    """The device family's defaults and abilities; subclasses override the class attributes
    and the methods whose answer differs."""

    name = "base"  # "cpu", "cuda"
    jax_backend = ""  # `jax.default_backend()` on this platform
    default_dtype = jnp.float32  # what `dtype="auto"` means
    default_attention_backend = "xla"  # what `attention_backend="auto"` means

    def resolve_dtype(self, dtype: str) -> jnp.dtype:
        """The model's dtype for `LLM(dtype=...)`: "auto" is `default_dtype`.

        Raises:
          ValueError: not one of `DTYPES`.
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use 'auto', 'float32', "
                             "'bfloat16' or 'float16'")
        return jnp.dtype(self.default_dtype if dtype == "auto" else dtype)

    def attention_backend(self, name: str) -> str:
        """The attention backend's name for `LLM(attention_backend=name)`: "auto" is
        `default_attention_backend`, other names pass through (validated by
        `pallas_kernels.make_attention_backend`)."""
        return self.default_attention_backend if name == "auto" else name

    def kernels(self) -> frozenset[str]:
        """The custom kernels usable here (`CPU_ATTENTION`, `FEW_ROW_MATMUL`, `INT8_MATMUL`,
        `LORA_MATMUL`, `MOE_EXPERTS`)."""
        return frozenset()

    def kernel_plan(self, dtype, tensor_parallel: bool, batch_invariant: bool,
                    attention_backend: str = "auto") -> KernelPlan:
        """The kernels a model runs here (`pallas_kernels.plan.KernelPlan`), chosen once when
        the engine is built and handed to the model: the attention backend
        `attention_backend` resolves to (batch-invariant mode's where `batch_invariant`), and
        no custom matmul, MoE or LoRA kernel (the base platform has none).

        Args:
          dtype: the weights' jnp dtype. tensor_parallel: the model is split over devices.
          batch_invariant: `LLM(batch_invariant=True)`.
          attention_backend: as given to the engine ("auto" resolved here).

        Raises:
          ValueError: batch invariance where the platform has none (`batch_invariant_backend`).
        """
        return KernelPlan(attention=self._attention_name(attention_backend, batch_invariant))

    def _attention_name(self, attention_backend: str, batch_invariant: bool) -> str:
        return (self.batch_invariant_backend(attention_backend) if batch_invariant
                else self.attention_backend(attention_backend))

    # Batch invariance (`LLM(batch_invariant=True)`).
    def batch_invariant_backend(self, attention_backend: str) -> str:
        """The attention backend batch-invariant mode runs on for `attention_backend`.

        Raises:
          ValueError: the mode is not implemented on this platform (named).
        """
        raise ValueError(f"batch_invariant=True is implemented on CPU only, not on "
                         f"{self.name!r}")

    def batch_invariant_min_step_tokens(self, runner, attention_backend: str) -> int:
        """The fewest tokens a batch-invariant step is padded to (see `CpuPlatform`)."""
        raise ValueError(f"batch_invariant=True is implemented on CPU only, not on "
                         f"{self.name!r}")

    # The fewest sequence slots (LM-head rows) a batch-invariant runner has, whatever
    # `max_num_seqs`: a step's logits rows then do not depend on `max_num_seqs`.
    batch_invariant_min_seq_slots = 1

    # The compilation cache (`jaxpaged.worker.compilation_cache`).
    def machine_id(self) -> str:
        """The device the executables are compiled for, as a folder-name-safe string."""
        return jax.devices()[0].device_kind.replace(" ", "_")

    def cache_folder_name(self) -> str:
        """The compile cache's subfolder: executables of another jax, backend or device kind
        never meet."""
        return (f"jax-{jax.__version__}-jaxlib-{jaxlib.__version__}-{self.jax_backend}-"
                f"{self.machine_id()}")

    def cache_key_parts(self) -> tuple[str, ...]:
        """What an executable's key holds of the platform: versions, backend, every device,
        the process count, `XLA_FLAGS` and the machine."""
        devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
        return (jax.__version__, jaxlib.__version__, self.jax_backend, str(devices),
                str(jax.process_count()), envs.xla_flags(), self.machine_id())
