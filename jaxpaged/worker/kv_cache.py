"""The paged KV pool: what it holds (`KVCacheSpec`) and the arrays themselves (`KVCache`).

A pool is float (`f[L, 2, K, P, S, H]` of the pool's dtype) or 8-bit ("int8", "fp8": one-byte
codes of that layout plus a float32 scale per token and head, `pallas_kernels.reference`'s
`QuantizedKVCache`). The attention backends and the models read either one as those kernel
types (`KVCache.pool`); everything else about the pool (its dtype name, bytes per token, how
many blocks a memory budget holds, its sharding, whether it was lost with a fault, releasing
it for sleep and allocating it again on wake) is asked of the objects here, one way for every
kind of pool.

Tensor parallelism shards the pool on its KV-head axis (`pallas_kernels.KV_CACHE_SPEC`), the
codes and the scales alike, each device holding its own heads' K/V.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxpaged.config import KV_CACHE_DTYPES, CacheConfig
from jaxpaged.models import ModelConfig
from jaxpaged.pallas_kernels import KV_CACHE_SPEC
from jaxpaged.pallas_kernels.backends import layer_pages
from jaxpaged.pallas_kernels.reference import KV_CODE_DTYPES, QuantizedKVCache

# `kv_cache_dtype` values (vLLM's option): "auto" is the model's dtype.
POOL_DTYPES = KV_CACHE_DTYPES[1:]  # what a pool is, once "auto" is resolved


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype) -> str:
    """The pool's dtype name: "auto" is the name of the model's `model_dtype` (a jnp dtype);
    "int8" and "fp8" (float8_e4m3fn codes) are 8-bit pools with per-token scales.

    Raises:
      ValueError: a value not in `KV_CACHE_DTYPES`, or "auto" with a model dtype no pool has.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    name = jnp.dtype(model_dtype).name
    if name not in POOL_DTYPES:
        raise ValueError(f"kv_cache_dtype 'auto': the model's dtype {name!r} is not one of "
                         f"{POOL_DTYPES}")
    return name


