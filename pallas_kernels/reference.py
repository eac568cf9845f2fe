"""Pure-jnp (XLA) paged attention and KV-cache write: the CPU path and the kernels' reference.

Axis alphabet used in shapes, comments and einsum strings throughout the project:
  B sequences, Q new query tokens of one sequence, N query heads, K KV heads, G = N // K query
  heads per KV head, H head dim, P pages (blocks) in the pool, S page size (`block_size`),
  M pages per row in a block table, L layers, T flattened tokens.

KV pool layout: `kv_cache: f[L, 2, K, P, S, H]` (index 1 of the second axis: 0 = keys, 1 = values).
A token at position `pos` of a sequence lives in physical block `block_table[pos // S]` at offset
`pos % S`; its flat *slot* is `block * S + offset` (PagedAttention paper, section 4.1-4.3).

An 8-bit pool (`kv_cache_dtype` "int8" or "fp8") is a `QuantizedKVCache`: the same layout of
one-byte codes plus one float32 scale per token and head, `value = code * scale`, the scale
chosen when the token is written (`max |x| / 127` for int8, `/ 448` for float8_e4m3fn), so a
token's K/V never change after and blocks stay shareable (prefix caching, copy-on-write).
float8_e4m3fn codes are stored as their bit patterns in uint8: XLA:CPU rewrites a scatter into
an f8 array as one in float32 over the whole pool.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

PAD_SLOT_ID = -1  # slot_mapping value of a padding token: its K/V is not written
_MASK_VALUE = -1e30  # finite, so fully masked (padding) rows give finite output instead of NaN


_KEYS_PER_CHUNK = 1 << 16  # keys gathered at once by `paged_attention_xla_packed`

# kv_cache_dtype -> the codes' storage dtype and their largest value (symmetric scaling):
# int8 codes as they are, float8_e4m3fn codes as uint8 bit patterns (module doc).
KV_CODE_DTYPES = {"int8": (jnp.int8, 127.0), "fp8": (jnp.uint8, 448.0)}
_QMAX = {jnp.dtype(d): m for d, m in KV_CODE_DTYPES.values()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKVCache:
    """An 8-bit KV pool: `codes: i8[L, 2, K, P, S, H]` (int8 codes) or `u8[...]` (the bit
    patterns of float8_e4m3fn codes) and `scales: f32[L, 2, K, P, S]`, the value of a code
    being `code * scale` of its token and head (module doc)."""

    codes: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def dtype(self):
        return self.codes.dtype

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(k_codes, v_codes, k_scales, v_scales) of one layer: [K, P, S, H] and [K, P, S]."""
        return (self.codes[layer, 0], self.codes[layer, 1], self.scales[layer, 0],
                self.scales[layer, 1])


def codes_to_float(codes: jax.Array) -> jax.Array:
    """Stored codes (int8, or uint8 float8_e4m3fn bit patterns) as float32, before scaling."""
    if codes.dtype == jnp.uint8:
        codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    return codes.astype(jnp.float32)


def quantize_kv(x: jax.Array, storage_dtype) -> tuple[jax.Array, jax.Array]:
    """x f[..., H] -> (codes [..., H] stored as `storage_dtype`, f32[...] scales), one scale
    per row: `max |x| / qmax` (1 for a zero row); int8 codes rounded to nearest."""
    qmax = _QMAX[jnp.dtype(storage_dtype)]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    y = jnp.clip(x / scale[..., None], -qmax, qmax)
    if jnp.dtype(storage_dtype) == jnp.int8:
        return jnp.round(y).astype(jnp.int8), scale
    return jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8), scale


