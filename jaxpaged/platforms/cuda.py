"""The CUDA GPU platform: bfloat16 by default and the Pallas (Triton) attention kernels."""

from __future__ import annotations

import jax.numpy as jnp

from jaxpaged.platforms.interface import Platform


class CudaPlatform(Platform):
    """An NVIDIA GPU. The C++ kernels are CPU code; batch invariance is not implemented here
    (the Pallas kernels and XLA:GPU's matmuls would need the CPU's treatment)."""

    name = "cuda"
    jax_backend = "gpu"
    default_dtype = jnp.bfloat16
    default_attention_backend = "pallas"