def code_dtype(dtype: str) -> jnp.dtype:
    """The dtype of the pool's elements for pool dtype `dtype` (a `POOL_DTYPES` name): the
    float dtype itself, int8 for "int8", uint8 (float8_e4m3fn bit patterns) for "fp8"."""
    if dtype in KV_CODE_DTYPES:
        return jnp.dtype(KV_CODE_DTYPES[dtype][0])
    return jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """What a pool holds: `[L, 2, K, P, S, H]` elements of `dtype`, sharded over `mesh`.

    Raises (on construction):
      ValueError: `dtype` not in `POOL_DTYPES`, or a size < 1.
    """

    dtype: str  # a `POOL_DTYPES` name: "float32", "bfloat16", "float16", "int8" or "fp8"
    num_layers: int  # L
    num_kv_heads: int  # K, all devices' together
    num_blocks: int  # P
    block_size: int  # S, tokens per block
    head_dim: int  # H
    mesh: Mesh | None = None  # tensor parallelism's (KV heads sharded); None: one device

    def __post_init__(self):
        if self.dtype not in POOL_DTYPES:
            raise ValueError(f"KV pool dtype {self.dtype!r} is not one of {POOL_DTYPES}")
        for name in ("num_layers", "num_kv_heads", "num_blocks", "block_size", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCacheSpec.{name} must be an int >= 1, got {value!r}")

    @classmethod
    def for_model(cls, config: ModelConfig, dtype: str, num_blocks: int, block_size: int,
                  mesh: Mesh | None = None) -> KVCacheSpec:
        """The pool of `config`'s layers and KV heads (after `for_tensor_parallel`)."""
        return cls(dtype, config.num_hidden_layers, config.num_key_value_heads, num_blocks,
                   block_size, config.head_dim, mesh)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """`(L, 2, K, P, S, H)`: the float pool's, or the 8-bit pool's codes' (its scales drop
        the last axis)."""
        return (self.num_layers, 2, self.num_kv_heads, self.num_blocks, self.block_size,
                self.head_dim)

    @property
    def quantized(self) -> bool:
        """Whether the pool is 8-bit codes with scales (a `QuantizedKVCache`)."""
        return self.dtype in KV_CODE_DTYPES

    @property
    def code_dtype(self) -> jnp.dtype:
        """The dtype of the pool's elements (`code_dtype`)."""
        return code_dtype(self.dtype)

    @property
    def sharding(self) -> NamedSharding | None:
        """Every pool array's sharding (by KV head), or None on one device."""
        return None if self.mesh is None else NamedSharding(self.mesh, KV_CACHE_SPEC)

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes one token takes over all layers, keys and values, all devices: `L * 2 *
        K * H` elements, and for an 8-bit pool a float32 scale per layer, key/value and head."""
        L, _, K, _, _, H = self.shape
        if self.quantized:
            return L * 2 * K * (H + 4)
        return L * 2 * K * H * self.code_dtype.itemsize

    @property
    def nbytes(self) -> int:
        """The whole pool's bytes, all devices."""
        return self.bytes_per_token * self.num_blocks * self.block_size

    def zeros(self) -> jax.Array | QuantizedKVCache:
        """A new empty pool, placed with `sharding`: the kernels' input type (a jax.Array, or a
        `QuantizedKVCache` of codes and scales)."""
        if self.mesh is None:
            return _zeros(self.shape, self.dtype)
        return jax.jit(functools.partial(_zeros, self.shape, self.dtype),
                       out_shardings=self.sharding)()


def _zeros(shape: tuple[int, ...], dtype: str) -> jax.Array | QuantizedKVCache:
    if dtype in KV_CODE_DTYPES:
        return QuantizedKVCache(jnp.zeros(shape, code_dtype(dtype)),
                                jnp.ones(shape[:-1], jnp.float32))
    return jnp.zeros(shape, dtype)


def kv_cache_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """`KVCacheSpec.bytes_per_token` of `config`'s pool of pool dtype `dtype`."""
    return KVCacheSpec.for_model(config, dtype, 1, 1).bytes_per_token


def num_kv_blocks(config: ModelConfig, cache_config: CacheConfig, dtype: str) -> int:
    """Blocks in the pool of pool dtype `dtype`: `cache_config.num_kv_blocks`, or as many as
    `kv_cache_memory_bytes` (bytes, all devices together) holds."""
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    bytes_per_block = kv_cache_bytes_per_token(config, dtype) * cache_config.block_size
    return int(cache_config.kv_cache_memory_bytes // bytes_per_block)


class KVCache:
    """One model's KV pool: its `spec` and its arrays, `pool`, which the jitted step takes
    (donated) and gives back updated; the runner stores each new one here.

    `pool` is None between `release` and `restore` (the engine asleep).
    """

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        self.pool: jax.Array | QuantizedKVCache | None = spec.zeros()

    @property
    def shape(self) -> tuple[int, ...]:
        """`spec.shape`, `(L, 2, K, P, S, H)`."""
        return self.spec.shape

    @property
    def nbytes(self) -> int:
        """Bytes the pool's arrays hold now, all devices (0 once released)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.pool))

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array, dict]:
        """One layer's view as the attention backends read it (`backends.layer_pages`):
        (k_pages, v_pages, scales), `[K, P, S, H]` each of the pool's element dtype, and for an
        8-bit pool `{"k_scales", "v_scales"}` f32[K, P, S] (else {}).

        Raises:
          ValueError: the pool was released or lost, or `layer` is not in [0, L).
        """
        if self.is_deleted():
            raise ValueError("the KV pool was released or lost: nothing to read")
        if not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer {layer} is not in [0, {self.spec.num_layers})")
        return layer_pages(self.pool, layer)

    def is_deleted(self) -> bool:
        """Whether any of the pool's arrays is gone: released, or donated to a step that failed
        (then every sequence's K/V is lost)."""
        return self.pool is None or any(x.is_deleted() for x in jax.tree.leaves(self.pool))

    def block_until_ready(self) -> None:
        """Waits for the last step's writes (raises a fault of that step that shows only when
        the pool is read, as on an accelerator); a released pool has none."""
        if self.pool is not None:
            jax.block_until_ready(self.pool)

    def release(self) -> None:
        """Frees the pool's arrays now (sleep); their contents are lost."""
        if self.pool is not None:
            for x in jax.tree.leaves(self.pool):
                x.delete()
            self.pool = None

    def restore(self) -> None:
        """A new empty pool of `spec` in place of a released one (wake); no-op otherwise."""
        if self.pool is None:
            self.pool = self.spec.zeros()