def dequantize_kv(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """codes [..., H] times scales [...]: the K/V values in `dtype`."""
    return (codes_to_float(codes) * scales[..., None]).astype(dtype)


def paged_attention_xla_packed(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                               block_tables: jax.Array, seq_lens: jax.Array,
                               query_start_loc: jax.Array, *, scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None,
                               k_scales: jax.Array | None = None,
                               v_scales: jax.Array | None = None) -> jax.Array:
    """Causal paged attention of a packed step, every key read from the pool (pure jnp).

    Sequence s's new tokens are `q[query_start_loc[s] : query_start_loc[s + 1]]`, its newest,
    at positions `seq_lens[s] - q_len ..`; their K/V are already written to the pool. Each
    token gathers its sequence's pages through the block table and attends to the positions up
    to its own (the last `sliding_window` of them, when set). Tokens are taken in chunks so that
    at most `_KEYS_PER_CHUNK` keys per KV head are gathered at once.

    Args:
      q: f[T, N, H] queries (not pre-scaled).
      k_pages, v_pages: f[K, P, S, H], one layer of the pool; or an 8-bit pool's codes, with
        k_scales, v_scales: f32[K, P, S] their scales (`QuantizedKVCache`), decoded as read.
      block_tables: i32[B, M] each sequence's blocks; entries past its tokens any valid id.
      seq_lens: i32[B] tokens of each sequence, new ones included (0 for padding).
      query_start_loc: i32[B + 1] non-decreasing; tokens from `query_start_loc[B]` on belong to
        no sequence.
      scale: logit scale; sliding_window: tokens (None: the whole context); soft_cap: logits
        become soft_cap * tanh(logits / soft_cap) (Gemma 2) when set.

    Returns:
      f[T, N, H] in q's dtype; 0 for tokens of no sequence.
    """
    T, N, H = q.shape
    K, _, S, _ = k_pages.shape
    B, M = block_tables.shape
    block_tables, seq_lens, query_start_loc = map(jnp.asarray, (block_tables, seq_lens,
                                                                query_start_loc))
    token = jnp.arange(T)
    seq = jnp.clip(jnp.searchsorted(query_start_loc, token, side="right") - 1, 0, B - 1)
    end = query_start_loc[seq + 1]
    real = token < end
    pos = seq_lens[seq] - (end - token)  # [T]
    key_pos = jnp.arange(M * S)

    def one(args):  # one token: q_t f[N, H] over its sequence's M * S keys
        q_t, seq_t, pos_t, real_t = args
        k = k_pages[:, block_tables[seq_t]].reshape(K, M * S, H)
        v = v_pages[:, block_tables[seq_t]].reshape(K, M * S, H)
        if k_scales is not None:
            k = dequantize_kv(k, k_scales[:, block_tables[seq_t]].reshape(K, M * S), q.dtype)
            v = dequantize_kv(v, v_scales[:, block_tables[seq_t]].reshape(K, M * S), q.dtype)
        s = jnp.einsum("KGH,KlH->KGl", q_t.reshape(K, N // K, H), k,
                       preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        valid = (key_pos <= pos_t) & real_t
        if sliding_window is not None:
            valid &= key_pos > pos_t - sliding_window
        p = jax.nn.softmax(jnp.where(valid, s, _MASK_VALUE), axis=-1)
        out = jnp.einsum("KGl,KlH->KGH", p.astype(v.dtype), v,
                         preferred_element_type=jnp.float32)
        return jnp.where(real_t, out, 0.0).reshape(N, H).astype(q.dtype)

    chunk = max(1, min(T, _KEYS_PER_CHUNK // (M * S)))
    return jax.lax.map(one, (q, seq, pos, real), batch_size=chunk)


def copy_blocks(kv_cache, src: jax.Array, dst: jax.Array):
    """Copies whole blocks of every layer: block dst[i] <- block src[i] (copy-on-write).

    Args:
      kv_cache: f[L, 2, K, P, S, H] the pool, or a `QuantizedKVCache` (donate it).
      src, dst: i32[C] block ids; a pair may repeat (padding), dst ids are otherwise distinct.
    """
    return jax.tree.map(lambda x: x.at[:, :, :, dst].set(x[:, :, :, src]), kv_cache)


def write_kv(kv_cache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             layer: int | None = None):
    """Scatters the new tokens' K/V into the pool: every layer's in one update, or one layer's.

    Args:
      kv_cache: f[L, 2, K, P, S, H] the pool, or a `QuantizedKVCache` (each new token's K and
        V quantized, one scale per head); donate it to the enclosing jit so the update is in
        place.
      k, v: f[L, T, K, H] new keys and values of every layer, or f[1, T, K, H] of `layer`.
      slot_mapping: i32[T] flat slot (`block * S + offset`) of each token; `PAD_SLOT_ID` (-1)
        for padding tokens, which are dropped.
      layer: None (all layers), or the one layer (a Python int) that k and v belong to.

    Returns:
      The updated pool, same shape and dtype.
    """
    L, _, K, P, S, H = kv_cache.shape
    slots = jnp.where(slot_mapping < 0, P * S, slot_mapping)  # out of range -> dropped
    new = jnp.stack([k, v], axis=1).transpose(0, 1, 3, 2, 4)  # [L, 2, K, T, H]
    layers = slice(None) if layer is None else slice(layer, layer + 1)
    # Indexed by (block, offset) on the pool itself, not on a [.., P * S, H] reshape: with one
    # KV head (Gemma 3 270M) XLA's CPU layout assignment gave the reshaped scatter a layout of
    # its own and copied the whole pool twice a step to restore it.
    index = (layers, slice(None), slice(None), slots // S, slots % S)
    if isinstance(kv_cache, QuantizedKVCache):
        codes, scales = quantize_kv(new, kv_cache.codes.dtype)
        return QuantizedKVCache(kv_cache.codes.at[index].set(codes, mode="drop"),
                                kv_cache.scales.at[index].set(scales, mode="drop"))
    return kv_cache.at[index].set(new.astype(kv_cache.dtype), mode="drop")
