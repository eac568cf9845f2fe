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
quantization. One int8 term per token loses too much on small models, whose activations have a
few outlier features (mean KL 0.03 against float32 on SmolLM2-135M, `bench/results/`), so the
activations are `W8A8_ACTIVATION_TERMS` int8 terms: the second quantizes, per token, the first's
rounding error (`quantize_activations`), which cuts the error bound 127-fold for a second int8
product over the same weights (the terms are stacked as extra rows of one int8 matmul).

The int8 dot is XLA's (on CPU, YNNPACK's int8 GEMM, which uses the CPU's int8 dot-product
instructions); for steps of up to `W8A8_KERNEL_MAX_ROWS` tokens, where XLA's int8 dot is slow
(it repacks the weights), the C++ kernel (`csrc/w8a8_matmul_cpu.cc`) reads the weights in place
with the AVX-512 VNNI dot product where the CPU has it, or a portable loop with the same int32
sums. The int32 sums are exact and the scaling after them is the same XLA code on every path, so
every path gives the same bits, and a row's output does not depend on the other rows of its
step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels import cpu_attention

# Steps of up to this many rows take the C++ W8A8 kernel (where the caller allows it); larger
# ones XLA's int8 dot (`bench/results/w8a8-matmul.json`).
W8A8_KERNEL_MAX_ROWS = 2
# int8 terms per activation row in `w8a8_matmul` (1: plain per-token int8).
W8A8_ACTIVATION_TERMS = 2


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


def int8_dot_reference(xq: jax.Array, w: jax.Array) -> jax.Array:
    """Pure jnp (XLA's int8 dot): `xq @ w.T` summed exactly in int32.

    Args:
      xq: i8[M, K] activations quantized per row; w: i8[N, K] weights.

    Returns:
      i32[M, N].
    """
    return jnp.einsum("mk,nk->mn", xq, w, preferred_element_type=jnp.int32)


def int8_dot_kernel(xq: jax.Array, w: jax.Array, *, portable: bool = False) -> jax.Array:
    """`int8_dot_reference` by the C++ kernel, any number of rows (call where
    `cpu_attention.available()`); `portable`: its portable path even where the CPU has VNNI
    (tests; the same sums)."""
    call = jax.ffi.ffi_call(cpu_attention.W8A8_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((xq.shape[0], w.shape[0]), jnp.int32))
    return call(xq, w, portable=portable)


def quantize_activations(x: jax.Array, terms: int = W8A8_ACTIVATION_TERMS
                         ) -> tuple[jax.Array, jax.Array]:
    """x f[M, K] as `terms` int8 terms per row: (i8[terms * M, K], f32[terms * M]), term t of
    row m at row t * M + m, with `x ~= sum_t q[t * M + m] * s[t * M + m]`. Term 0 is
    `quantize_int8(x)`; each further term quantizes what the terms before it leave, so
    `|x - sum_t q s| <= s_last / 2` per element."""
    x = x.astype(jnp.float32)
    q, s = quantize_int8(x)
    qs, ss = [q], [s]
    for _ in range(terms - 1):
        x = x - q.astype(jnp.float32) * s[:, None]
        q, s = quantize_int8(x)
        qs.append(q)
        ss.append(s)
    return jnp.concatenate(qs), jnp.concatenate(ss)


@functools.partial(jax.jit, static_argnames=("use_kernel", "terms"))
def w8a8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *, use_kernel: bool = False,
                terms: int = W8A8_ACTIVATION_TERMS) -> jax.Array:
    """W8A8: x as int8 terms per row (`quantize_activations`), each times the int8 weights
    summed exactly in int32 (`int8_dot_reference`; by the C++ kernel for steps of up to
    `W8A8_KERNEL_MAX_ROWS` rows where `use_kernel`), scaled `float(acc) * (sx * scale)`, the
    terms added in order.

    Args:
      x: f[..., K] activations (any float dtype; quantized from float32).
      w: i8[N, K] weights; scale: f32[N] per-output scales.
      use_kernel: the C++ kernel may run (CPU only, where `cpu_attention.available()`).
      terms: int8 terms per activation row (1: plain per-token int8).

    Returns:
      f32[..., N], the same bits on every path: the paths differ only in the int32 sums,
      which are exact.

    Raises:
      ValueError: mismatched shapes or dtypes.
    """
    _check_operands("w8a8_matmul", x, w, scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_activations(x2, terms)
    if use_kernel and x2.shape[0] <= W8A8_KERNEL_MAX_ROWS:
        acc = int8_dot_kernel(xq, w)
    else:
        acc = int8_dot_reference(xq, w)
    y = acc.astype(jnp.float32) * (sx[:, None] * scale.astype(jnp.float32)[None, :])
    y = functools.reduce(jnp.add, jnp.split(y, terms))
    return y.reshape(*lead, w.shape[0])
