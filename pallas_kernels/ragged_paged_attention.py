"""Ragged paged attention: any number of new query tokens per sequence, in one kernel.

Serves prefill, chunked prefill, prefix-cache hits, decode, and batches mixing them, in vLLM v1's
packed layout: the step's T new tokens lie back to back on one axis, and sequence b contributes
the query rows `q[cu_q_lens[b]:cu_q_lens[b + 1]]` (`cu_q_lens` is vLLM's query_start_loc). They
are its newest tokens, at positions `context_lens[b] - q_len .. context_lens[b] - 1`, and their K/V
are already in the pool (see `reference.write_kv`). Each attends causally to the sequence's pages
up to its own position.

Programs run for real query tiles only (as in tpu-inference's ragged paged attention and vLLM's
varlen flash attention): sequence b is cut into cdiv(q_len_b, BLOCK_Q) tiles of BLOCK_Q rows, each
inside that one sequence, and the grid is (tile, KV head). The wrapper maps tile -> (sequence,
first row) with a cumulative sum of tiles per sequence and `searchsorted`, and hands the map to
the kernel as small int32 inputs. The tile axis has a static bound (see `max_query_tiles`, about
cdiv(T, BLOCK_Q) + B); programs past the real tile count exit at once. A program instance loops
over the GQA group's query heads, so each K/V block is loaded once per KV head, and walks the keys
page by page through the block table with an online softmax (FlashAttention-2 style).

Shapes: q: f[T, N, H]; k_pages, v_pages: f[K, P, S, H]; block_tables: i32[B, M];
context_lens: i32[B]; cu_q_lens: i32[B + 1]; num_seqs: i32[] (rows past it are ignored). An
8-bit pool adds k_scales, v_scales: f32[K, P, S], as in `paged_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpaged.pallas_kernels.paged_attention import (
    _NEG, _logits, _online_softmax_step, check_paged_inputs, load_pages, pages_per_block)

BLOCK_Q = 16  # query rows per tile (one program); >= 16 for the tensor-core dot

# -- reference --------------------------------------------------------------------------------


def ragged_paged_attention_reference(q, k_pages, v_pages, block_tables, context_lens, cu_q_lens,
                                     num_seqs, *, scale, soft_cap=None, sliding_window=None):
    """Pure-jnp ragged attention: each token gathers its sequence's pages (small inputs only).

    Rows of q that belong to no sequence (past `cu_q_lens[num_seqs]`) come back as 0.
    """
    T, N, H = q.shape
    K, _, S, _ = k_pages.shape
    M = block_tables.shape[1]
    token = jnp.arange(T)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, token, side="right") - 1, 0, len(context_lens) - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = context_lens[seq] - q_len + token - cu_q_lens[seq]  # [T]
    real = (token < cu_q_lens[num_seqs])
    k = k_pages[:, block_tables[seq]].reshape(K, T, M * S, H).astype(jnp.float32)
    v = v_pages[:, block_tables[seq]].reshape(K, T, M * S, H).astype(jnp.float32)
    qg = q.reshape(T, K, N // K, H).astype(jnp.float32)
    s = jnp.einsum("TKGH,KTlH->TKGl", qg, k) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = jnp.arange(M * S)[None, :]
    valid = (key_pos <= pos[:, None]) & real[:, None]
    if sliding_window is not None:
        valid &= key_pos > pos[:, None] - sliding_window
    s = jnp.where(valid[:, None, None], s, _NEG)
    p = jnp.where(valid[:, None, None], jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
    denom = p.sum(-1, keepdims=True)
    out = jnp.einsum("TKGl,KTlH->TKGH", p / jnp.where(denom > 0, denom, 1.0), v)
    return out.reshape(T, N, H).astype(q.dtype)


# -- validation -------------------------------------------------------------------------------

def check_ragged_inputs(q, k_pages, v_pages, block_tables, context_lens, cu_q_lens,
                        k_scales=None, v_scales=None):
    """Raises ValueError naming the shapes/dtypes when the arguments do not fit together."""
    check_paged_inputs(q, k_pages, v_pages, block_tables, context_lens, q_rank=3,
                       k_scales=k_scales, v_scales=v_scales)
    B = block_tables.shape[0]
    if cu_q_lens.shape != (B + 1,) or cu_q_lens.dtype != jnp.int32 or context_lens.shape != (B,):
        raise ValueError(f"cu_q_lens must be i32[{B + 1}] and context_lens i32[{B}] for "
                         f"block_tables{block_tables.shape}; got cu_q_lens{cu_q_lens.shape}:"
                         f"{cu_q_lens.dtype}, context_lens{context_lens.shape}")


def max_query_tiles(num_tokens: int, max_num_seqs: int, block_q: int = BLOCK_Q) -> int:
    """Static bound on the query tiles of any batch of `num_tokens` tokens over `max_num_seqs`.

    With n sequences holding q_b >= 1 tokens each (sum q_b <= T, so n <= min(B, T)):
    sum_b cdiv(q_b, BQ) = sum_b floor((q_b + BQ - 1) / BQ) <= floor((T + n (BQ - 1)) / BQ), and
    every tile holds at least one token, so there are at most T. The bound is reached (n - 1
    one-token sequences and one holding the rest) and is never more than cdiv(T, BQ) + B.
    (At least 1, so the grid is never empty.)
    """
    T, B = num_tokens, max_num_seqs
    return max(1, min(T, (T + min(B, T) * (block_q - 1)) // block_q))


def query_tiles(cu_q_lens, num_seqs, num_tiles_bound: int, block_q: int = BLOCK_Q):
    """Tile -> (sequence, its first row within that sequence), and the real tile count (jnp).

    Returns tile_seq, tile_row0: i32[num_tiles_bound] (entries past the real count point at the
    last sequence and are never read) and num_tiles: i32[1].
    """
    B = cu_q_lens.shape[0] - 1
    q_lens = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)
    q_lens = jnp.where(jnp.arange(B) < num_seqs, q_lens, 0)
    tiles = (q_lens + block_q - 1) // block_q  # [B]
    ends = jnp.cumsum(tiles).astype(jnp.int32)  # [B]: tiles of sequences 0..b
    t = jnp.arange(num_tiles_bound, dtype=jnp.int32)
    tile_seq = jnp.minimum(jnp.searchsorted(ends, t, side="right"), B - 1).astype(jnp.int32)
    tile_row0 = (t - (ends[tile_seq] - tiles[tile_seq])) * block_q
    return tile_seq, tile_row0.astype(jnp.int32), ends[-1:]


# -- kernel -----------------------------------------------------------------------------------

def _ragged_kernel(num_tiles_ref, tile_seq_ref, tile_row0_ref, cu_q_lens_ref, context_lens_ref,
                   block_tables_ref, q_ref, k_ref, v_ref, *refs, scale, soft_cap,
                   sliding_window, group, pages_per_iter, quantized):
    # num_tiles_ref: [1]; tile_seq_ref, tile_row0_ref: [G]; q_ref, o_ref: [T + BLOCK_Q, N, H]
    # (whole); block_tables_ref: [B, M_pad] (whole); k_ref, v_ref: [P, S, H] (KV head h);
    # with `quantized`, ks_ref, vs_ref: [P, S].
    ks_ref, vs_ref, o_ref = refs if quantized else (None, None, *refs)
    t, h = pl.program_id(0), pl.program_id(1)
    M_pad = block_tables_ref.shape[1]
    S, H = k_ref.shape[1], k_ref.shape[2]
    block_q = BLOCK_Q

    @pl.when(t < num_tiles_ref[0])
    def _():
        b = tile_seq_ref[t]
        row0 = tile_row0_ref[t]  # first row of the tile within sequence b
        q_start = cu_q_lens_ref[b]
        q_len = cu_q_lens_ref[b + 1] - q_start
        ctx = context_lens_ref[b]
        rows = row0 + jnp.arange(block_q)
        row_valid = rows < q_len
        q_pos = ctx - q_len + rows  # [BQ]
        last_pos = ctx - q_len + jnp.minimum(row0 + block_q, q_len) - 1
        first_pos = 0 if sliding_window is None else jnp.maximum(
            ctx - q_len + row0 - sliding_window + 1, 0)
        first_iter = first_pos // (S * pages_per_iter)
        num_iters = jnp.minimum(pl.cdiv(last_pos + 1, S), M_pad) - first_iter * pages_per_iter
        num_iters = pl.cdiv(num_iters, pages_per_iter)
        C = pages_per_iter * S
        qs = [plgpu.load(q_ref.at[pl.ds(q_start + row0, block_q), h * group + g, :])
              for g in range(group)]

        def body(i, carry):
            page0 = (first_iter + i) * pages_per_iter
            pages = block_tables_ref[b, pl.ds(page0, pages_per_iter)]
            k = load_pages(k_ref, ks_ref, pages, C, H, q_ref.dtype)
            v = load_pages(v_ref, vs_ref, pages, C, H, q_ref.dtype)
            key_pos = page0 * S + jnp.arange(C)
            valid = (key_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
            if sliding_window is not None:
                valid &= key_pos[None, :] > q_pos[:, None] - sliding_window
            return tuple(_online_softmax_step(state, _logits(qg, k, scale, soft_cap), valid, v)
                         for qg, state in zip(qs, carry))

        init = tuple((jnp.zeros((block_q, H), jnp.float32),
                      jnp.full((block_q,), _NEG, jnp.float32),
                      jnp.zeros((block_q,), jnp.float32)) for _ in range(group))
        states = lax.fori_loop(0, num_iters, body, init)
        for g, (acc, _, l) in enumerate(states):
            out = acc / jnp.where(l > 0, l, 1.0)[:, None]
            plgpu.store(o_ref.at[pl.ds(q_start + row0, block_q), h * group + g, :],
                        out.astype(o_ref.dtype), mask=row_valid[:, None])


# -- public wrapper ---------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret"))
def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, context_lens: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array | int, *, scale: float,
                           soft_cap: float | None = None, sliding_window: int | None = None,
                           interpret: bool = False, k_scales: jax.Array | None = None,
                           v_scales: jax.Array | None = None) -> jax.Array:
    """Causal attention of each sequence's new tokens over its pages (Pallas; Triton on GPU).

    The grid is (max_query_tiles(T, B), K): one program per query tile of BLOCK_Q rows lying in
    one sequence, per KV head. Only the real tiles (sum over the first `num_seqs` sequences of
    cdiv(q_len_b, BLOCK_Q)) do work; the other programs exit at once. Nothing scales with
    B * max q_len.

    Args:
      q: f[T, N, H] (num_tokens, num_q_heads, head_dim) new tokens of all sequences, back to
        back, then any padding; not pre-scaled.
      k_pages, v_pages: f[K, P, S, H] (num_kv_heads, num_blocks, block_size, head_dim), one
        layer of the pool, with the new tokens' K/V already written (an 8-bit pool's codes,
        with k_scales, v_scales: f32[K, P, S]).
      block_tables: i32[B, M] (max_num_seqs, max_blocks_per_seq); entries past a row's context
        must be valid block ids (0 is fine).
      context_lens: i32[B] tokens of each sequence including its new ones.
      cu_q_lens: i32[B + 1] cumulative new-token counts (query_start_loc): cu_q_lens[0] == 0,
        non-decreasing, cu_q_lens[num_seqs] <= T. Values are clipped to [0, T].
      num_seqs: i32[] (or a Python int): rows of the tables that are real sequences.
      scale, soft_cap, sliding_window: as in `paged_attention`.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      f[T, N, H] in q's dtype. Rows past `cu_q_lens[num_seqs]` are left unwritten
      (unspecified).

    Raises:
      ValueError: at trace time, when shapes or dtypes do not fit together.
    """
    check_ragged_inputs(q, k_pages, v_pages, block_tables, context_lens, cu_q_lens,
                        k_scales, v_scales)
    quantized = k_scales is not None
    T, N, H = q.shape
    K, P, S, _ = k_pages.shape
    B, M = block_tables.shape
    per_iter = pages_per_block(S)
    block_tables = jnp.pad(block_tables, ((0, 0), (0, -M % per_iter)))
    # Pad rows so a tile starting at any real row stays in bounds.
    q_pad = jnp.pad(q, ((0, BLOCK_Q), (0, 0), (0, 0)))
    cu_q_lens = jnp.clip(cu_q_lens, 0, T)  # keeps every tile's rows inside q_pad
    G = max_query_tiles(T, B)
    tile_seq, tile_row0, num_tiles = query_tiles(cu_q_lens, jnp.asarray(num_seqs, jnp.int32), G)

    kernel = functools.partial(_ragged_kernel, scale=scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, group=N // K,
                               pages_per_iter=per_iter, quantized=quantized)
    scale_specs = [pl.BlockSpec((None, P, S), lambda t, h: (h, 0, 0))] * 2 if quantized else []
    whole = lambda shape: pl.BlockSpec(shape, lambda t, h: (0,) * len(shape))
    out = pl.pallas_call(
        kernel,
        grid=(G, K),
        in_specs=[
            whole((1,)),  # num_tiles
            whole((G,)),  # tile_seq
            whole((G,)),  # tile_row0
            whole((B + 1,)),  # cu_q_lens
            whole((B,)),  # context_lens
            whole(block_tables.shape),
            whole((T + BLOCK_Q, N, H)),  # q
            pl.BlockSpec((None, P, S, H), lambda t, h: (h, 0, 0, 0)),  # k_pages
            pl.BlockSpec((None, P, S, H), lambda t, h: (h, 0, 0, 0)),  # v_pages
            *scale_specs,  # k_scales, v_scales
        ],
        out_specs=whole((T + BLOCK_Q, N, H)),
        out_shape=jax.ShapeDtypeStruct((T + BLOCK_Q, N, H), q.dtype),
        interpret=interpret,
        # Written for the Triton backend (pallas.triton ops), never Mosaic GPU.
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="jaxpaged_ragged_paged_attention",
    )(num_tiles, tile_seq, tile_row0, cu_q_lens, context_lens, block_tables, q_pad, k_pages,
      v_pages, *((k_scales, v_scales) if quantized else ()))
    return out[:T]
