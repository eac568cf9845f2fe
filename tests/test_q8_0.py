"""GGUF Q8_0 blocks kept as they are (`quantization="q8_0"`): quantizing recovers a file's
blocks, the C++ kernel's block product against the exact integer sums, the paths
`q8_0_matmul` chooses, and an engine on a Q8_0 GGUF file holding the file's own blocks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.pallas_kernels import cpu_attention
from jaxpaged.pallas_kernels.quantized_matmul import (Q8_0_KERNEL_MAX_ROWS, dequantize_q8_0,
                                                      q8_0_dot_kernel, q8_0_dot_reference,
                                                      q8_0_matmul, quantize_q8_0)

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler")


def _file_blocks(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """ggml's `block_q8_0` bytes (an f16 scale, then 32 int8 values) -> (i8[N, K], f32[N, K/32])."""
    N, K = shape
    blocks = np.asarray(raw, np.uint8).reshape(N, K // 32, 34)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    return blocks[..., 2:].copy().view(np.int8).reshape(N, K), scales


def test_quantize_q8_0_gives_back_a_gguf_files_blocks():
    """gguf's Q8_0 quantizer (llama.cpp's reference) writes blocks whose dequantized values
    `quantize_q8_0` turns back into the same int8 values and scales, bit for bit; and its own
    error is at most half a step per value."""
    import gguf

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 160)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    w[3, 32:64] = 0.0  # an all-zero block
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    q, scale = quantize_q8_0(values)
    file_q, file_scale = _file_blocks(raw, w.shape)
    np.testing.assert_array_equal(q, file_q)
    nonzero = file_scale != 0  # a zero block: ggml's scale 0, ours 1; its values are 0 both ways
    np.testing.assert_array_equal(np.asarray(scale)[nonzero], file_scale[nonzero])
    assert not np.any(np.asarray(q)[3, 32:64])
    np.testing.assert_array_equal(dequantize_q8_0(q, scale), values)
    q, scale = quantize_q8_0(w)
    err = np.abs(np.asarray(dequantize_q8_0(q, scale)) - w)
    assert np.all(err <= np.repeat(np.asarray(scale), 32, axis=1) / 2 * (1 + 1e-6))


def test_q8_0_names_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32, got 100"):
        quantize_q8_0(jnp.ones((4, 100)))
    with pytest.raises(ValueError, match=r"q8_0_matmul: .* w int8\[4, 64\], dw float32\[4, 3\]"):
        q8_0_matmul(jnp.ones((2, 64)), jnp.ones((4, 64), jnp.int8), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="'int8'"):
        q8_0_matmul(jnp.ones((2, 64)), jnp.ones((4, 64), jnp.int8), jnp.ones((4, 2)),
                    activations="int8")


def test_q8_0_names_a_layer_it_cannot_hold():
    from flax import nnx

    from jaxpaged.models.quantization import quantize_model

    class Block(nnx.Module):
        def __init__(self):
            self.up = nnx.Linear(64, 48, rngs=nnx.Rngs(0))
            self.down = nnx.Linear(48, 64, rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match=r"'q8_0' of down: .*multiple of 32, got 48"):
        quantize_model(Block(), "q8_0")


# Jitted: one compilation per shape, where run eagerly each operation compiles for each shape.
@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _operands(M, N, K):
    kx, kw = jax.random.split(jax.random.key(M * N + K))
    x = jax.random.normal(kx, (M, K)) * jnp.linspace(0.1, 8, K)[None, :]
    w, dw = quantize_q8_0(jax.random.normal(kw, (N, K)) * 0.05)
    return x, w, dw


quantize = jax.jit(quantize_q8_0)
dot_reference = jax.jit(q8_0_dot_reference)


SHAPES = [(1, 200, 576), (2, 37, 32), (3, 64, 1536), (5, 130, 96), (9, 70, 160), (33, 72, 64)]


