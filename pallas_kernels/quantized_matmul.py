"""int8 matmuls: float activations times int8 weights with one scale per output (weight-only,
`int8_matmul`), or int8 activations too (W8A8, `w8a8_matmul`).

A quantized linear layer (`models.quantization`) keeps `w: i8[N, K]` (output rows by input
features, Hugging Face's layout) and `scale: f32[N]` (symmetric, per output channel:
`w_float[n] ~= w[n] * scale[n]`). On CPU the C++ kernel (`csrc/int8_matmul_cpu.cc`) widens the
weights in registers, so a step reads int8; elsewhere (GPU, or no C++ compiler) the jnp
reference runs, whose convert XLA fuses into the dot on GPU. The caller chooses (`use_kernel`):
the kernels do not look at the backend themselves.

W8A8 quantizes the activations too, per row (per token) and symmetric as the weights
(`quantize_int8`), on the fly at every call, and sums the int8 products in int32: the product
SmoothQuant (Xiao et al., 2023, section 3) calls per-token activation with per-channel weight
quantization. The int8 dot is XLA's (on CPU, YNNPACK's int8 GEMM, which uses the CPU's int8
dot-product instructions); for steps of up to `W8A8_KERNEL_MAX_ROWS` tokens, where XLA's int8
dot is slow (it repacks the weights), the C++ kernel (`csrc/w8a8_matmul_cpu.cc`) reads the
weights in place with the AVX-512 VNNI dot product where the CPU has it, or a portable loop with
the same int32 sums. The sums are exact, so every path equals the jnp reference bit for bit, and
a row's output does not depend on the other rows of its step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels import cpu_attention

# Steps of up to this many rows take the C++ W8A8 kernel (where the caller allows it); larger
# ones XLA's int8 dot (`bench/results/w8a8-matmul.json`).
W8A8_KERNEL_MAX_ROWS = 2


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


def _check_operands(name: str, x: jax.Array, w: jax.Array, scale: jax.Array) -> None:
    """Raises ValueError unless x is f[..., K], w i8[N, K] and scale [N]."""
    if w.ndim != 2 or w.dtype != jnp.int8 or scale.shape != (w.shape[0],) \
            or x.shape[-1] != w.shape[1]:
        raise ValueError(f"{name}: expected x f[..., K], w i8[N, K], scale f32[N]; got "
                         f"x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}, "
                         f"scale {scale.dtype}{list(scale.shape)}")


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
    _check_operands("int8_matmul", x, w, scale)
    if not use_kernel:
        return int8_matmul_reference(x, w, scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    call = jax.ffi.ffi_call(cpu_attention.INT8_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), jnp.float32))
    return call(x2, w, scale.astype(jnp.float32)).reshape(*lead, w.shape[0])


def w8a8_matmul_reference(xq: jax.Array, sx: jax.Array, w: jax.Array,
                          scale: jax.Array) -> jax.Array:
    """Pure jnp: the int8 product of quantized operands, summed in int32, then scaled:
    `float(xq @ w.T) * (sx[m] * scale[n])`.

    Args:
      xq: i8[M, K] activations quantized per row; sx: f32[M] their scales.
      w: i8[N, K] weights; scale: f32[N] per-output scales.

    Returns:
      f32[M, N].
    """
    acc = jnp.einsum("mk,nk->mn", xq, w, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * (sx[:, None] * scale[None, :])


def w8a8_kernel(xq: jax.Array, sx: jax.Array, w: jax.Array, scale: jax.Array, *,
                portable: bool = False) -> jax.Array:
    """`w8a8_matmul_reference` by the C++ kernel, any number of rows (call where
    `cpu_attention.available()`); `portable`: its portable path even where the CPU has VNNI
    (tests; the same results)."""
    call = jax.ffi.ffi_call(cpu_attention.W8A8_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((xq.shape[0], w.shape[0]), jnp.float32))
    return call(xq, sx, w, scale.astype(jnp.float32), portable=portable)


@functools.partial(jax.jit, static_argnames=("use_kernel",))
def w8a8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *,
                use_kernel: bool = False) -> jax.Array:
    """W8A8: x quantized per row (`quantize_int8`), times the int8 weights in int32, scaled:
    `w8a8_matmul_reference(*quantize_int8(x), w, scale)`; by the C++ kernel for steps of up to
    `W8A8_KERNEL_MAX_ROWS` rows where `use_kernel`.

    Args:
      x: f[..., K] activations (any float dtype; quantized from float32).
      w: i8[N, K] weights; scale: f32[N] per-output scales.
      use_kernel: the C++ kernel may run (CPU only, where `cpu_attention.available()`).

    Returns:
      f32[..., N], equal to the reference bit for bit on every path.

    Raises:
      ValueError: mismatched shapes or dtypes.
    """
    _check_operands("w8a8_matmul", x, w, scale)
    lead = x.shape[:-1]
    xq, sx = quantize_int8(x.reshape(-1, x.shape[-1]))
    if use_kernel and xq.shape[0] <= W8A8_KERNEL_MAX_ROWS:
        y = w8a8_kernel(xq, sx, w, scale)
    else:
        y = w8a8_matmul_reference(xq, sx, w, scale)
    return y.reshape(*lead, w.shape[0])
