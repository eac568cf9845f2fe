"""Ragged paged attention: any number of new query tokens per sequence, in one kernel.

Serves prefill, chunked prefill, prefix-cache hits, decode, and batches mixing them. Sequence b
contributes the query rows `q[cu_q_lens[b]:cu_q_lens[b + 1]]`; they are its newest tokens, at
positions `context_lens[b] - q_len .. context_lens[b] - 1`, and their K/V are already in the pool
(see `reference.write_kv`). Each attends causally to the sequence's pages up to its own position.

A program instance handles one (sequence, KV head, block of `block_q` query rows); the GQA group's
query heads are looped over inside it, so each K/V block is loaded once per KV head. Keys are
walked page by page through the block table with an online softmax (FlashAttention-2 style).

Shapes: q: f[T, N, H]; k_pages, v_pages: f[K, P, S, H]; block_tables: i32[B, M];
context_lens: i32[B]; cu_q_lens: i32[B + 1]; num_seqs: i32 scalar (rows past it are ignored).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpaged.pallas_kernels.paged_attention import (
    _NEG, _logits, _online_softmax_step, check_paged_inputs, pages_per_block)

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


# -- kernel -----------------------------------------------------------------------------------

def _ragged_kernel(num_seqs_ref, cu_q_lens_ref, context_lens_ref, block_tables_ref, q_ref, k_ref,
                   v_ref, o_ref, *, scale, soft_cap, sliding_window, group, pages_per_iter):
    # q_ref, o_ref: [T_pad, N, H] (whole); block_tables_ref: [M_pad] (row b);
    # k_ref, v_ref: [P, S, H] (KV head h).
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    M_pad = block_tables_ref.shape[0]
    S, H = k_ref.shape[1], k_ref.shape[2]
    q_start = cu_q_lens_ref[b]
    q_len = cu_q_lens_ref[b + 1] - q_start
    ctx = context_lens_ref[b]
    block_q = _BLOCK_Q
    row0 = j * block_q

    @pl.when((b < num_seqs_ref[0]) & (row0 < q_len))
    def _():
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
            pages = block_tables_ref[pl.ds(page0, pages_per_iter)]
            k = k_ref[pages].reshape(C, H)
            v = v_ref[pages].reshape(C, H)
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


_BLOCK_Q = 16  # query rows per program; >= 16 for the tensor-core dot


# -- public wrapper ---------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "max_q_len",
                                             "interpret"))
def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, context_lens: jax.Array,
                           cu_q_lens: jax.Array, num_seqs: jax.Array | int, *, scale: float,
                           soft_cap: float | None = None, sliding_window: int | None = None,
                           max_q_len: int | None = None, interpret: bool = False) -> jax.Array:
    """Causal attention of each sequence's new tokens over its pages (Pallas; Triton on GPU).

    Args:
      q: f[num_tokens, num_q_heads, head_dim] new tokens of all sequences, back to back; not
        pre-scaled.
      k_pages, v_pages: f[num_kv_heads, num_blocks, block_size, head_dim], one layer of the pool,
        with the new tokens' K/V already written.
      block_tables: i32[max_num_seqs, max_blocks_per_seq]; entries past a row's context must be
        valid block ids (0 is fine).
      context_lens: i32[max_num_seqs] tokens of each sequence including its new ones.
      cu_q_lens: i32[max_num_seqs + 1] cumulative new-token counts (cu_q_lens[0] == 0).
      num_seqs: i32 scalar: rows of the tables that are real sequences.
      scale, soft_cap, sliding_window: as in `paged_attention`.
      max_q_len: static bound on any sequence's new tokens (default num_tokens); bounds the grid.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      f[num_tokens, num_q_heads, head_dim] in q's dtype. Rows past `cu_q_lens[num_seqs]` are
      left unwritten (unspecified).

    Raises:
      ValueError: at trace time, when shapes or dtypes do not fit together.
    """
    check_paged_inputs(q, k_pages, v_pages, block_tables, context_lens, q_rank=3)
    B = block_tables.shape[0]
    if cu_q_lens.shape != (B + 1,) or cu_q_lens.dtype != jnp.int32 or context_lens.shape != (B,):
        raise ValueError(f"cu_q_lens must be i32[{B + 1}] and context_lens i32[{B}] for "
                         f"block_tables{block_tables.shape}; got cu_q_lens{cu_q_lens.shape}:"
                         f"{cu_q_lens.dtype}, context_lens{context_lens.shape}")
    T, N, H = q.shape
    K, P, S, _ = k_pages.shape
    per_iter = pages_per_block(S)
    M = block_tables.shape[1]
    block_tables = jnp.pad(block_tables, ((0, 0), (0, -M % per_iter)))
    # Pad rows so a block of queries starting at any real row stays in bounds.
    q_pad = jnp.pad(q, ((0, _BLOCK_Q), (0, 0), (0, 0)))
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(1)
    num_q_blocks = pl.cdiv(max_q_len or T, _BLOCK_Q)

    kernel = functools.partial(_ragged_kernel, scale=scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, group=N // K,
                               pages_per_iter=per_iter)
    out = pl.pallas_call(
        kernel,
        grid=(B, K, num_q_blocks),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, j: (0,)),  # num_seqs
            pl.BlockSpec((B + 1,), lambda b, h, j: (0,)),  # cu_q_lens
            pl.BlockSpec((B,), lambda b, h, j: (0,)),  # context_lens
            pl.BlockSpec((None, block_tables.shape[1]), lambda b, h, j: (b, 0)),
            pl.BlockSpec((T + _BLOCK_Q, N, H), lambda b, h, j: (0, 0, 0)),  # q
            pl.BlockSpec((None, P, S, H), lambda b, h, j: (h, 0, 0, 0)),  # k_pages
            pl.BlockSpec((None, P, S, H), lambda b, h, j: (h, 0, 0, 0)),  # v_pages
        ],
        out_specs=pl.BlockSpec((T + _BLOCK_Q, N, H), lambda b, h, j: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((T + _BLOCK_Q, N, H), q.dtype),
        interpret=interpret,
        # Written for the Triton backend (pallas.triton ops), never Mosaic GPU.
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="jaxpaged_ragged_paged_attention",
    )(num_seqs, cu_q_lens, context_lens, block_tables, q_pad, k_pages, v_pages)
    return out[:T]