@pytest.mark.parametrize("M, N, K", SHAPES)
def test_q8_0_block_product_equals_the_exact_block_sums(M, N, K):
    """The block product (XLA's, and on CPU the kernel's VNNI and portable paths) equals the
    exact int64 sum of each block, scaled and added in float64, within float32 rounding of the
    products' magnitudes: 2 (blocks + 19) roundings of sum_b s_b sum_k |xq w| (the VNNI path
    scales its 16 lanes' partial sums of a block before adding them)."""
    x, w, dw = _operands(M, N, K)
    xq, dx = quantize(x)
    B = K // 32
    xb = np.asarray(xq, np.int64).reshape(M, B, 32)
    wb = np.asarray(w, np.int64).reshape(N, B, 32)
    scales = np.asarray(dx, np.float64)[:, None, :] * np.asarray(dw, np.float64)[None]
    exact = (np.einsum("mbk,nbk->mnb", xb, wb) * scales).sum(-1)
    size = (np.einsum("mbk,nbk->mnb", np.abs(xb), np.abs(wb)) * scales).sum(-1)
    bound = 2 * (B + 19) * 2.0 ** -24 * size + 1e-30
    paths = [dot_reference(xq, dx, w, dw)]
    if cpu_attention.available():
        paths += [q8_0_dot_kernel(xq, dx, w, dw, portable=p) for p in (False, True)]
    for got in paths:
        assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)


@pytest.mark.parametrize("M, N, K", SHAPES)
def test_q8_0_matmul_is_within_the_activations_bound_of_the_float_product(M, N, K):
    """Both ways `q8_0_matmul` takes x are within the Q8_0 activations' rounding (half a step
    per value) of x times the blocks' values in float64."""
    x, w, dw = _operands(M, N, K)
    values = np.asarray(dequantize_q8_0(w, dw), np.float64)
    ref = np.asarray(x, np.float64) @ values.T
    _, dx = quantize(x)
    steps = np.repeat(np.asarray(dx, np.float64), 32, axis=1)  # each value's step
    bound = steps / 2 @ np.abs(values).T + 1e-5 * (np.abs(np.asarray(x)) @ np.abs(values).T)
    for kw in ([dict()] + ([dict(use_kernel=True)] if cpu_attention.available() else [])):
        for activations in ("auto", "q8_0"):
            got = np.asarray(q8_0_matmul(x, w, dw, activations=activations, **kw))
            assert np.all(np.abs(got - ref) <= bound), (kw, activations)


@needs_kernel
def test_q8_0_paths_by_step_size_and_batch_invariance():
    """"auto": steps of up to Q8_0_KERNEL_MAX_ROWS rows on the kernel (Q8_0 activations),
    larger ones x in float32 times the blocks' values; "q8_0" on the kernel computes a row the
    same way, bit for bit, whatever else its step holds."""
    x, w, dw = _operands(Q8_0_KERNEL_MAX_ROWS + 5, 96, 160)
    small = x[:Q8_0_KERNEL_MAX_ROWS]
    np.testing.assert_array_equal(q8_0_matmul(small, w, dw, use_kernel=True),
                                  q8_0_dot_kernel(*quantize_q8_0(small), w, dw))
    np.testing.assert_allclose(q8_0_matmul(x, w, dw, use_kernel=True),
                               x @ dequantize_q8_0(w, dw).T, rtol=1e-5, atol=1e-4)
    full = np.asarray(q8_0_matmul(x, w, dw, use_kernel=True, activations="q8_0"))
    for rows in ([5], [5, 6], [0, 5, 12], list(range(11))):
        np.testing.assert_array_equal(
            q8_0_matmul(x[jnp.array(rows)], w, dw, use_kernel=True, activations="q8_0"),
            full[rows])


def test_engine_on_a_q8_0_gguf_holds_the_files_blocks(make_llm, tmp_path, monkeypatch):
    """`LLM(file.gguf, quantization="q8_0")` multiplies by the file's own Q8_0 blocks (its
    down projection compared byte for byte) and generates the greedy ids of the default
    (W8A8) engine on the same file where margins are large."""
    import gguf

    from jaxpaged.models.quantization import QuantizedLinear
    from test_quantization import (assert_greedy_ids_match_where_margins_are_large, down_proj,
                                   write_quantized_gguf)

    monkeypatch.setenv("JAXPAGED_HOME", str(tmp_path / "home"))
    path = tmp_path / "model.gguf"
    write_quantized_gguf(path, "Q8_0")

    llm = make_llm(str(path), quantization="q8_0", compilation_cache_dir=None)
    layer = down_proj(llm)
    assert isinstance(layer, QuantizedLinear) and layer.activations == "q8_0-auto"
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors
                  if t.name == "blk.0.ffn_down.weight")
    file_q, file_scale = _file_blocks(tensor.data, layer.weight.shape)
    np.testing.assert_array_equal(layer.weight[...], file_q)
    np.testing.assert_array_equal(layer.scale[...], file_scale)

    w8a8 = make_llm(str(path), compilation_cache_dir=None)
    assert_greedy_ids_match_where_margins_are_large(w8a8, llm)
