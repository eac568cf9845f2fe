"""LoRA adapters' products for a step whose tokens use different adapters (S-LoRA, Sheng et
al. 2023, section 4; Punica's "shrink" and "expand", Chen et al. 2023), on CPU by the C++
kernel `csrc/lora_matmul_cpu.cc`.

Every token t carries a slot s_t (0: no adapter; 1..S: the adapter at index s_t - 1); a
projection's change is `(x_t @ A[s_t - 1])_p @ B_p[s_t - 1]` for each of its parts p, the parts
side by side. The reference (`lora_matmul_reference`, what runs elsewhere: tensor parallelism,
GPU, bf16) computes `x @ A` for every slot at once and masks it to the token's slot (a one-hot),
so its products cost S times what the tokens' own adapters need; the kernel groups the tokens
by slot and runs each group through its own adapter only. `models.lora.LoRA` calls the kernel
where the model's kernel plan names it (`plan.KernelPlan.lora_matmul`) (one CPU device, float32 weights).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels import cpu_attention


def lora_matmul_reference(x: jax.Array, slots: jax.Array, lora_a: jax.Array,
                          lora_b: Sequence[jax.Array], num_shards: int = 1) -> jax.Array:
    """The adapters' change by a one-hot over the slots (pure jnp; works under sharding).

    Args:
      x: f[T, I] the projection's input.
      slots: i32[T] each token's slot: 0 for no adapter, s in 1..S for index s - 1.
      lora_a: f[S, I, P * R] every slot's A, the P parts' side by side on the rank axis
        (part p uses columns p * R to (p + 1) * R).
      lora_b: P arrays f[S, R, O_p], every slot's B of each part (its scale folded in).
      num_shards: the output's shards (tensor parallelism): each part's output is cut in that
        many blocks, laid out block by block as a stacked projection's kernel (`models.layers`).

    Returns:
      f[T, O_0 + ... + O_{P-1}] in x's dtype, 0 on rows of slot 0 (or of no slot in 1..S).
    """
    T = x.shape[0]
    S, r = lora_a.shape[0], lora_a.shape[-1] // len(lora_b)
    onehot = (slots[:, None] == jnp.arange(1, S + 1, dtype=slots.dtype)).astype(x.dtype)
    h = jnp.einsum("ti,sir->tsr", x, lora_a) * onehot[:, :, None]
    outs = []
    for p, b in enumerate(lora_b):
        h_p = h[:, :, p * r:(p + 1) * r].reshape(T, S * r)
        out_p = h_p @ b.reshape(S * r, -1)
        outs.append(out_p.reshape(T, num_shards, -1))  # by shard, as the stacked kernel
    return jnp.concatenate(outs, axis=-1).reshape(T, -1).astype(x.dtype)


def fits(x: jax.Array, lora_a: jax.Array, lora_b: Sequence[jax.Array]) -> bool:
    """Whether `lora_matmul` runs on these: x f32[T, I], lora_a f32[S, I, P * R], P >= 1
    arrays lora_b f32[S, R, O_p], and the C++ kernels built. Whether the backend is one CPU
    is the caller's question (the platform's `KernelPlan.lora_matmul` builds `LoRA` on it)."""
    arrays = (x, lora_a, *lora_b)
    if not lora_b or lora_a.ndim != 3 or any(a.dtype != jnp.float32 for a in arrays):
        return False
    S, I, PR = lora_a.shape
    R = PR // len(lora_b)
    return (x.ndim == 2 and x.shape[1] == I and R * len(lora_b) == PR
            and all(b.ndim == 3 and b.shape[:2] == (S, R) for b in lora_b)
            and cpu_attention.available())


def lora_matmul(x: jax.Array, slots: jax.Array, lora_a: jax.Array,
                lora_b: Sequence[jax.Array]) -> jax.Array:
    """`lora_matmul_reference(x, slots, lora_a, lora_b)` (one shard) by the kernel, each token
    through its own slot's adapter only; call it where `fits(x, lora_a, lora_b)`.

    Args:
      x: f32[T, I]; slots: i32[T] (0, or a value outside 1..S: no adapter);
      lora_a: f32[S, I, P * R]; lora_b: P arrays f32[S, R, O_p].

    Returns:
      f32[T, O_0 + ... + O_{P-1}], equal to the reference up to float32 summation order.
    """
    width = sum(b.shape[-1] for b in lora_b)
    call = jax.ffi.ffi_call(cpu_attention.LORA_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], width), jnp.float32))
    return call(x, slots.astype(jnp.int32), lora_a, *lora_b)
