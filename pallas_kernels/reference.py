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


def _new_token_mask(Q: int, query_lens: jax.Array) -> jax.Array:
    """bool[B, Q, J]: new token q of a row sees new token j of the same row (causal), and j is
    a real token (j < query_lens)."""
    causal = jnp.arange(Q)[:, None] >= jnp.arange(Q)[None, :]  # [Q, J]
    return causal[None] & (jnp.arange(Q)[None, None, :] < query_lens[:, None, None])


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
    s_new = jnp.where(_new_token_mask(Q, query_lens)[:, None, None], s_new * scale,
                      _MASK_VALUE)  # [B, K, G, Q, J]

    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_new], axis=-1), axis=-1)
    p_ctx, p_new = probs[..., :M * S].astype(q.dtype), probs[..., M * S:].astype(q.dtype)
    out = (jnp.einsum("BKGQl,KBlH->BQKGH", p_ctx, v_ctx, preferred_element_type=jnp.float32)
           + jnp.einsum("BKGQJ,BJKH->BQKGH", p_new, v_new, preferred_element_type=jnp.float32))
    return out.reshape(B, Q, N, H).astype(q.dtype)


def paged_attention_xla_flat(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                             k_pages: jax.Array, v_pages: jax.Array, context_blocks: jax.Array,
                             context_rows: jax.Array, context_lens: jax.Array,
                             query_lens: jax.Array, *, scale: float) -> jax.Array:
    """`paged_attention_xla` over a flat list of cached blocks instead of padded block tables.

    The rows' cached blocks are listed one after another (row 0's in logical order, then row
    1's, ...), so the work is the real number of cached blocks, not B times the longest row's.
    With the padded tables a batch holding one 1,300-token row and 31 short ones reads 32 * 128
    blocks per layer; here it reads the short rows' real blocks plus that row's 82. Scores are
    exponentiated against their row's max (a segment max over the row's blocks and new tokens),
    and the per-block sums and partial outputs are added up per row with segment sums, the
    combine step of flash-decoding's split-K with one split per block.

    Args:
      q: f[B, Q, N, H] queries (not pre-scaled).
      k_new, v_new: f[B, Q, K, H] keys and values of the new tokens.
      k_pages, v_pages: f[K, P, S, H], one layer of the pool.
      context_blocks: i32[NB] physical block of each listed block; padding entries any valid id.
      context_rows: i32[NB] the row each block belongs to, non-decreasing; padding entries B
        (out of range, so segment reductions drop them).
      context_lens: i32[NB] cached tokens in each block (S but for a row's last block; 0 for
        padding).
      query_lens: i32[B] new tokens per row (<= Q); 0 for a padding row.
      scale: softmax scale, usually H ** -0.5.

    Returns:
      f[B, Q, N, H] in q's dtype, equal to `paged_attention_xla` on the same rows up to float
      rounding. Query slots past `query_lens[b]` hold finite garbage.
    """
    B, Q, N, H = q.shape
    K, _, S, _ = k_pages.shape
    G = N // K
    rows, row_of = context_rows, jnp.minimum(context_rows, B - 1)  # row_of: padding reads B-1

    # Segment reductions run over a leading row axis; everything else is K-major, so the
    # batched dots over (kv head, block) need no transposes of the gathered pages.
    def per_row(reduce, x):  # x: [K, NB, ...] -> [K, B, ...]; padding entries are dropped
        return reduce(x.swapaxes(0, 1), rows, num_segments=B,
                      indices_are_sorted=True).swapaxes(0, 1)

    batched = ((0, 1), (0, 1))  # dot_general batch dims: (K, block or row)

    # Query rows g = (G, Q): each kv head's G query heads at each of the Q new tokens.
    qk = q.reshape(B, Q, K, G, H).transpose(2, 0, 3, 1, 4).reshape(K, B, G * Q, H)
    k_ctx = k_pages[:, context_blocks]  # [K, NB, S, H]
    v_ctx = v_pages[:, context_blocks]
    s_ctx = jax.lax.dot_general(qk[:, row_of], k_ctx, (((3,), (3,)), batched),
                                preferred_element_type=jnp.float32)  # [K, NB, g, S]
    ctx_valid = jnp.arange(S)[None, :] < context_lens[:, None]  # [NB, S]
    s_ctx = jnp.where(ctx_valid[None, :, None, :], s_ctx * scale, _MASK_VALUE)

    s_new = jnp.einsum("BQKGH,BJKH->KBGQJ", q.reshape(B, Q, K, G, H), k_new,
                       preferred_element_type=jnp.float32)
    s_new = jnp.where(_new_token_mask(Q, query_lens)[None, :, None], s_new * scale,
                      _MASK_VALUE)
    s_new = s_new.reshape(K, B, G * Q, Q)  # [K, B, g, J]

    # Per-row max over its blocks and its new tokens; a row without blocks gets -inf there.
    m = jnp.maximum(per_row(jax.ops.segment_max, s_ctx.max(-1)), s_new.max(-1))  # [K, B, g]
    p_ctx = jnp.exp(s_ctx - m[:, row_of][..., None])  # [K, NB, g, S]; padding blocks are 0
    p_new = jnp.exp(s_new - m[..., None])
    denom = per_row(jax.ops.segment_sum, p_ctx.sum(-1)) + p_new.sum(-1)  # [K, B, g]
    out_ctx = jax.lax.dot_general(p_ctx.astype(q.dtype), v_ctx, (((3,), (2,)), batched),
                                  preferred_element_type=jnp.float32)  # [K, NB, g, H]
    out_new = jnp.einsum("KBgJ,BJKH->KBgH", p_new.astype(q.dtype), v_new,
                         preferred_element_type=jnp.float32)
    out = per_row(jax.ops.segment_sum, out_ctx) + out_new
    out = (out / denom[..., None]).reshape(K, B, G, Q, H)
    return out.transpose(1, 3, 0, 2, 4).reshape(B, Q, N, H).astype(q.dtype)


def copy_blocks(kv_cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copies whole blocks of every layer: block dst[i] <- block src[i] (copy-on-write).

    Args:
      kv_cache: f[L, 2, K, P, S, H] the pool (donate it).
      src, dst: i32[C] block ids; a pair may repeat (padding), dst ids are otherwise distinct.
    """
    return kv_cache.at[:, :, :, dst].set(kv_cache[:, :, :, src])


def write_kv(kv_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             layer: int | None = None) -> jax.Array:
    """Scatters the new tokens' K/V into the pool: every layer's in one update, or one layer's.

    Args:
      kv_cache: f[L, 2, K, P, S, H] the pool; donate it to the enclosing jit so the update is
        in place.
      k, v: f[L, T, K, H] new keys and values of every layer, or f[1, T, K, H] of `layer`.
      slot_mapping: i32[T] flat slot (`block * S + offset`) of each token; `PAD_SLOT_ID` (-1)
        for padding tokens, which are dropped.
      layer: None (all layers), or the one layer (a Python int) that k and v belong to.

    Returns:
      The updated pool, same shape and dtype.
    """
    L, _, K, P, S, H = kv_cache.shape
    slots = jnp.where(slot_mapping < 0, P * S, slot_mapping)  # out of range -> dropped
    new = jnp.stack([k, v], axis=1).transpose(0, 1, 3, 2, 4).astype(kv_cache.dtype)  # [L,2,K,T,H]
    layers = slice(None) if layer is None else slice(layer, layer + 1)
    flat = kv_cache.reshape(L, 2, K, P * S, H)
    flat = flat.at[layers, :, :, slots].set(new, mode="drop")
    return flat.reshape(kv_cache.shape)
