"""The CPU LoRA kernel (`pallas_kernels.lora_matmul`) against the one-hot jnp reference: random
slots (0, used and unused ones), one to three parts, ranks 8 and 16, widths that are not
multiples of 16, 1 to 300 tokens; the `LoRA` layer with it against itself without it; and an
engine with adapters on one CPU device in float32 runs it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.models.lora import LoRA, LoRASite
from jaxpaged.pallas_kernels import cpu_attention
from jaxpaged.pallas_kernels.lora_matmul import fits, lora_matmul, lora_matmul_reference
from jaxpaged.platforms import current_platform

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler")

# (input width, parts' output widths) of projections with 1, 2 and 3 parts
SHAPES = {1: (37, (83,)), 2: (100, (70, 33)), 3: (72, (40, 17, 130))}


def draw(T, P, rank, num_slots=5, seed=0):
    """x, slots (0..3 of 5 slots: slot 0 and two unused slots), a, b's of fresh random values."""
    rng = np.random.default_rng(seed)
    in_features, widths = SHAPES[P]
    f32 = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    slots = jnp.asarray(rng.integers(0, 4, T), jnp.int32)
    return (f32((T, in_features)), slots, f32((num_slots, in_features, P * rank)),
            [f32((num_slots, rank, w)) for w in widths])


@pytest.mark.parametrize("T", [1, 5, 64, 300])
@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("rank", [8, 16])
def test_equals_the_one_hot_reference(T, P, rank):
    x, slots, a, bs = draw(T, P, rank, seed=T * 100 + P * 10 + rank)
    assert fits(x, a, bs)
    got = np.asarray(jax.jit(lora_matmul)(x, slots, a, bs))
    want = np.asarray(lora_matmul_reference(x, slots, a, bs))
    assert got.shape == (T, sum(b.shape[-1] for b in bs))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not got[np.asarray(slots) == 0].any()  # no adapter: exact zeros


def test_each_row_uses_its_own_slot():
    """Rows of the same input under different slots differ, and a slot's row equals that
    slot's adapter alone (x @ A[s] @ B[s], in float64)."""
    x, _, a, bs = draw(4, 2, 8)
    x = jnp.broadcast_to(x[:1], x.shape)
    slots = jnp.asarray([0, 1, 2, 5], jnp.int32)  # 5: the last slot
    got = np.asarray(jax.jit(lora_matmul)(x, slots, a, bs))
    a64, x64 = np.asarray(a, np.float64), np.asarray(x[0], np.float64)
    for row, s in enumerate([1, 2, 5], start=1):
        h = x64 @ a64[s - 1]
        want = np.concatenate([h[p * 8:(p + 1) * 8] @ np.asarray(b[s - 1], np.float64)
                               for p, b in enumerate(bs)])
        np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-5)
    assert not got[0].any()


def test_fits_only_float32():
    x, _, a, bs = draw(3, 2, 8)
    assert fits(x, a, bs)
    assert not fits(x.astype(jnp.bfloat16), a.astype(jnp.bfloat16),
                    [b.astype(jnp.bfloat16) for b in bs])
    assert not fits(x, a[:, :, :12], bs)  # the rank axis not P whole ranks


def test_layer_equals_itself_without_the_kernel():
    site = LoRASite("layers.0.self_attn.qkv_proj", 72, (40, 17, 130), True)
    lora = LoRA(site, max_loras=5, max_lora_rank=16, dtype=jnp.float32, tensor_parallel_size=1)
    x, slots, a, bs = draw(64, 3, 16)
    lora.lora_a[...] = a
    for var, b in zip(lora.lora_b, bs):
        var[...] = b
    plain = lora(x, slots)
    fast = LoRA(site, max_loras=5, max_lora_rank=16, dtype=jnp.float32, tensor_parallel_size=1,
                lora_kernel=True)
    fast.lora_a[...] = a
    for var, b in zip(fast.lora_b, bs):
        var[...] = b
    assert fast.lora_kernel and not lora.lora_kernel
    jaxpr = str(jax.make_jaxpr(lambda x, s: fast(x, s))(x, slots))
    assert cpu_attention.LORA_MATMUL_TARGET in jaxpr
    np.testing.assert_allclose(fast(x, slots), plain, rtol=1e-5, atol=1e-4)


def test_the_engine_turns_the_kernel_on_where_the_platform_runs_it(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    runner = llm.llm_engine.runner
    loras = [node for _, node in nnx.iter_graph(nnx.merge(runner.graphdef, runner.params))
             if isinstance(node, LoRA)]
    plan = llm.llm_engine.config.modes.kernels
    assert plan == current_platform().kernel_plan(np.float32, False, False)
    assert loras and plan.lora_matmul
    assert all(node.lora_kernel for node in loras)


def test_the_platform_runs_it_on_one_device_in_float32_only():
    platform = current_platform()
    assert platform.kernel_plan(jnp.float32, False, False).lora_matmul == (
        "lora_matmul" in platform.kernels())
    assert not platform.kernel_plan(jnp.bfloat16, False, False).lora_matmul
    assert not platform.kernel_plan(jnp.float32, True, False).lora_matmul  # tensor parallel
    assert not platform.kernel_plan(jnp.float32, False, True).lora_matmul  # batch-invariant
