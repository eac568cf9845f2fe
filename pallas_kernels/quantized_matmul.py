"""Weight-only int8 matmul: float activations times int8 weights with one scale per output.

A quantized linear layer (`models.quantization`) keeps `w: i8[N, K]` (output rows by input
features, Hugging Face's layout) and `scale: f32[N]` (symmetric, per output channel:
`w_float[n] ~= w[n] * scale[n]`). On CPU the C++ kernel (`csrc/int8_matmul_cpu.cc`) widens the
weights in registers, so a step reads int8; elsewhere (GPU, or no C++ compiler) the jnp
reference runs, whose convert XLA fuses into the dot on GPU. The caller chooses (`use_kernel`):
the kernels do not look at the backend themselves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels import cpu_attention


def int8_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """Pure jnp: `(x @ w.T) * scale` with w widened to float32.

    Args:
      x: f[..., K] activations; w: i8[N, K]; scale: f32[N].

    Returns:
      f32[..., N].
    """
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.astype(jnp.float32),
                   preferred_element_type=jnp.float32)
    return y * scale


def quantize_int8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-row int8: w f[N, K] -> (i8[N, K], f32[N]) with `scale = max|w[n]| / 127`
    (a zero row gets scale 1) and `q = round(w / scale)`, so `|w - q * scale| <= scale / 2`."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


@functools.partial(jax.jit, static_argnames=("use_kernel",))
def int8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *,
                use_kernel: bool = False) -> jax.Array:
    """`int8_matmul_reference(x, w, scale)`, by the C++ kernel where `use_kernel`.

    Args:
      x: f[..., K] activations (any float dtype; computed in float32).
      w: i8[N, K] weights; scale: f32[N] per-output scales.
      use_kernel: the C++ kernel (True: CPU only, where `cpu_attention.available()`; the
        engine asks its platform, `jaxpaged.platforms`) or the jnp reference (False).

    Returns:
      f32[..., N], equal to the reference up to float32 summation order.

    Raises:
      ValueError: mismatched shapes or dtypes.
    """
    if w.ndim != 2 or w.dtype != jnp.int8 or scale.shape != (w.shape[0],) \
            or x.shape[-1] != w.shape[1]:
        raise ValueError(f"int8_matmul: expected x f[..., K], w i8[N, K], scale f32[N]; got "
                         f"x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}, "
                         f"scale {scale.dtype}{list(scale.shape)}")
    if not use_kernel:
        return int8_matmul_reference(x, w, scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    call = jax.ffi.ffi_call(cpu_attention.INT8_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), jnp.float32))
    return call(x2, w, scale.astype(jnp.float32)).reshape(*lead, w.shape[0])
