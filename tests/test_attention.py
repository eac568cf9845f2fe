"""The paged jnp attention and the C++ CPU kernel equal dense causal attention; the KV write
lands in the right slots."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.pallas_kernels import (PAD_SLOT_ID, cpu_attention, paged_attention_xla,
                                     paged_attention_xla_flat, write_kv)


def dense_attention(q, k, v, scale):
    """q: [Q, N, H] the last Q positions of a context k, v: [C, K, H]; causal; GQA by repeat."""
    Q, N, H = q.shape
    C, K, _ = k.shape
    k = np.repeat(k, N // K, axis=1)
    v = np.repeat(v, N // K, axis=1)
    s = np.einsum("qnh,cnh->nqc", q, k) * scale
    q_pos = np.arange(C - Q, C)[:, None]
    s = np.where(np.arange(C)[None, :] <= q_pos, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nqc,cnh->qnh", p, v)


def build_case(rng, context_lens, query_lens, block_size, num_kv_heads=2, group=3, head_dim=16):
    """Random K/V per sequence, the cached part scattered to shuffled pages."""
    B = len(context_lens)
    N, K, H, S = num_kv_heads * group, num_kv_heads, head_dim, block_size
    Q = max(query_lens)
    max_blocks = max(-(-c // S) for c in context_lens)
    P = B * max_blocks + 3
    k_pages = rng.standard_normal((K, P, S, H)).astype(np.float32)  # garbage where unused
    v_pages = rng.standard_normal((K, P, S, H)).astype(np.float32)
    perm = rng.permutation(P)
    block_tables = perm[:B * max_blocks].reshape(B, max_blocks).astype(np.int32)
    q = rng.standard_normal((B, Q, N, H)).astype(np.float32)
    k_new = rng.standard_normal((B, Q, K, H)).astype(np.float32)
    v_new = rng.standard_normal((B, Q, K, H)).astype(np.float32)
    dense = []
    for b, (c, ql) in enumerate(zip(context_lens, query_lens)):
        cached = c - ql
        k_all = rng.standard_normal((c, K, H)).astype(np.float32)
        v_all = rng.standard_normal((c, K, H)).astype(np.float32)
        k_all[cached:], v_all[cached:] = k_new[b, :ql], v_new[b, :ql]
        for pos in range(cached):
            blk, off = block_tables[b, pos // S], pos % S
            k_pages[:, blk, off], v_pages[:, blk, off] = k_all[pos], v_all[pos]
        dense.append((k_all, v_all))
    num_computed = np.array([c - ql for c, ql in zip(context_lens, query_lens)], np.int32)
    return q, k_new, v_new, k_pages, v_pages, block_tables, num_computed, np.array(
        query_lens, np.int32), dense


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("mode", ["decode", "prefill", "chunk"])
def test_paged_equals_dense(block_size, mode):
    rng = np.random.default_rng(block_size)
    context_lens = [1, 15, 16, 17, 100]
    if mode == "decode":
        query_lens = [1] * len(context_lens)
    elif mode == "prefill":
        query_lens = list(context_lens)
    else:  # a chunk continuing a cached prefix; the first row has no prefix
        query_lens = [1, 7, 9, 1, 33]
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense = build_case(
        rng, context_lens, query_lens, block_size)
    scale = 16 ** -0.5
    out = np.asarray(paged_attention_xla(q, k_new, v_new, k_pages, v_pages, bt, nc, ql,
                                         scale=scale))
    for b, (k_all, v_all) in enumerate(dense):
        want = dense_attention(q[b, :ql[b]], k_all, v_all, scale)
        np.testing.assert_allclose(out[b, :ql[b]], want, rtol=1e-5, atol=1e-5)


def poison_unowned(k_pages, v_pages, block_tables, num_computed, block_size):
    """Sets every pool slot no row owns to 1e4, in place: reading one would show in the output."""
    owned = np.zeros(k_pages.shape[1:3], bool)
    for b, c in enumerate(num_computed):
        for pos in range(c):
            owned[block_tables[b, pos // block_size], pos % block_size] = True
    k_pages[:, ~owned], v_pages[:, ~owned] = 1e4, 1e4


def flat_blocks(block_tables, num_computed, block_size, num_padding):
    """The rows' cached blocks as one list (block, row, tokens), then `num_padding` padding
    entries (a valid block id, row B, 0 tokens)."""
    B = len(num_computed)
    blocks, rows, lens = [], [], []
    for b, c in enumerate(num_computed):
        for i in range(-(-int(c) // block_size)):
            blocks.append(block_tables[b, i])
            rows.append(b)
            lens.append(min(block_size, int(c) - i * block_size))
    blocks += [block_tables[0, 0]] * num_padding
    rows += [B] * num_padding
    lens += [0] * num_padding
    return (np.array(blocks, np.int32), np.array(rows, np.int32), np.array(lens, np.int32))


def test_cpu_kernel_builds_where_a_compiler_exists():
    # Otherwise every "cpu" test below would silently run nothing.
    has_compiler = (shutil.which("c++") or shutil.which("g++")) is not None
    assert cpu_attention.available() == has_compiler


def flat_attention(impl, q, k_new, v_new, k_pages, v_pages, blocks, rows, lens, ql, scale):
    """`paged_attention_xla_flat`, or the C++ kernel reading layer 1 of a 2-layer pool whose
    layer 0 is poison."""
    if impl == "xla":
        return paged_attention_xla_flat(q, k_new, v_new, k_pages, v_pages, blocks, rows, lens,
                                        ql, scale=scale)
    if not cpu_attention.available():
        pytest.skip("no C++ compiler")
    B, Q, N, H = q.shape
    flat = lambda x: x.reshape(B * Q, *x.shape[2:])
    out = cpu_kernel(flat(q), flat(k_new), flat(v_new), k_pages, v_pages,
                     np.arange(B + 1, dtype=np.int32) * Q, ql, blocks, rows, lens, scale)
    return np.asarray(out).reshape(B, Q, N, H)


def cpu_kernel(q, k_new, v_new, k_pages, v_pages, query_start_loc, ql, blocks, rows, lens,
               scale):
    layer = np.stack([k_pages, v_pages])
    kv_cache = np.stack([np.full_like(layer, 1e4), layer])  # layer 0 is poison
    out, pool = jax.jit(cpu_attention.paged_attention_cpu, static_argnames="scale")(
        q, k_new, v_new, kv_cache, np.int32(1), query_start_loc, ql, blocks, rows, lens,
        scale=scale)
    np.testing.assert_array_equal(pool, kv_cache)  # the aliased pool comes back untouched
    return out


@pytest.mark.parametrize("impl", ["xla", "cpu"])
@pytest.mark.parametrize("mode", ["decode", "prefill", "chunk"])
def test_flat_block_list_equals_dense(mode, impl):
    rng = np.random.default_rng(7)
    context_lens = [1, 15, 16, 17, 100, 40]
    query_lens = {"decode": [1] * 6, "prefill": context_lens, "chunk": [1, 7, 9, 1, 33, 2]}[mode]
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense = build_case(
        rng, context_lens, query_lens, 8)
    poison_unowned(k_pages, v_pages, bt, nc, 8)
    blocks, rows, lens = flat_blocks(bt, nc, 8, num_padding=5)
    out = np.asarray(flat_attention(impl, q, k_new, v_new, k_pages, v_pages, blocks, rows, lens,
                                    ql, 0.25))
    assert np.isfinite(out).all()
    for b, (k_all, v_all) in enumerate(dense):
        want = dense_attention(q[b, :ql[b]], k_all, v_all, 0.25)
        np.testing.assert_allclose(out[b, :ql[b]], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_flat_padding_rows_and_rows_without_context(impl):
    # Row 1 has no cached tokens (a fresh prefill); row 3 is a padding row (no tokens at all).
    rng = np.random.default_rng(3)
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense = build_case(
        rng, [21, 4, 11], [1, 4, 2], 8)
    pad = lambda a: np.concatenate([a, np.zeros_like(a[:1])])
    blocks, rows, lens = flat_blocks(bt, nc, 8, num_padding=3)
    rows = np.where(rows == len(nc), len(nc) + 1, rows)  # padding entries name row B
    out = np.asarray(flat_attention(impl, pad(q), pad(k_new), pad(v_new), k_pages, v_pages,
                                    blocks, rows, lens, pad(ql), 0.25))
    assert np.isfinite(out).all()
    for b, (k_all, v_all) in enumerate(dense):
        want = dense_attention(q[b, :ql[b]], k_all, v_all, 0.25)
        np.testing.assert_allclose(out[b, :ql[b]], want, rtol=1e-5, atol=1e-5)


# Head sizes 64 and 128 take the kernel's compiled-size code, where a group of 8 or more query
# rows (here the 40- and 37-token chunks, 3 heads a token) scores keys from a transposed tile;
# block size 32 splits each cached block into two tiles there.
@pytest.mark.parametrize("head_dim,block_size", [(16, 8), (64, 8), (64, 32), (128, 16)])
def test_cpu_kernel_packed_sequences_equal_dense(head_dim, block_size):
    # Sequences of different lengths packed on one token axis (gaps of padding tokens between
    # them): decodes, a fresh prompt and chunks continuing a cached prefix, in one call.
    if not cpu_attention.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(11)
    context_lens, query_lens = [30, 1, 40, 17, 70], [1, 1, 40, 5, 37]
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense = build_case(
        rng, context_lens, query_lens, block_size, head_dim=head_dim)
    poison_unowned(k_pages, v_pages, bt, nc, block_size)
    gaps = [0, 2, 0, 3, 1]
    starts = np.cumsum([0] + [g + n for g, n in zip(gaps, query_lens)])[:-1] + gaps
    T = int(starts[-1] + query_lens[-1] + 2)
    qp, kp, vp = (np.full((T, *x.shape[2:]), 1e4, np.float32) for x in (q, k_new, v_new))
    for b, (st, n) in enumerate(zip(starts, query_lens)):
        qp[st:st + n], kp[st:st + n], vp[st:st + n] = q[b, :n], k_new[b, :n], v_new[b, :n]
    qsl = np.append(starts, T).astype(np.int32)
    blocks, rows, lens = flat_blocks(bt, nc, block_size, num_padding=4)
    out = np.asarray(cpu_kernel(qp, kp, vp, k_pages, v_pages, qsl, ql, blocks, rows, lens, 0.25))
    real = np.zeros(T, bool)
    for b, (k_all, v_all) in enumerate(dense):
        st, n = starts[b], query_lens[b]
        real[st:st + n] = True
        want = dense_attention(q[b, :n], k_all, v_all, 0.25)
        np.testing.assert_allclose(out[st:st + n], want, rtol=1e-5, atol=1e-5)
    assert (out[~real] == 0).all()


def test_cpu_kernel_rejects_a_block_outside_the_pool():
    if not cpu_attention.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(0)
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, _ = build_case(rng, [9], [1], 8)
    blocks, rows, lens = flat_blocks(bt, nc, 8, num_padding=0)
    blocks[0] = k_pages.shape[1]  # one past the last block
    with pytest.raises(Exception, match="context block id out of range"):
        np.asarray(flat_attention("cpu", q, k_new, v_new, k_pages, v_pages, blocks, rows, lens,
                                  ql, 0.25))


def test_padding_rows_are_finite_and_do_not_touch_real_rows():
    rng = np.random.default_rng(0)
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense = build_case(rng, [17, 5], [1, 1], 8)
    pad = lambda a: np.concatenate([a, np.zeros_like(a[:1])])
    out = np.asarray(paged_attention_xla(pad(q), pad(k_new), pad(v_new), k_pages, v_pages,
                                         pad(bt), pad(nc), pad(ql), scale=0.25))
    assert np.isfinite(out).all()
    ref = np.asarray(paged_attention_xla(q, k_new, v_new, k_pages, v_pages, bt, nc, ql,
                                         scale=0.25))
    np.testing.assert_array_equal(out[:2], ref)


def test_write_kv_scatters_to_slots_and_drops_padding():
    rng = np.random.default_rng(0)
    L, K, P, S, H, T = 2, 2, 4, 8, 4, 5
    cache = rng.standard_normal((L, 2, K, P, S, H)).astype(np.float32)
    k = rng.standard_normal((L, T, K, H)).astype(np.float32)
    v = rng.standard_normal((L, T, K, H)).astype(np.float32)
    slots = np.array([0, 9, 31, PAD_SLOT_ID, 17], np.int32)
    out = np.asarray(jax.jit(write_kv, donate_argnums=0)(jnp.asarray(cache), k, v, slots))
    want = cache.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want[:, 0, :, slot // S, slot % S] = k[:, t]
            want[:, 1, :, slot // S, slot % S] = v[:, t]
    np.testing.assert_array_equal(out, want)
