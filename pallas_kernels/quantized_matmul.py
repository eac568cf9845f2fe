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

On a CPU with AVX-512 VNNI the whole product is one call of the C++ kernel
(`csrc/w8a8_matmul_cpu.cc`, `w8a8_matmul_kernel`): it quantizes the activations into their
terms, multiplies them by weights packed once at load time (`pack_int8`: panels of 16 output
channels, 4 consecutive k side by side, VNNI's operand layout) at every step size, from one
token's GEMV to a prefill chunk, and scales the sums; elsewhere XLA computes it (the kernel's
portable loop gives the same results, for tests, more slowly than XLA). On a 2-core Zen 4 the
kernel's int8 product is 1.1-3.6x XLA's int8 dot from 32 rows up, and a whole W8A8 call
1.6-2.5x XLA's and 0.9-2.5x a float32 dot (`bench/results/quantized-matmul.json`). The int32
sums are exact and the kernel repeats XLA's float operations in XLA's order, so every path
gives the same bits, and a row's output does not depend on the other rows of its step.

GGUF's Q8_0 keeps its blocks (`q8_0_matmul`): one scale per 32 weights along K
(`dw: f32[N, K // 32]`) instead of one per output channel. Steps of a few rows quantize the
activations the same way and sum each block's int8 product in int32 before scaling it, as
llama.cpp's Q8_0 dot product does (`csrc/q8_0_matmul_cpu.cc`); larger ones multiply float32
activations by the blocks' values. Quantizing a Q8_0 file's dequantized weights with
`quantize_q8_0` gives back the file's blocks exactly (its largest value in each block is
+-127 times the block's scale), so the loader keeps dequantizing to float and
`quantization="q8_0"` recovers the file as it is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.pallas_kernels import cpu_attention

# int8 terms per activation row in `w8a8_matmul` (1: plain per-token int8).
W8A8_ACTIVATION_TERMS = 2
# Values per GGUF Q8_0 block (ggml's QK8_0).
Q8_0_BLOCK = 32
# Steps of up to this many rows take the C++ Q8_0 kernel (where the caller allows it); larger
# ones a float32 dot of the dequantized blocks, which dequantizes every weight at each call
# (`bench/results/quantized-matmul.json`: the kernel is faster to about 128 rows on the LM
# head, level with float32 from 32 to 128 on the layers).
Q8_0_KERNEL_MAX_ROWS = 64


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
      x: f[..., K] activations (any float dtype; products summed in float32).
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
        # bfloat16 / float16 activations meet the weights in their own dtype (every int8 is
        # exact there, each product exact in the float32 sum): the same sums as the reference's,
        # on a GPU's 16-bit matmul units (XLA fuses the weights' widening into the matmul).
        dtype = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
        return jnp.einsum("...k,nk->...n", x.astype(dtype), w.astype(dtype),
                          preferred_element_type=jnp.float32) * scale
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


# Output channels per panel of `pack_int8`'s layout.
PANEL = 16


