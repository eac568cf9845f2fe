"""Pure-jnp (XLA) paged attention and KV-cache write: the CPU path and the kernels' reference.

Axis alphabet used in shapes, comments and einsum strings throughout the project:
  B sequences (rows), Q new query tokens per row, N query heads, K KV heads, G = N // K query
  heads per KV head, H head dim, P pages (blocks) in the pool, S page size (`block_size`),
  M pages per row in a block table, L layers, T flattened tokens.

KV pool layout: `kv_cache: f[L, 2, K, P, S, H]` (index 1 of the second axis: 0 = keys, 1 = values).
A token at position `pos` of a sequence lives in physical block `block_table[pos // S]` at offset
`pos % S`; its flat *slot* is `block * S + offset` (PagedAttention paper, section 4.1-4.3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PAD_SLOT_ID = -1  # slot_mapping value of a padding token: its K/V is not written
_MASK_VALUE = -1e30  # finite, so fully masked (padding) rows give finite output instead of NaN


def paged_attention_xla(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                        k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                        num_computed_tokens: jax.Array, query_lens: jax.Array, *,
                        scale: float) -> jax.Array:
    """Causal attention of each row's new tokens over its cached pages plus its own new tokens.

    Row b has `num_computed_tokens[b]` tokens whose K/V are already in the pool (positions
    `0 .. c-1`, reached through `block_tables[b]`) and `query_lens[b]` new tokens at positions
    `c .. c+q-1`, whose K/V are passed in directly (`k_new`, `v_new`) and written to the pool
    after the forward pass. A prefill has c = 0; a decode has q = 1; a prefill chunk or a
    prefix-cache hit has both > 0. Query heads are grouped onto their KV head (GQA) without
    repeating K/V.

    Args:
      q: f[B, Q, N, H] queries (not pre-scaled).
      k_new, v_new: f[B, Q, K, H] keys and values of the new tokens.
      k_pages, v_pages: f[K, P, S, H], one layer of the pool.
      block_tables: i32[B, M] physical page of each of the row's first M logical pages; M may be
        0 when no row has cached tokens. Entries past a row's cached pages are ignored.
      num_computed_tokens: i32[B] cached tokens per row (<= M * S).
      query_lens: i32[B] new tokens per row (<= Q); 0 for a padding row.
      scale: softmax scale, usually H ** -0.5.

    Returns:
      f[B, Q, N, H] in q's dtype. Query slots past `query_lens[b]` hold finite garbage.
    """
    B, Q, N, H = q.shape
    K, _, S, _ = k_pages.shape
    G = N // K
    M = block_tables.shape[1]
    qg = q.reshape(B, Q, K, G, H)

    # Cached context, gathered page by page through the block table.
    k_ctx = k_pages[:, block_tables].reshape(K, B, M * S, H)  # [K, B, M*S, H]
    v_ctx = v_pages[:, block_tables].reshape(K, B, M * S, H)
    s_ctx = jnp.einsum("BQKGH,KBlH->BKGQl", qg, k_ctx, preferred_element_type=jnp.float32)
    ctx_valid = jnp.arange(M * S)[None, :] < num_computed_tokens[:, None]  # [B, M*S]
    s_ctx = jnp.where(ctx_valid[:, None, None, None, :], s_ctx * scale, _MASK_VALUE)

    # New tokens: causal among themselves.
    s_new = jnp.einsum("BQKGH,BJKH->BKGQJ", qg, k_new, preferred_element_type=jnp.float32)
    causal = jnp.arange(Q)[:, None] >= jnp.arange(Q)[None, :]  # [Q, J]
    new_valid = causal[None] & (jnp.arange(Q)[None, None, :] < query_lens[:, None, None])
    s_new = jnp.where(new_valid[:, None, None], s_new * scale, _MASK_VALUE)  # [B, K, G, Q, J]

    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_new], axis=-1), axis=-1)
    p_ctx, p_new = probs[..., :M * S].astype(q.dtype), probs[..., M * S:].astype(q.dtype)
    out = (jnp.einsum("BKGQl,KBlH->BQKGH", p_ctx, v_ctx, preferred_element_type=jnp.float32)
           + jnp.einsum("BKGQJ,BJKH->BQKGH", p_new, v_new, preferred_element_type=jnp.float32))
    return out.reshape(B, Q, N, H).astype(q.dtype)


def copy_blocks(kv_cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copies whole blocks of every layer: block dst[i] <- block src[i] (copy-on-write).

    Args:
      kv_cache: f[L, 2, K, P, S, H] the pool (donate it).
      src, dst: i32[C] block ids; a pair may repeat (padding), dst ids are otherwise distinct.
    """
    return kv_cache.at[:, :, :, dst].set(kv_cache[:, :, :, src])


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> jax.Array:
    """Scatters the new tokens' K/V of every layer into the pool in one update.

    Args:
      kv_cache: f[L, 2, K, P, S, H] the pool; donate it to the enclosing jit so the update is
        in place.
      k, v: f[L, T, K, H] new keys and values.
      slot_mapping: i32[T] flat slot (`block * S + offset`) of each token; `PAD_SLOT_ID` (-1)
        for padding tokens, which are dropped.

    Returns:
      The updated pool, same shape and dtype.
    """
    L, _, K, P, S, H = kv_cache.shape
    slots = jnp.where(slot_mapping < 0, P * S, slot_mapping)  # out of range -> dropped
    new = jnp.stack([k, v], axis=1).transpose(0, 1, 3, 2, 4).astype(kv_cache.dtype)  # [L,2,K,T,H]
    flat = kv_cache.reshape(L, 2, K, P * S, H)
    flat = flat.at[:, :, :, slots].set(new, mode="drop")
    return flat.reshape(kv_cache.shape)
