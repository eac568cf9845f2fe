"""Mixture-of-Experts experts on CPU by the C++ kernel `csrc/moe_experts_cpu.cc`: the (token,
expert) pairs grouped by expert, each expert's rows through its own matrices read in place (the
"kernel" path of `models.moe.experts_forward`).

XLA:CPU has no grouped matmul (`jax.lax.ragged_dot` multiplies every row by every group), so
the jnp paths of `models.moe` run every expert on every token or copy the experts' matrices
they gather. The kernel reads each expert a step uses once, whatever the step's size, and a
token's outputs do not depend on the rest of its step. The engine turns it on for one CPU
device (`SparseMoeBlock.moe_kernel`, `KernelPlan.moe_experts` from `CpuPlatform.kernel_plan`); its gated MLP is SiLU's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels import cpu_attention

ALIGN = 64  # D and F must be multiples of this (the kernel's column blocks)


def fits(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation: str, tp: int) -> bool:
    """Whether `moe_experts` takes these: x f32[T, D], float32 or int8 experts with D and F
    multiples of `ALIGN`, SiLU, one shard (tp 1), and the C++ kernels built."""
    D, F = gate_up.shape[1], down.shape[1]
    return (tp == 1 and activation == "silu" and x.dtype == jnp.float32
            and gate_up.dtype == down.dtype and gate_up.dtype in (jnp.float32, jnp.int8)
            and D % ALIGN == 0 and F % ALIGN == 0 and cpu_attention.available())


def moe_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array,
                down: jax.Array, scales: tuple[jax.Array, jax.Array] | None = None
                ) -> jax.Array:
    """Each token's k experts' `down(silu(gate(x)) * up(x))`, summed by its routing weights;
    call it where `fits`.

    Args:
      x: f32[T, D]; weights: f32[T, k] and ids: i32[T, k] (`models.moe.route`).
      gate_up: f32[E, D, 2F] (gate then up columns), down: f32[E, F, D]; or int8 with
        `scales` = (f32[E, 2F], f32[E, D]), per expert and output column.

    Returns:
      f32[T, D], equal to `models.moe.experts_dense` up to float32 summation order.

    Raises:
      RuntimeError: the C++ kernels are not built here (`cpu_attention.available`).
    """
    if not cpu_attention.available():
        raise RuntimeError("the MoE experts kernel needs the C++ CPU kernels, which are not "
                           "built here")
    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    args = (x, weights.astype(jnp.float32), ids.astype(jnp.int32), gate_up, down)
    if scales is None:
        return jax.ffi.ffi_call(cpu_attention.MOE_EXPERTS_F32_TARGET, out)(*args)
    return jax.ffi.ffi_call(cpu_attention.MOE_EXPERTS_I8_TARGET, out)(
        *args, *(s.astype(jnp.float32) for s in scales))
