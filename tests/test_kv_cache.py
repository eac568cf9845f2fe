"""The KV pool object (`jaxpaged.worker.kv_cache`): one spec and one API for float and 8-bit
pools (bytes per token, blocks from a budget, allocation with its sharding, the per-layer view
the backends read, is_deleted, release and restore), and an engine's sleep/wake over each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpaged import SamplingParams
from jaxpaged.config import CacheConfig
from jaxpaged.distributed.parallel import make_mesh
from jaxpaged.pallas_kernels.backends import layer_pages
from jaxpaged.pallas_kernels.reference import QuantizedKVCache, write_kv
from jaxpaged.worker.kv_cache import (KVCache, KVCacheSpec, code_dtype, kv_cache_bytes_per_token,
                                      num_kv_blocks, resolve_kv_cache_dtype)

L, K, P_, S, H = 3, 2, 5, 4, 8  # layers, KV heads, blocks, block size, head dim


def spec(dtype: str, mesh=None) -> KVCacheSpec:
    return KVCacheSpec(dtype, L, K, P_, S, H, mesh)


@pytest.mark.parametrize("dtype, element_bytes", [
    ("float32", 4 * H), ("bfloat16", 2 * H), ("float16", 2 * H),
    ("int8", H + 4), ("fp8", H + 4)])  # 8-bit: one-byte codes and a float32 scale per head
def test_bytes_per_token_and_blocks_from_a_budget(dtype, element_bytes):
    s = spec(dtype)
    assert s.bytes_per_token == L * 2 * K * element_bytes
    assert s.nbytes == s.bytes_per_token * P_ * S
    cache = KVCache(s)
    assert cache.nbytes == s.nbytes  # what the arrays really take
    budget = CacheConfig(block_size=S, kv_cache_memory_bytes=10 * s.bytes_per_token * S + 1)

    class Config:
        num_hidden_layers, num_key_value_heads, head_dim = L, K, H

    assert kv_cache_bytes_per_token(Config, dtype) == s.bytes_per_token
    assert num_kv_blocks(Config, budget, dtype) == 10
    assert num_kv_blocks(Config, CacheConfig(block_size=S, num_kv_blocks=7), dtype) == 7


def test_pool_dtypes_resolve_to_one_name():
    assert resolve_kv_cache_dtype("auto", jnp.bfloat16) == "bfloat16"
    assert resolve_kv_cache_dtype("auto", np.float32) == "float32"
    assert resolve_kv_cache_dtype("fp8", jnp.float32) == "fp8"
    assert [code_dtype(d) for d in ("float16", "int8", "fp8")] == [jnp.float16, jnp.int8,
                                                                    jnp.uint8]
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not one of"):
        resolve_kv_cache_dtype("int4", jnp.float32)
    with pytest.raises(ValueError, match="'float64' is not one of"):
        resolve_kv_cache_dtype("auto", jnp.float64)
    with pytest.raises(ValueError, match="KV pool dtype 'auto' is not one of"):
        spec("auto")
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got 0"):
        KVCacheSpec("int8", L, K, 0, S, H)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "fp8"])
def test_layer_view_is_what_the_backends_read(dtype):
    cache = KVCache(spec(dtype))
    leaves = jax.tree.leaves(cache.pool)
    assert leaves[0].shape == (L, 2, K, P_, S, H) and leaves[0].dtype == code_dtype(dtype)
    assert isinstance(cache.pool, QuantizedKVCache) == (dtype in ("int8", "fp8"))
    # Write random K/V for two tokens of layer 1, then read the layer back.
    k, v = (jax.random.normal(jax.random.key(i), (L, 2, K, H)) for i in (0, 1))
    cache.pool = write_kv(cache.pool, k, v, jnp.array([S + 1, 3 * S], jnp.int32))
    got, want = cache.layer(1), layer_pages(cache.pool, 1)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    k_pages, v_pages, scales = got
    assert k_pages.shape == v_pages.shape == (K, P_, S, H)
    assert set(scales) == ({"k_scales", "v_scales"} if cache.spec.quantized else set())
    assert bool(jnp.any(k_pages[:, 1, 1] != 0)) and not bool(jnp.any(k_pages[:, 0] != 0))
    with pytest.raises(ValueError, match=r"layer 3 is not in \[0, 3\)"):
        cache.layer(3)


@pytest.mark.parametrize("dtype", ["float32", "int8", "fp8"])
def test_release_restore_and_is_deleted(dtype):
    cache = KVCache(spec(dtype))
    cache.pool = jax.tree.map(lambda x: x + 1, cache.pool)  # not zeros any more
    assert not cache.is_deleted()
    old = jax.tree.leaves(cache.pool)
    cache.release()
    assert cache.is_deleted() and cache.nbytes == 0 and all(x.is_deleted() for x in old)
    cache.block_until_ready()  # nothing to wait for
    with pytest.raises(ValueError, match="released or lost"):
        cache.layer(0)
    cache.restore()
    assert not cache.is_deleted()
    fresh = KVCache(spec(dtype)).pool
    for a, b in zip(jax.tree.leaves(cache.pool), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(a, b)  # an empty pool again
    # One array of several gone (donated to a failed step) is a lost pool.
    jax.tree.leaves(cache.pool)[-1].delete()
    assert cache.is_deleted()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_pool_is_sharded_by_kv_head(dtype):
    mesh = make_mesh(1)
    cache = KVCache(spec(dtype, mesh))
    assert cache.spec.sharding.spec == P(None, None, "model")
    for x in jax.tree.leaves(cache.pool):  # codes and scales alike
        assert x.sharding == cache.spec.sharding
    cache.release()
    cache.restore()
    assert all(x.sharding == cache.spec.sharding for x in jax.tree.leaves(cache.pool))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_sleep_and_wake_over_an_8bit_pool(make_llm, tiny_model_dir, kv_cache_dtype):
    llm = make_llm(tiny_model_dir, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=512)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    before = llm.generate(["Hello, my name is"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    cache = llm.llm_engine.runner.kv_cache
    assert cache.spec.dtype == kv_cache_dtype and cache.nbytes == cache.spec.nbytes
    live = sum(x.nbytes for x in jax.live_arrays())
    llm.sleep(1)
    assert cache.is_deleted()
    assert live - sum(x.nbytes for x in jax.live_arrays()) >= cache.spec.nbytes
    llm.wake_up()
    assert not cache.is_deleted()
    after = llm.generate(["Hello, my name is"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
