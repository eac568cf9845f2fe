"""Every attention backend equals dense causal attention (with sliding windows and soft-caps)
on packed steps; the C++ CPU kernel's own contract; the KV write lands in the right slots."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.pallas_kernels import (PAD_SLOT_ID, AttentionSpec, StepLimits, cpu_attention,
                                     make_attention_backend, ragged_paged_attention_reference,
                                     write_kv)


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


BACKENDS = ["cpu", "xla", "pallas-interpret"]
SPECS = [AttentionSpec(0.25), AttentionSpec(0.25, sliding_window=13),
         AttentionSpec(0.25, sliding_window=5, soft_cap=2.0), AttentionSpec(0.25, soft_cap=1.5)]
MODES = {  # (tokens per sequence with the new ones, new tokens per sequence)
    "decode": ([1, 15, 16, 17, 100, 40], [1] * 6),
    "prefill": ([1, 15, 16, 17, 100, 40], [1, 15, 16, 17, 100, 40]),
    "chunk": ([1, 15, 16, 17, 100, 40], [1, 7, 9, 1, 33, 2]),
}


def dense_spec_attention(q, k, v, spec: AttentionSpec):
    """`dense_attention` with the spec's soft-cap and sliding window (numpy, float64)."""
    Q, N, H = q.shape
    C, K, _ = k.shape
    k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
    s = np.einsum("qnh,cnh->nqc", q.astype(np.float64), k) * spec.scale
    if spec.soft_cap is not None:
        s = spec.soft_cap * np.tanh(s / spec.soft_cap)
    q_pos, k_pos = np.arange(C - Q, C)[:, None], np.arange(C)[None, :]
    valid = k_pos <= q_pos
    if spec.sliding_window is not None:
        valid &= k_pos > q_pos - spec.sliding_window
    s = np.where(valid, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nqc,cnh->qnh", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("spec", SPECS, ids=["plain", "window13", "window5-cap2", "cap1.5"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_backend_equals_dense(backend_name, mode, spec):
    # Each backend on a packed step, through its own metadata: sequences of 1 to 100 tokens in
    # blocks of 8, so windows of 5 and 13 end inside blocks and cross their boundaries, in
    # decode, prefill and chunked steps; then all three mixed in one step. Layer 0 of the pool
    # and every slot no sequence owns are poison.
    if backend_name == "cpu" and not cpu_attention.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(len(mode))
    context_lens, query_lens = MODES[mode]
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense = build_case(
        rng, context_lens, query_lens, 8)
    poison_unowned(k_pages, v_pages, bt, nc, 8)
    check_backend(backend_name, spec, q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_backend_mixed_step_equals_dense(backend_name, block_size):
    if backend_name == "cpu" and not cpu_attention.available():
        pytest.skip("no C++ compiler")
    rng = np.random.default_rng(5)
    context_lens, query_lens = [30, 1, 40, 17, 70, 9], [1, 1, 40, 5, 37, 1]
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense = build_case(
        rng, context_lens, query_lens, block_size)
    poison_unowned(k_pages, v_pages, bt, nc, block_size)
    for spec in SPECS[:3]:
        check_backend(backend_name, spec, q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense,
                      block_size)


def check_backend(backend_name, spec, q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense,
                  block_size=8):
    B, S = len(nc), block_size
    backend = make_attention_backend(backend_name)
    limits = StepLimits(block_size=S, num_blocks=k_pages.shape[1], max_seq_slots=8,
                        max_blocks_per_seq=bt.shape[1])
    T = int(ql.sum()) + 2  # two padding tokens at the end
    md = backend.build(limits, T, [(list(bt[b]), int(nc[b]), int(ql[b])) for b in range(B)])
    assert md.decode_only == (backend_name.startswith("pallas") and (ql == 1).all())
    starts = md.query_start_loc[:B]
    packed = lambda x: np.concatenate([x[b, :ql[b]] for b in range(B)]
                                      + [np.full((2, *x.shape[2:]), 1e4, np.float32)])
    layer = np.stack([k_pages, v_pages])
    kv_cache = np.stack([np.full_like(layer, 1e4), layer])  # layer 0 is poison
    attend = jax.jit(lambda q, k, v, kv_cache, md: backend.attention(q, k, v, kv_cache, 1, md,
                                                                     spec))
    out, pool, new_kv = attend(packed(q), packed(k_new), packed(v_new), kv_cache, md)
    out = np.asarray(out)
    assert np.isfinite(out).all()
    assert (new_kv is None) == backend.writes_kv_per_layer
    for b, (k_all, v_all) in enumerate(dense):
        want = dense_spec_attention(q[b, :ql[b]], k_all, v_all, spec)
        np.testing.assert_allclose(out[starts[b]:starts[b] + ql[b]], want, rtol=2e-5, atol=2e-5)
    # And against the kernels' jnp reference, on the pages with the new K/V written.
    pages = np.asarray(write_kv(jnp.asarray(kv_cache), packed(k_new)[None], packed(v_new)[None],
                                md.slot_mapping, layer=1))[1]
    tables = np.zeros((B, limits.max_blocks_per_seq), np.int32)
    tables[:, :bt.shape[1]] = bt
    ref = np.asarray(ragged_paged_attention_reference(
        packed(q), pages[0], pages[1], tables, nc + ql, md.query_start_loc[:B + 1], B,
        scale=spec.scale, soft_cap=spec.soft_cap, sliding_window=spec.sliding_window))
    real = slice(0, int(ql.sum()))
    np.testing.assert_allclose(out[real], ref[real], rtol=2e-5, atol=2e-5)
    if backend.writes_kv_per_layer:  # the new tokens' K/V are in the pool, nothing else moved
        want_pool = np.asarray(write_kv(jnp.asarray(kv_cache), packed(k_new)[None],
                                        packed(v_new)[None], md.slot_mapping, layer=1))
        np.testing.assert_array_equal(np.asarray(pool), want_pool)
    else:
        np.testing.assert_array_equal(np.asarray(pool), kv_cache)


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


def flat_attention(q, k_new, v_new, k_pages, v_pages, blocks, rows, lens, ql, scale):
    """The C++ kernel on padded rows `[B, Q]`, reading layer 1 of a 2-layer pool whose layer 0
    is poison."""
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


@pytest.mark.parametrize("mode", ["decode", "prefill", "chunk"])
def test_cpu_kernel_flat_block_list_equals_dense(mode):
    rng = np.random.default_rng(7)
    context_lens = [1, 15, 16, 17, 100, 40]
    query_lens = {"decode": [1] * 6, "prefill": context_lens, "chunk": [1, 7, 9, 1, 33, 2]}[mode]
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense = build_case(
        rng, context_lens, query_lens, 8)
    poison_unowned(k_pages, v_pages, bt, nc, 8)
    blocks, rows, lens = flat_blocks(bt, nc, 8, num_padding=5)
    out = np.asarray(flat_attention(q, k_new, v_new, k_pages, v_pages, blocks, rows, lens, ql,
                                    0.25))
    assert np.isfinite(out).all()
    for b, (k_all, v_all) in enumerate(dense):
        want = dense_attention(q[b, :ql[b]], k_all, v_all, 0.25)
        np.testing.assert_allclose(out[b, :ql[b]], want, rtol=1e-5, atol=1e-5)


def test_cpu_kernel_padding_rows_and_rows_without_context():
    # Row 1 has no cached tokens (a fresh prefill); row 3 is a padding row (no tokens at all).
    rng = np.random.default_rng(3)
    q, k_new, v_new, k_pages, v_pages, bt, nc, ql, dense = build_case(
        rng, [21, 4, 11], [1, 4, 2], 8)
    pad = lambda a: np.concatenate([a, np.zeros_like(a[:1])])
    blocks, rows, lens = flat_blocks(bt, nc, 8, num_padding=3)
    rows = np.where(rows == len(nc), len(nc) + 1, rows)  # padding entries name row B
    out = np.asarray(flat_attention(pad(q), pad(k_new), pad(v_new), k_pages, v_pages, blocks,
                                    rows, lens, pad(ql), 0.25))
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
        np.asarray(flat_attention(q, k_new, v_new, k_pages, v_pages, blocks, rows, lens, ql,
                                  0.25))


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
