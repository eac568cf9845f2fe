"""Paged decode attention: one query token per sequence, K/V read from the block pool.

Follows PagedAttention (Kwon et al., 2023, section 4.1): each sequence's keys and values live in
fixed-size pages of a shared pool, reached through its block table; no sequence needs a contiguous
cache. Grouped-query attention is handled inside the kernel: one program instance serves all the
query heads of one KV head (padded to a multiple of 16 rows for the tensor-core dot), so each K/V
page is read once per KV head. Long contexts are split across `k_splits` program instances, each
keeping an online-softmax state; the wrapper merges the partial results by log-sum-exp
(flash-decoding).

Shapes (axis alphabet of `pallas_kernels.reference`):
  q: f[B, N, H]; k_pages, v_pages: f[K, P, S, H]; block_tables: i32[B, M]; context_lens: i32[B].
An 8-bit pool (`reference.QuantizedKVCache`) passes its codes as k_pages/v_pages (int8, or
uint8 float8_e4m3fn bit patterns) and its scales k_scales/v_scales: f32[K, P, S]; each gathered page is decoded
(code * scale) in the kernel, before its dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpaged.pallas_kernels.reference import codes_to_float

_NEG = -1e30  # masked logit; finite so a fully masked block leaves the softmax state unchanged


# -- reference --------------------------------------------------------------------------------

def paged_attention_reference(q, k_pages, v_pages, block_tables, context_lens, *, scale,
                              soft_cap=None, sliding_window=None, k_scales=None, v_scales=None):
    """Pure-jnp decode attention: gathers each row's pages, then dense masked softmax.

    The query of row b sits at position `context_lens[b] - 1` and attends to positions
    `[max(0, context_lens[b] - sliding_window), context_lens[b])`. Rows with context 0 give 0.
    """
    B, N, H = q.shape
    K, _, S, _ = k_pages.shape
    M = block_tables.shape[1]
    qg = q.reshape(B, K, N // K, H).astype(jnp.float32)
    k = k_pages[:, block_tables].reshape(K, B, M * S, H).astype(jnp.float32)
    v = v_pages[:, block_tables].reshape(K, B, M * S, H).astype(jnp.float32)
    if k_scales is not None:
        k = codes_to_float(k_pages[:, block_tables].reshape(K, B, M * S, H)) * k_scales[
            :, block_tables].reshape(K, B, M * S, 1)
        v = codes_to_float(v_pages[:, block_tables].reshape(K, B, M * S, H)) * v_scales[
            :, block_tables].reshape(K, B, M * S, 1)
    s = jnp.einsum("BKGH,KBlH->BKGl", qg, k) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    pos = jnp.arange(M * S)[None, :]
    valid = pos < context_lens[:, None]
    if sliding_window is not None:
        valid &= pos >= context_lens[:, None] - sliding_window
    s = jnp.where(valid[:, None, None, :], s, _NEG)
    p = jnp.where(valid[:, None, None, :], jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
    denom = p.sum(-1, keepdims=True)
    out = jnp.einsum("BKGl,KBlH->BKGH", p / jnp.where(denom > 0, denom, 1.0), v)
    return out.reshape(B, N, H).astype(q.dtype)


# -- validation -------------------------------------------------------------------------------

def check_paged_inputs(q, k_pages, v_pages, block_tables, context_lens, *, q_rank: int,
                       k_scales=None, v_scales=None):
    """Raises ValueError naming the shapes/dtypes when the arguments do not fit together."""
    shapes = (f"q{q.shape}:{q.dtype}, k_pages{k_pages.shape}:{k_pages.dtype}, "
              f"v_pages{v_pages.shape}:{v_pages.dtype}, block_tables{block_tables.shape}:"
              f"{block_tables.dtype}, context_lens{context_lens.shape}:{context_lens.dtype}")
    if q.ndim != q_rank or k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"expected q of rank {q_rank} and k_pages == v_pages of shape "
                         f"[K, P, S, H]; got {shapes}")
    K, _, S, H = k_pages.shape
    N = q.shape[-2]
    if q.shape[-1] != H or N % K:
        raise ValueError(f"q heads must be a multiple of the KV heads and head dims must match; "
                         f"got {shapes}")
    if k_scales is not None or v_scales is not None:
        if (k_scales is None or v_scales is None or k_scales.shape != k_pages.shape[:3]
                or v_scales.shape != k_pages.shape[:3]
                or k_pages.dtype not in (jnp.int8, jnp.uint8)
                or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16)):
            raise ValueError(f"an 8-bit pool needs int8 or uint8 (fp8) pages and k_scales, "
                             f"v_scales f32[K, P, S]; got {shapes}, k_scales "
                             f"{getattr(k_scales, 'shape', None)}, v_scales "
                             f"{getattr(v_scales, 'shape', None)}")
    elif not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in (
            jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q, k_pages and v_pages must share a float dtype; got {shapes}")
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be i32[num_seqs, max_blocks_per_seq]; got {shapes}")
    if context_lens.ndim != 1 or context_lens.dtype != jnp.int32:
        raise ValueError(f"context_lens must be i32[num_seqs]; got {shapes}")
    if H < 16 or S * max(1, 16 // S) < 16:
        raise ValueError(f"head_dim must be >= 16; got {shapes}")


def heads_per_program(group: int) -> int:
    """Query rows per program: the GQA group padded to a power of two >= 16 (tensor-core dot)."""
    return max(16, pl.next_power_of_2(group))


def pages_per_block(block_size: int) -> int:
    """Pages gathered per loop iteration: enough for a key block of >= 16 tokens."""
    return max(1, 16 // block_size)


# -- kernel -----------------------------------------------------------------------------------

def _online_softmax_step(carry, s, valid, v):
    """One flash-attention update: s, valid: [R, C]; v: [C, H]; carry (acc [R, H], m, l [R])."""
    acc, m, l = carry
    s = jnp.where(valid, s, _NEG)
    m_next = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    correction = jnp.exp(m - m_next)
    acc = acc * correction[:, None] + jnp.dot(p.astype(v.dtype), v,
                                              preferred_element_type=jnp.float32)
    return acc, m_next, l * correction + p.sum(axis=-1)


def load_pages(pages_ref, scales_ref, pages, C: int, H: int, dtype):
    """Pages `pages` of one KV head as [C, H] in `dtype`: from a float pool as they are, from
    an 8-bit pool decoded with their per-token scales (`scales_ref`: [P, S])."""
    x = pages_ref[pages].reshape(C, H)
    if scales_ref is None:
        return x
    return (codes_to_float(x) * scales_ref[pages].reshape(C)[:, None]).astype(dtype)


def _logits(q, k, scale, soft_cap):
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _decode_kernel(context_lens_ref, block_tables_ref, q_ref, k_ref, v_ref, *refs, scale,
                   soft_cap, sliding_window, pages_per_split, pages_per_iter, quantized):
    # block_tables_ref: [M_pad] (row b); q_ref: [R, H]; k_ref, v_ref: [P, S, H] (KV head h);
    # with `quantized`, ks_ref, vs_ref: [P, S]; acc_ref: [R, H]; m_ref, l_ref: [R] (row b,
    # head h, split s).
    ks_ref, vs_ref, acc_ref, m_ref, l_ref = refs if quantized else (None, None, *refs)
    b, split = pl.program_id(0), pl.program_id(2)
    R, H = q_ref.shape
    S = k_ref.shape[1]
    C = pages_per_iter * S  # keys per iteration
    ctx = context_lens_ref[b]
    first_page = split * pages_per_split
    num_pages = jnp.clip(pl.cdiv(ctx, S) - first_page, 0, pages_per_split)
    q = q_ref[...]

    def body(i, carry):
        page0 = first_page + i * pages_per_iter
        pages = block_tables_ref[pl.ds(page0, pages_per_iter)]
        k = load_pages(k_ref, ks_ref, pages, C, H, q.dtype)
        v = load_pages(v_ref, vs_ref, pages, C, H, q.dtype)
        pos = page0 * S + jnp.arange(C)
        valid = pos < ctx
        if sliding_window is not None:
            valid &= pos >= ctx - sliding_window
        valid = jnp.broadcast_to(valid[None, :], (R, C))
        return _online_softmax_step(carry, _logits(q, k, scale, soft_cap), valid, v)

    init = (jnp.zeros((R, H), jnp.float32), jnp.full((R,), _NEG, jnp.float32),
            jnp.zeros((R,), jnp.float32))
    acc, m, l = lax.fori_loop(0, pl.cdiv(num_pages, pages_per_iter), body, init)
    acc_ref[...], m_ref[...], l_ref[...] = acc, m, l


def merge_splits(acc, m, l):
    """Log-sum-exp merge over axis 2 of partial states: acc [..., s, R, H], m, l [..., s, R]."""
    m_max = m.max(axis=2, keepdims=True)
    w = jnp.exp(m - m_max)
    denom = (w * l).sum(axis=2)
    out = (w[..., None] * acc).sum(axis=2)
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]


# -- public wrapper ---------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "k_splits",
                                             "interpret", "tokens_per_iter", "num_warps",
                                             "num_stages"))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_tables: jax.Array, context_lens: jax.Array, *, scale: float,
                    soft_cap: float | None = None, sliding_window: int | None = None,
                    k_splits: int = 1, interpret: bool = False,
                    k_scales: jax.Array | None = None,
                    v_scales: jax.Array | None = None, tokens_per_iter: int | None = None,
                    num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Decode attention over the paged pool (Pallas; Triton on GPU, interpreter on CPU).

    Args:
      q: f[num_seqs, num_q_heads, head_dim], the query of each sequence's newest token (its K/V
        already written to the pool), not pre-scaled.
      k_pages, v_pages: f[num_kv_heads, num_blocks, block_size, head_dim], one layer of the pool
        (int8 or uint8-stored float8_e4m3fn codes of an 8-bit pool, with k_scales, v_scales: f32[num_kv_heads,
        num_blocks, block_size] their per-token scales).
      block_tables: i32[num_seqs, max_blocks_per_seq]; entries past a row's context are ignored
        but must be valid block ids (0 is fine).
      context_lens: i32[num_seqs] tokens in each sequence, the new one included; 0 for a
        padding row (its output is 0).
      scale: logit scale, usually head_dim ** -0.5.
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap) (Gemma 2).
      sliding_window: if set, a query attends only to its last `sliding_window` positions.
      k_splits: program instances sharing one sequence's context (flash-decoding); raise it for
        long contexts and small batches.
      interpret: run the Pallas interpreter (CPU tests).
      tokens_per_iter: keys each loop iteration reads, rounded down to a power of two of
        whole blocks (at least one); None: `pages_per_block`'s 16.
      num_warps, num_stages: the Triton launch's warps per program and pipeline stages.
      (k_splits, tokens_per_iter, num_warps and num_stages change speed, not results beyond
      float rounding: `bench/gpu_e2e.py` sweeps them on a GPU.)

    Returns:
      f[num_seqs, num_q_heads, head_dim] in q's dtype.

    Raises:
      ValueError: at trace time, when shapes or dtypes do not fit together (the message names
        them all).
    """
    check_paged_inputs(q, k_pages, v_pages, block_tables, context_lens, q_rank=3,
                       k_scales=k_scales, v_scales=v_scales)
    quantized = k_scales is not None
    B, N, H = q.shape
    K, P, S, _ = k_pages.shape
    G = N // K
    R = heads_per_program(G)
    per_iter = pages_per_block(S)
    if tokens_per_iter is not None:  # whole blocks, a power of two of them (Triton's tiles)
        per_iter = 1 << (max(1, tokens_per_iter // S).bit_length() - 1)
    M = block_tables.shape[1]
    pages_per_split = pl.cdiv(pl.cdiv(M, k_splits), per_iter) * per_iter
    block_tables = jnp.pad(block_tables, ((0, 0), (0, k_splits * pages_per_split - M)))
    qg = jnp.pad(q.reshape(B, K, G, H), ((0, 0), (0, 0), (0, R - G), (0, 0)))

    kernel = functools.partial(_decode_kernel, scale=scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_split=pages_per_split,
                               pages_per_iter=per_iter, quantized=quantized)
    scale_specs = [pl.BlockSpec((None, P, S), lambda b, h, s: (h, 0, 0))] * 2 if quantized else []
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, k_splits),
        in_specs=[
            pl.BlockSpec((B,), lambda b, h, s: (0,)),  # context_lens
            pl.BlockSpec((None, block_tables.shape[1]), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, None, R, H), lambda b, h, s: (b, h, 0, 0)),  # q
            pl.BlockSpec((None, P, S, H), lambda b, h, s: (h, 0, 0, 0)),  # k_pages
            pl.BlockSpec((None, P, S, H), lambda b, h, s: (h, 0, 0, 0)),  # v_pages
            *scale_specs,  # k_scales, v_scales
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, R, H), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, K, k_splits, R, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, k_splits, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, k_splits, R), jnp.float32)],
        interpret=interpret,
        # Written for the Triton backend (pallas.triton ops), never Mosaic GPU.
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="jaxpaged_paged_decode_attention",
    )(context_lens, block_tables, qg, k_pages, v_pages,
      *((k_scales, v_scales) if quantized else ()))
    out = merge_splits(acc, m, l)[:, :, :G]  # [B, K, G, H]
    return out.reshape(B, N, H).astype(q.dtype)