def pack_int8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The C++ W8A8 kernel's weight layout (`csrc/w8a8_matmul_cpu.cc`), built once at load time:
    w i8[N, K] -> (wp i8[P, K4, 16, 4], wsum i32[16 P]) with P = ceil(N / 16), K4 = ceil(K / 4),
    `wp[p, k4, j, i] = w[16 p + j, 4 k4 + i]` (zero past N or K) and `wsum[n] = sum_k w[n, k]`."""
    N, K = w.shape
    P, K4 = -(-N // PANEL), -(-K // 4)
    padded = jnp.pad(w, ((0, P * PANEL - N), (0, K4 * 4 - K)))
    wp = padded.reshape(P, PANEL, K4, 4).transpose(0, 2, 1, 3)
    return wp, jnp.sum(padded, axis=1, dtype=jnp.int32)


def unpack_rows(wp: jax.Array, rows: jax.Array, k: int) -> jax.Array:
    """i8[..., k]: rows `rows` (int[...]) of the matrix `pack_int8` packed into wp, read in
    place (an embedding lookup on a packed table)."""
    picked = wp[rows // PANEL, :, rows % PANEL, :]  # [..., K4, 4]
    return picked.reshape(*rows.shape, -1)[..., :k]


def int8_dot_kernel(xq: jax.Array, wp: jax.Array, wsum: jax.Array, n: int, *,
                    portable: bool = False) -> jax.Array:
    """`int8_dot_reference(xq, w)` by the C++ kernel on `pack_int8(w) = (wp, wsum)`, any number
    of rows (call where `cpu_attention.available()`): i32[M, n], n = w's rows. `portable`: its
    portable path even where the CPU has VNNI (tests; the same sums)."""
    call = jax.ffi.ffi_call(cpu_attention.W8A8_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((xq.shape[0], n), jnp.int32))
    return call(xq, wp, wsum, portable=portable)


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


def w8a8_matmul_kernel(x: jax.Array, wp: jax.Array, wsum: jax.Array, scale: jax.Array, *,
                       terms: int = W8A8_ACTIVATION_TERMS, portable: bool = False) -> jax.Array:
    """The whole W8A8 product in the C++ kernel (call where `cpu_attention.available()`): x
    f32[M, K] quantized there as `quantize_activations` does, the terms' int8 products on
    `pack_int8(w) = (wp, wsum)`, scaled by scale f32[N] and added there too: f32[M, N], one
    custom call in place of the dozen small XLA ops of the other path, whose float operations
    it repeats in their order (the same bits, tested); `portable`: the kernel's portable path
    even where the CPU has VNNI (tests; the same bits).

    Raises:
      ValueError: `terms` is not 1 or 2 (the kernel's).
    """
    if terms not in (1, 2):
        raise ValueError(f"w8a8_matmul_kernel: terms must be 1 or 2, got {terms}")
    call = jax.ffi.ffi_call(cpu_attention.W8A8_MATMUL_F32_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], scale.shape[0]), jnp.float32))
    return call(x.astype(jnp.float32), wp, wsum, scale.astype(jnp.float32),
                terms=np.int32(terms), portable=portable)


@functools.partial(jax.jit, static_argnames=("terms", "portable"))
def w8a8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, wsum: jax.Array | None = None,
                *, terms: int = W8A8_ACTIVATION_TERMS, portable: bool = False) -> jax.Array:
    """W8A8: x as int8 terms per row (`quantize_activations`), each times the int8 weights
    summed exactly in int32, scaled `float(acc) * (sx * scale)`, the terms added in order.
    For weights i8[N, K] the int32 sums are XLA's int8 dot (`int8_dot_reference`) and the rest
    XLA's ops; for weights packed by `pack_int8` (with their `wsum`) the C++ kernel computes it
    all (`w8a8_matmul_kernel`).

    Args:
      x: f[..., K] activations (any float dtype; quantized from float32).
      w: i8[N, K] weights, or `pack_int8`'s i8[P, K4, 16, 4] (CPU only, where
        `cpu_attention.available()`); scale: f32[N] per-output scales.
      wsum: i32[16 P], `pack_int8`'s, with packed weights (else None).
      terms: int8 terms per activation row (1: plain per-token int8).
      portable: packed weights only: the kernel's portable path even where the CPU has VNNI
        (tests; the same bits).

    Returns:
      f32[..., N], the same bits on both paths (the kernel repeats XLA's float operations in
      their order); a row's do not depend on the other rows of its step.

    Raises:
      ValueError: mismatched shapes or dtypes, or packed weights with `terms` not 1 or 2.
    """
    packed = w.ndim == 4
    if packed:
        N = scale.shape[0]
        if wsum is None or w.dtype != jnp.int8 or w.shape[0] != -(-N // PANEL) \
                or w.shape[1:] != (-(-x.shape[-1] // 4), PANEL, 4):
            raise ValueError(f"w8a8_matmul: expected x f[..., K], packed w i8[ceil(N/16), "
                             f"ceil(K/4), 16, 4] with its wsum, scale f32[N]; got x "
                             f"{x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}, scale "
                             f"{scale.dtype}{list(scale.shape)}, wsum "
                             f"{None if wsum is None else list(wsum.shape)}")
    else:
        _check_operands("w8a8_matmul", x, w, scale)
        N = w.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if packed:
        y = w8a8_matmul_kernel(x2, w, wsum, scale, terms=terms, portable=portable)
    else:
        xq, sx = quantize_activations(x2, terms)
        acc = int8_dot_reference(xq, w)
        y = acc.astype(jnp.float32) * (sx[:, None] * scale.astype(jnp.float32)[None, :])
        y = functools.reduce(jnp.add, jnp.split(y, terms))
    return y.reshape(*lead, N)


def quantize_q8_0(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """GGUF Q8_0 (ggml's `block_q8_0`): x f[..., K] -> (i8[..., K], f32[..., K // 32]), each
    run of 32 values along K symmetric with `scale = max|x| / 127` (a zero block gets scale 1)
    and `q = round(x / scale)`, so `|x - q * scale| <= scale / 2`.

    Raises:
      ValueError: K is not a multiple of 32.
    """
    x = jnp.asarray(x, jnp.float32)
    K = x.shape[-1]
    if K % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 needs the input features to be a multiple of {Q8_0_BLOCK}, got "
                         f"{K}")
    blocks = x.reshape(*x.shape[:-1], K // Q8_0_BLOCK, Q8_0_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(blocks / scale[..., None]), -127, 127).astype(jnp.int8)
    return q.reshape(x.shape), scale


def q8_0_dot_reference(xq: jax.Array, dx: jax.Array, w: jax.Array, dw: jax.Array) -> jax.Array:
    """Pure jnp: `y[m, n] = sum_b (dx[m, b] * dw[n, b]) * float(sum_{k in b} xq[m, k] * w[n, k])`,
    each block's product summed exactly in int32 (XLA's int8 dot, batched over blocks).

    Args:
      xq: i8[M, K], dx: f32[M, K // 32] (activations, `quantize_q8_0`); w: i8[N, K], dw:
        f32[N, K // 32] (weights).

    Returns:
      f32[M, N].
    """
    (M, K), N = xq.shape, w.shape[0]
    B = K // Q8_0_BLOCK
    isum = jnp.einsum("bmk,bnk->bmn", xq.reshape(M, B, Q8_0_BLOCK).transpose(1, 0, 2),
                      w.reshape(N, B, Q8_0_BLOCK).transpose(1, 0, 2),
                      preferred_element_type=jnp.int32)
    return jnp.einsum("bmn,mb,nb->mn", isum.astype(jnp.float32), dx, dw)


def q8_0_dot_kernel(xq: jax.Array, dx: jax.Array, w: jax.Array, dw: jax.Array, *,
                    portable: bool = False) -> jax.Array:
    """`q8_0_dot_reference` by the C++ kernel, any number of rows (call where
    `cpu_attention.available()`), equal up to float32 summation order; `portable`: its portable
    path even where the CPU has VNNI (tests)."""
    call = jax.ffi.ffi_call(cpu_attention.Q8_0_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((xq.shape[0], w.shape[0]), jnp.float32))
    return call(xq, dx.astype(jnp.float32), w, dw.astype(jnp.float32), portable=portable)


def dequantize_q8_0(w: jax.Array, dw: jax.Array) -> jax.Array:
    """f32[N, K]: the Q8_0 blocks' values, `w[n, k] * dw[n, k // 32]` (exact in float32)."""
    N, K = w.shape
    blocks = w.reshape(N, K // Q8_0_BLOCK, Q8_0_BLOCK).astype(jnp.float32) * dw[..., None]
    return blocks.reshape(N, K)


@functools.partial(jax.jit, static_argnames=("use_kernel", "activations"))
def q8_0_matmul(x: jax.Array, w: jax.Array, dw: jax.Array, *, use_kernel: bool = False,
                activations: str = "auto") -> jax.Array:
    """GGUF Q8_0 blocks as they are, times x taken one of two ways:
    - llama.cpp's Q8_0 product: x quantized per 32 values (`quantize_q8_0`) and multiplied
      block by block, by the C++ kernel where `use_kernel` (`q8_0_dot_kernel`, which computes
      each row alone, the same way whatever the step's size), else `q8_0_dot_reference`;
    - x in float32 times the blocks' values (`dequantize_q8_0`, XLA's dot).
    `activations` "q8_0": the first at every size (batch-invariant mode); "auto": the first on
    the C++ kernel for steps of up to `Q8_0_KERNEL_MAX_ROWS` rows, the second otherwise, which
    is faster for many rows (`bench/results/quantized-matmul.json`) and off the CPU kernels.

    Args:
      x: f[..., K] activations (any float dtype; products summed in float32).
      w: i8[N, K] weights; dw: f32[N, K // 32] their block scales.
      use_kernel: the C++ kernel may run (CPU only, where `cpu_attention.available()`).
      activations: "auto" or "q8_0", as above.

    Returns:
      f32[..., N].

    Raises:
      ValueError: mismatched shapes or dtypes, K not a multiple of 32, or another
        `activations`.
    """
    if w.ndim != 2 or w.dtype != jnp.int8 or x.shape[-1] != w.shape[1] \
            or w.shape[1] % Q8_0_BLOCK or dw.shape != (w.shape[0], w.shape[1] // Q8_0_BLOCK):
        raise ValueError(f"q8_0_matmul: expected x f[..., K], w i8[N, K], dw f32[N, K // 32] "
                         f"with K a multiple of {Q8_0_BLOCK}; got x {x.dtype}{list(x.shape)}, "
                         f"w {w.dtype}{list(w.shape)}, dw {dw.dtype}{list(dw.shape)}")
    if activations not in ("auto", "q8_0"):
        raise ValueError(f"q8_0_matmul: activations {activations!r} is not 'auto' or 'q8_0'")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    dw = dw.astype(jnp.float32)
    small = x2.shape[0] <= Q8_0_KERNEL_MAX_ROWS
    if use_kernel and (activations == "q8_0" or small):
        y = q8_0_dot_kernel(*quantize_q8_0(x2), w, dw)
    elif activations == "q8_0":
        y = q8_0_dot_reference(*quantize_q8_0(x2), w, dw)
    else:
        y = jnp.einsum("mk,nk->mn", x2, dequantize_q8_0(w, dw),
                       preferred_element_type=jnp.float32)
    return y.reshape(*lead, w.shape[0])
