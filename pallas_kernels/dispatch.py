"""Attention backend dispatch: the one place the model's attention reaches a kernel.

Backends:
  "xla"               pure jnp: `reference.paged_attention_xla_flat` over a flat list of cached
                      blocks, or `paged_attention_xla` over padded block tables (the engine's
                      path where no C++ compiler is found). Each layer writes its new K/V into
                      the pool first; cached K/V are read from the pool, new K/V as passed in.
  "pallas"            the Pallas kernels (Triton on GPU): each layer writes its new K/V into the
                      pool first, then `paged_attention` (decode steps, Q == 1) or
                      `ragged_paged_attention` (any other step) reads everything from the pool.
  "pallas-interpret"  the same kernels under the Pallas interpreter (CPU tests).
  "cpu"               like "xla", but the cached blocks are read in place by a C++ kernel
                      (`cpu_attention.paged_attention_cpu`, an XLA FFI custom call compiled on
                      first use), and all layers' new K/V are written after the forward pass
                      in one scatter; float32 pools only, others take the "xla" code.
  "auto"              "pallas" on GPU; on CPU "cpu" where the kernel builds, else "xla".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels import cpu_attention
from jaxpaged.pallas_kernels.paged_attention import paged_attention
from jaxpaged.pallas_kernels.ragged_paged_attention import ragged_paged_attention
from jaxpaged.pallas_kernels.reference import (paged_attention_xla, paged_attention_xla_flat,
                                              write_kv)

ATTENTION_BACKENDS = ("auto", "cpu", "pallas", "pallas-interpret", "xla")


def resolve_attention_backend(name: str) -> str:
    """The concrete backend for `name`.

    Raises:
      ValueError: an unknown name, or "cpu" where the C++ kernel cannot be built.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend {name!r} is not one of {ATTENTION_BACKENDS}")
    if name == "auto":
        if jax.default_backend() != "cpu":
            return "pallas"
        return "cpu" if cpu_attention.available() else "xla"
    if name == "cpu" and not cpu_attention.available():
        raise ValueError("attention_backend 'cpu' needs the C++ kernel, which could not be "
                         "built here (see the log); use 'xla'")
    return name


def attention(backend: str, q, k, v, kv_cache, layer: int, slot_mapping, block_tables,
              num_computed_tokens, query_lens, *, scale: float, context=None,
              query_start_loc=None):
    """One layer's paged attention over a step batch.

    Args:
      backend: a resolved backend ("cpu", "xla", "pallas" or "pallas-interpret").
      q: f[B, Q, N, H]; k, v: f[B, Q, K, H] the new tokens' projections (RoPE applied).
      kv_cache: f[L, 2, K, P, S, H] the whole pool; `layer` (a Python int) is this layer's
        index in it.
      slot_mapping: i32[B, Q]; block_tables: i32[B, M]; num_computed_tokens, query_lens: i32[B]
        (see `models.llama.ModelInput`). For the Pallas backends the block tables must cover
        the new tokens too.
      context: for "xla" and "cpu" only (required by "cpu"), None or (context_blocks,
        context_rows, context_lens), i32[NB] each: the rows' cached blocks as one flat list
        (`paged_attention_xla_flat`), used instead of `block_tables`.
      query_start_loc: for "cpu" only, None or i32[S + 1]: the batch is one packed row (B = 1,
        Q = T tokens) of S sequences, sequence s's tokens starting at `query_start_loc[s]`;
        `num_computed_tokens`, `query_lens` and the context rows are then per sequence.

    Returns:
      (out f[B, Q, N, H], kv_cache, new_kv). For "cpu" (float32), new_kv is (k, v), to be
      written for all layers with `write_kv` after the forward pass, and kv_cache is the pool
      the C++ kernel hands back aliased. For the other backends new_kv is None: the layer's
      new K/V are already written into the returned pool.
    """
    B, Q, N, H = q.shape
    if backend == "cpu":
        if kv_cache.dtype == jnp.float32:
            if query_start_loc is None:  # padded rows: row b's tokens start at b * Q
                query_start_loc = jnp.arange(B + 1, dtype=jnp.int32) * Q
            out, kv_cache = cpu_attention.paged_attention_cpu(
                q.reshape(B * Q, N, H), k.reshape(B * Q, *k.shape[2:]),
                v.reshape(B * Q, *v.shape[2:]), kv_cache, layer, query_start_loc, query_lens,
                *context, scale=scale)
            return out.reshape(B, Q, N, H).astype(q.dtype), kv_cache, (k, v)
        if query_start_loc is not None:
            raise ValueError("packed sequences (query_start_loc) need a float32 KV pool")
        backend = "xla"  # the kernel is float32 only
    # The other backends write this layer's new K/V first, in place. Each layer's write then
    # depends (through the hidden state) on the previous layer's reads of the pool, so XLA
    # orders them without copying the pool; one write after all layers would not be.
    kv_cache = write_kv(kv_cache, k.reshape(1, B * Q, *k.shape[2:]),
                        v.reshape(1, B * Q, *v.shape[2:]), slot_mapping.reshape(B * Q),
                        layer=layer)
    k_pages, v_pages = kv_cache[layer, 0], kv_cache[layer, 1]
    if backend == "xla":  # reads the cached tokens from the pool, the new ones from k and v
        if context is not None:
            out = paged_attention_xla_flat(q, k, v, k_pages, v_pages, *context, query_lens,
                                           scale=scale)
        else:
            out = paged_attention_xla(q, k, v, k_pages, v_pages, block_tables,
                                      num_computed_tokens, query_lens, scale=scale)
        return out, kv_cache, None
    interpret = backend == "pallas-interpret"
    # Each row owns Q query slots; padding slots sit after its real tokens, so the real ones keep
    # their positions and never see the padding (causal mask).
    context_lens = num_computed_tokens + Q
    if Q == 1:
        out = paged_attention(q[:, 0], k_pages, v_pages, block_tables, context_lens,
                              scale=scale, interpret=interpret)[:, None]
    else:
        cu_q_lens = jnp.arange(B + 1, dtype=jnp.int32) * Q
        out = ragged_paged_attention(q.reshape(B * Q, N, H), k_pages, v_pages, block_tables,
                                     context_lens, cu_q_lens, B, scale=scale, max_q_len=Q,
                                     interpret=interpret).reshape(B, Q, N, H)
    return out, kv_cache, None
