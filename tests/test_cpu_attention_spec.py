"""The C++ CPU kernel's sliding window and logit soft cap equal `ragged_paged_attention_reference`
(Mistral / Gemma 2 semantics as in transformers), in decodes, prefills, chunked prefills and a
packed mix of them; keys outside every window are never read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.pallas_kernels import PAD_SLOT_ID, cpu_attention, write_kv
from jaxpaged.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

POISON = 1e4  # pool slots no sequence owns, and the q/k/v rows of tokens of no sequence


@pytest.fixture(autouse=True)
def _needs_kernel():
    if not cpu_attention.available():
        pytest.skip("no C++ compiler")


def make_case(rng, cached, new, block_size, *, gaps=None, num_kv_heads=2, group=3, head_dim=64,
              window=None):
    """Random packed inputs for the kernel and the same sequences for the reference.

    Sequence b has `cached[b]` tokens in shuffled pool blocks and `new[b]` new tokens, packed on
    one token axis with `gaps[b]` padding tokens before it (and two after the last). The kernel's
    pool holds only the cached tokens (POISON elsewhere); with a window, the cached keys and
    values before the window of the sequence's first new token are NaN there, so reading one
    would show. The reference's pool holds every token, the new ones written with `write_kv`.
    """
    B, S, K, H = len(cached), block_size, num_kv_heads, head_dim
    N = K * group
    gaps = [0] * B if gaps is None else gaps
    ctx = [c + n for c, n in zip(cached, new)]
    num_blocks = [-(-c // S) for c in ctx]
    M = max(max(num_blocks), 1)
    P = sum(num_blocks) + 3
    perm = rng.permutation(P)
    tables = np.zeros((B, M), np.int32)
    for b, nb in enumerate(num_blocks):
        tables[b, :nb], perm = perm[:nb], perm[nb:]

    starts = np.cumsum([0] + [g + n for g, n in zip(gaps, new)])[:-1] + np.asarray(gaps)
    T = int(starts[-1] + new[-1] + 2)
    q = np.full((T, N, H), POISON, np.float32)
    k_new, v_new = (np.full((T, K, H), POISON, np.float32) for _ in range(2))
    k_pages, v_pages = (np.full((K, P, S, H), POISON, np.float32) for _ in range(2))
    slots = np.full(T, PAD_SLOT_ID, np.int32)
    for b in range(B):
        k_all = rng.standard_normal((ctx[b], K, H)).astype(np.float32)
        v_all = rng.standard_normal((ctx[b], K, H)).astype(np.float32)
        for pos in range(cached[b]):
            blk, off = tables[b, pos // S], pos % S
            k_pages[:, blk, off], v_pages[:, blk, off] = k_all[pos], v_all[pos]
        st, n = starts[b], new[b]
        q[st:st + n] = rng.standard_normal((n, N, H))
        k_new[st:st + n], v_new[st:st + n] = k_all[cached[b]:], v_all[cached[b]:]
        slots[st:st + n] = [tables[b, p // S] * S + p % S for p in range(cached[b], ctx[b])]

    blocks, rows, lens = [], [], []
    for b, c in enumerate(cached):
        for i in range(-(-c // S)):
            blocks.append(tables[b, i])
            rows.append(b)
            lens.append(min(S, c - i * S))
    blocks += [0] * 3  # padding entries: a valid block, row B, 0 tokens
    rows += [B] * 3
    lens += [0] * 3
    flat = tuple(np.array(x, np.int32) for x in (blocks, rows, lens))

    layer = np.stack([k_pages, v_pages])
    ref_pool = np.stack([np.full_like(layer, POISON), layer])  # layer 0 is poison
    ref_pool = np.asarray(write_kv(jnp.asarray(ref_pool), k_new[None], v_new[None], slots,
                                   layer=1))
    kernel_pool = np.stack([np.full_like(layer, POISON), layer])
    if window is not None:
        for b, c in enumerate(cached):
            for pos in range(max(0, c - window + 1)):  # before the first new token's window
                blk, off = tables[b, pos // S], pos % S
                kernel_pool[1, :, :, blk, off] = np.nan
    qsl = np.append(starts, T).astype(np.int32)
    return dict(q=q, k_new=k_new, v_new=v_new, kernel_pool=kernel_pool, ref_pool=ref_pool,
                qsl=qsl, ql=np.array(new, np.int32), flat=flat, tables=tables,
                ctx=np.array(ctx, np.int32), starts=starts, new=new)


def run_kernel(case, scale, **options):
    f = jax.jit(cpu_attention.paged_attention_cpu,
                static_argnames=("scale", "sliding_window", "soft_cap"))
    out, pool = f(case["q"], case["k_new"], case["v_new"], case["kernel_pool"], np.int32(1),
                  case["qsl"], case["ql"], *case["flat"], scale=scale, **options)
    np.testing.assert_array_equal(pool, case["kernel_pool"])  # aliased, untouched
    return np.asarray(out)


def run_reference(case, scale, **options):
    """The reference on the same sequences packed without gaps (its cu_q_lens)."""
    new, starts = case["new"], case["starts"]
    q = np.concatenate([case["q"][st:st + n] for st, n in zip(starts, new)])
    cu = np.cumsum([0] + list(new)).astype(np.int32)
    pool = case["ref_pool"][1]
    out = ragged_paged_attention_reference(q, pool[0], pool[1], case["tables"], case["ctx"], cu,
                                           len(new), scale=scale, **options)
    return np.asarray(out), cu


def check(case, head_dim, **options):
    scale = head_dim ** -0.5
    out = run_kernel(case, scale, **options)
    want, cu = run_reference(case, scale, **options)
    assert np.isfinite(out).all()
    real = np.zeros(len(out), bool)
    for b, (st, n) in enumerate(zip(case["starts"], case["new"])):
        real[st:st + n] = True
        np.testing.assert_allclose(out[st:st + n], want[cu[b]:cu[b] + n], rtol=1e-5, atol=1e-5,
                                   err_msg=f"sequence {b}")
    assert (out[~real] == 0).all()


# Context lengths around block boundaries (8, 16) and longer than the windows; chunks past the
# kernel's 32-token query chunk, so a sequence spans several tasks with different windows.
MODES = {
    "decode": ([30, 47, 5, 64, 100, 1], [1, 1, 1, 1, 1, 1]),
    "prefill": ([0, 0, 0, 0], [70, 45, 3, 21]),
    "chunk": ([30, 47, 64, 9, 16], [12, 40, 33, 7, 70]),
    "mix": ([0, 30, 51, 0, 17, 64, 100], [1 + 49, 1, 1, 4, 23, 40, 1]),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [1, 5, 13, 20, 37])
def test_sliding_window_equals_reference(mode, block_size, window):
    rng = np.random.default_rng(block_size * 100 + window)
    cached, new = MODES[mode]
    gaps = [0, 2, 0, 3, 1, 0, 1][:len(new)] if mode == "mix" else None
    case = make_case(rng, cached, new, block_size, gaps=gaps, window=window)
    check(case, 64, sliding_window=window)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("options", [
    dict(),
    dict(soft_cap=1.5),
    dict(soft_cap=50.0),
    dict(sliding_window=13, soft_cap=1.5),
    dict(sliding_window=37, soft_cap=50.0),
    dict(sliding_window=1000),  # longer than every context: no window
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "neither")
def test_soft_cap_and_window_on_a_packed_mix(head_dim, options):
    # Head sizes 64 and 128 take the compiled-size code (transposed tiles for 8+ rows), 16 the
    # generic one; block size 16 puts whole kTile tiles in one block.
    rng = np.random.default_rng(head_dim)
    cached, new = MODES["mix"]
    case = make_case(rng, cached, new, 16, gaps=[0, 2, 0, 3, 1, 0, 1], head_dim=head_dim,
                     window=options.get("sliding_window"))
    check(case, head_dim, **options)


def test_soft_cap_changes_the_output():
    # Guards against an option that silently does nothing: a cap well below the scores.
    rng = np.random.default_rng(5)
    case = make_case(rng, [40], [3], 8)
    scale = 64 ** -0.5
    plain = run_kernel(case, scale)
    capped = run_kernel(case, scale, soft_cap=0.5)
    assert np.abs(plain - capped).max() > 1e-2
    check(case, 64, soft_cap=0.5)


def test_window_of_everything_equals_no_window():
    rng = np.random.default_rng(6)
    case = make_case(rng, [30, 0, 47], [1, 20, 9], 8)
    scale = 64 ** -0.5
    np.testing.assert_allclose(run_kernel(case, scale, sliding_window=56),
                               run_kernel(case, scale), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("options", [dict(sliding_window=0), dict(sliding_window=-3),
                                     dict(soft_cap=0.0), dict(soft_cap=-1.0)])
def test_rejects_bad_options(options):
    rng = np.random.default_rng(0)
    case = make_case(rng, [9], [1], 8)
    with pytest.raises(ValueError):
        run_kernel(case, 0.125, **options)
