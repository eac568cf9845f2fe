"""The platform jaxpaged runs on (CPU, CUDA GPU): defaults, kernels, batch invariance.

`current_platform()` is the one place that asks jax which backend it runs
(`jax.default_backend()`); the rest of jaxpaged asks the `Platform` it returns. Environment
variables are read in `jaxpaged.envs` only.
"""

from __future__ import annotations

import functools
import shutil

import jax

from jaxpaged import envs
from jaxpaged.platforms.cpu import CpuPlatform, configure_kernels, turn_ynn_fusions_off
from jaxpaged.platforms.cuda import CudaPlatform
from jaxpaged.platforms.interface import Platform

__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "current_platform", "platform_for",
           "prepare_jax", "resolve_dtype"]

# The C++ kernels learn where to build as soon as jaxpaged is imported: code that calls
# `cpu_attention.available()` directly (tests, benchmarks) finds them where the engine does.
configure_kernels()


def platform_for(jax_backend: str, platform_version: str = "") -> Platform:
    """The `Platform` for a jax backend name ("cpu", "gpu") and its client's platform version.

    Raises:
      RuntimeError: a backend jaxpaged does not support (TPU, ROCm, ...), named.
    """
    if jax_backend == "cpu":
        return CpuPlatform()
    if jax_backend == "gpu" and "rocm" not in platform_version.lower():
        return CudaPlatform()
    name = "rocm" if "rocm" in platform_version.lower() else jax_backend
    raise RuntimeError(f"jaxpaged does not support the {name!r} platform yet (CPU and CUDA "
                       f"GPUs only); run with JAX_PLATFORMS=cpu to use the CPU")


@functools.cache
def current_platform() -> Platform:
    """This process's platform (starts jax's backend on the first call).

    Raises:
      RuntimeError: an unsupported platform (`platform_for`).
    """
    backend = jax.default_backend()
    version = getattr(jax.devices()[0].client, "platform_version", "")
    return platform_for(backend, version)


def resolve_dtype(dtype: str):
    """`LLM(dtype=...)` as a jnp dtype: "auto" is the platform's default (float32 on CPU,
    bfloat16 on GPU). Raises ValueError for a dtype not in `interface.DTYPES`."""
    return current_platform().resolve_dtype(dtype)


def prepare_jax(batch_invariant: bool) -> None:
    """What the command line sets before jax's backend starts: with `batch_invariant`, XLA:CPU
    without its YNNPACK fusions (`cpu.turn_ynn_fusions_off`); and, with no `JAX_PLATFORMS`
    and no NVIDIA driver, jax on the CPU (keeps jax from probing an installed CUDA plugin,
    which prints a traceback)."""
    if batch_invariant:
        turn_ynn_fusions_off()
    if envs.jax_platforms() is None and shutil.which("nvidia-smi") is None:
        jax.config.update("jax_platforms", "cpu")
