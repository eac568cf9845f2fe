"""The CPU few-row float32 matmul (`pallas_kernels.few_row_matmul`) against XLA's dot, and the
layers that use it against the same layers without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.models.layers import Embed, Linear
from jaxpaged.pallas_kernels import cpu_attention
from jaxpaged.pallas_kernels.few_row_matmul import MAX_ROWS, few_row_matmul, fits

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler")


@pytest.mark.parametrize("M", [2, 3, 5, 6, 7, 12, 16])
@pytest.mark.parametrize("K, N", [(64, 64), (100, 192), (576, 1536), (37, 128)])
@pytest.mark.parametrize("transposed", [False, True])
def test_equals_xla_dot(M, K, N, transposed):
    rng = np.random.default_rng(M * 1000 + K + N)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((N, K) if transposed else (K, N)), jnp.float32)
    assert fits(x, w, transposed)
    got = jax.jit(few_row_matmul, static_argnums=2)(x, w, transposed)
    want = np.asarray(x, np.float64) @ (np.asarray(w, np.float64).T if transposed
                                        else np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.sqrt(K))


def test_fits_only_few_float32_rows_of_whole_blocks():
    w = jnp.zeros((64, 128), jnp.float32)
    assert not fits(jnp.zeros((1, 64)), w)  # one row: XLA's GEMV
    assert not fits(jnp.zeros((MAX_ROWS + 1, 64)), w)
    assert fits(jnp.zeros((2, 8, 64)), w)  # rows counted over every leading axis
    assert not fits(jnp.zeros((4, 64)), jnp.zeros((64, 100), jnp.float32))  # N % 64
    assert not fits(jnp.zeros((4, 64), jnp.bfloat16), w.astype(jnp.bfloat16))


def test_layers_equal_without_the_kernel():
    rngs = nnx.Rngs(0)
    linear = Linear(96, 192, use_bias=True, rngs=rngs)
    linear.bias[...] = jnp.arange(192, dtype=jnp.float32)
    embed = Embed(256, 96, rngs=rngs)
    x = jax.random.normal(jax.random.key(1), (5, 96))
    plain = (linear(x), embed.attend(x))
    # The same parameters in layers built on the kernel (`KernelPlan.few_row_matmul`).
    fast_linear = Linear(96, 192, use_bias=True, rngs=nnx.Rngs(0), few_row_kernel=True)
    fast_embed = Embed(256, 96, rngs=nnx.Rngs(0), few_row_kernel=True)
    fast_linear.kernel[...], fast_linear.bias[...] = linear.kernel[...], linear.bias[...]
    fast_embed.embedding[...] = embed.embedding[...]
    assert fast_linear.few_row_kernel and not linear.few_row_kernel
    with_kernel = (fast_linear(x), fast_embed.attend(x))
    for a, b in zip(with_kernel, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
