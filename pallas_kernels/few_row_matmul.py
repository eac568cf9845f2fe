"""Float32 matmuls of a few rows on CPU: the linear layers of a step of 2 to `MAX_ROWS`
tokens (a speculative verification), by the C++ kernel `csrc/f32_matmul_cpu.cc`.

XLA:CPU runs a one-row matmul as a GEMV that streams the weights once, but a matmul of a few
rows as a GEMM that first packs the weights: 1.5x to 2.4x the one-row time for the same bytes
read. The kernel reads each weight once and uses it for every row while it is in registers, so
a step of 2 to 16 tokens costs little more than a step of one. The layers that call it
(`models.layers.Linear`, `models.layers.Embed.attend`) do so only where the model's kernel plan names it
(`plan.KernelPlan.few_row_matmul`: one CPU device, float32 weights); otherwise, and for other row
counts, XLA's dot runs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels import cpu_attention

MAX_ROWS = 16  # rows up to which the kernel runs (a verification of 15 proposals)
MIN_ROWS = 2  # one row: XLA's GEMV is as fast


def fits(x: jax.Array, w: jax.Array, transposed: bool = False) -> bool:
    """Whether `x @ w` (`x @ w.T` when `transposed`) runs on the kernel: x f32[..., K] of
    2..MAX_ROWS rows in all, w f32 2-D with N (its output size) a multiple of 64, and the C++
    kernels built. Whether the backend is a CPU is the caller's question (the engine's
    platform's `KernelPlan.few_row_matmul` builds the layers on it)."""
    rows = math.prod(x.shape[:-1])
    n = w.shape[0] if transposed else w.shape[-1]
    return (MIN_ROWS <= rows <= MAX_ROWS and w.ndim == 2 and n % 64 == 0
            and x.dtype == jnp.float32 and w.dtype == jnp.float32 and cpu_attention.available())


def few_row_matmul(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """`x @ w` (or `x @ w.T`) by the kernel; call it where `fits(x, w, transposed)`.

    Args:
      x: f32[..., K]; w: f32[K, N], or f32[N, K] when `transposed`.

    Returns:
      f32[..., N], equal to XLA's dot up to float32 summation order.
    """
    n = w.shape[0] if transposed else w.shape[1]
    x2 = x.reshape(-1, x.shape[-1])
    target = cpu_attention.F32_MATMUL_NK_TARGET if transposed \
        else cpu_attention.F32_MATMUL_KN_TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    return call(x2, w).reshape(*x.shape[:-1], n)
