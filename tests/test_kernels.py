"""Pallas kernels against their pure-jnp references (interpret mode on CPU), and CUDA lowering.

Inputs are fresh random draws (never zeros); pages are scattered through a shuffled pool. The
interpreter fills outputs with NaN before a kernel runs (poisoned), so any element a kernel
should write and does not fails the comparison; `test_unwritten_rows_stay_poisoned` checks that
the poison is in effect.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from jaxpaged.pallas_kernels.ragged_paged_attention import (
    BLOCK_Q, max_query_tiles, query_tiles, ragged_paged_attention,
    ragged_paged_attention_reference)

# The references jitted: one compilation per shape and option, where run eagerly each of their
# operations compiles for each shape.
STATIC = ("scale", "soft_cap", "sliding_window")
paged_reference = jax.jit(paged_attention_reference, static_argnames=STATIC)
ragged_reference = jax.jit(ragged_paged_attention_reference, static_argnames=STATIC)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# (q heads per KV head, head_dim, block_size, dtype): every ratio, head dim, block size and dtype
# appears, without the full cross product (each interpreted kernel takes seconds).
# Every group size, head size, block size and dtype at least once (each case an interpreted
# Pallas run of several seconds).
GRID = [(1, 64, 8, jnp.float32), (3, 128, 16, jnp.float32), (4, 64, 32, jnp.bfloat16),
        (8, 128, 8, jnp.bfloat16)]


def pool(rng, num_kv_heads, head_dim, block_size, num_blocks, dtype):
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return (jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.asarray(rng.standard_normal(shape), dtype))


def block_tables_for(rng, num_rows, max_blocks, num_blocks):
    return jnp.asarray(rng.permutation(num_blocks)[:num_rows * max_blocks]
                       .reshape(num_rows, max_blocks), jnp.int32)


def assert_close(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    rel = np.abs(out - ref).max() / np.abs(ref).max()
    assert rel <= TOL[dtype], rel


@pytest.mark.parametrize("group, head_dim, block_size, dtype", GRID)
def test_decode_kernel_matches_reference(group, head_dim, block_size, dtype):
    rng = np.random.default_rng(group * 1000 + head_dim + block_size)
    K, S = 2, block_size
    context_lens = [1, S - 1, S, S + 1, 7 * S + 3, 2]  # block boundaries, long beside short
    B, M = len(context_lens) + 1, 8  # one padded row (context 0)
    k_pages, v_pages = pool(rng, K, head_dim, S, B * M + 2, dtype)
    q = jnp.asarray(rng.standard_normal((B, K * group, head_dim)), dtype)
    bt = block_tables_for(rng, B, M, B * M + 2)
    cl = jnp.asarray(context_lens + [0], jnp.int32)
    kw = dict(scale=head_dim ** -0.5)
    ref = paged_reference(q, k_pages, v_pages, bt, cl, **kw)
    # The launch's tunables (`bench/gpu_e2e.py` sweeps them): splits, and keys per iteration
    # from one block to several (64 keys: 4 blocks of 16, 8 of 8; 3 blocks round down to 2).
    for k_splits, tokens_per_iter in ((1, None), (3, None), (1, 64), (2, 3 * S)):
        out = paged_attention(q, k_pages, v_pages, bt, cl, k_splits=k_splits, interpret=True,
                              tokens_per_iter=tokens_per_iter, **kw)
        assert_close(out[:-1], ref[:-1], dtype)
        np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)  # padded row


def ragged_case(rng, group, head_dim, block_size, dtype):
    """Decode rows, a fresh prefill, a chunk continuing a cached prefix; a padded row; pad tokens."""
    K, S = 2, block_size
    rows = [(S + 1, 1), (2 * S + 5, 2 * S + 5), (3 * S + 2, S - 1), (1, 1), (S, 1)]  # (ctx, q)
    B, M = len(rows) + 1, 8
    cu = np.concatenate([[0], np.cumsum([q for _, q in rows])])
    cu = np.concatenate([cu, [cu[-1]]]).astype(np.int32)  # the padded row has no tokens
    T = int(cu[-1]) + 5  # trailing pad tokens
    k_pages, v_pages = pool(rng, K, head_dim, S, B * M + 2, dtype)
    q = jnp.asarray(rng.standard_normal((T, K * group, head_dim)), dtype)
    bt = block_tables_for(rng, B, M, B * M + 2)
    cl = jnp.asarray([c for c, _ in rows] + [0], jnp.int32)
    return (q, k_pages, v_pages, bt, cl, jnp.asarray(cu), len(rows)), int(cu[-1])


@pytest.mark.parametrize("group, head_dim, block_size, dtype", GRID)
def test_ragged_kernel_matches_reference(group, head_dim, block_size, dtype):
    rng = np.random.default_rng(group * 1000 + head_dim + block_size + 1)
    args, num_real = ragged_case(rng, group, head_dim, block_size, dtype)
    kw = dict(scale=head_dim ** -0.5)
    out = ragged_paged_attention(*args, interpret=True, **kw)
    ref = ragged_reference(*args, **kw)
    assert_close(out[:num_real], ref[:num_real], dtype)


@pytest.mark.parametrize("soft_cap, sliding_window", [(5.0, None), (None, 19), (30.0, 40)])
def test_soft_cap_and_sliding_window(soft_cap, sliding_window):
    rng = np.random.default_rng(7)
    kw = dict(scale=0.125, soft_cap=soft_cap, sliding_window=sliding_window)
    args, num_real = ragged_case(rng, 3, 64, 16, jnp.float32)
    out = ragged_paged_attention(*args, interpret=True, **kw)
    assert_close(out[:num_real], ragged_reference(*args, **kw)[:num_real], jnp.float32)
    q, k_pages, v_pages, bt, cl = args[0][:6], *args[1:5]
    cl = cl.at[-1].set(90)
    out = paged_attention(q, k_pages, v_pages, bt, cl, k_splits=2, interpret=True, **kw)
    assert_close(out, paged_reference(q, k_pages, v_pages, bt, cl, **kw), jnp.float32)


def test_unwritten_rows_stay_poisoned():
    args, num_real = ragged_case(np.random.default_rng(3), 2, 64, 16, jnp.float32)
    out = np.asarray(ragged_paged_attention(*args, scale=0.125, interpret=True))
    assert np.isnan(out[num_real:]).all() and np.isfinite(out[:num_real]).all()


@pytest.mark.parametrize("block_size, soft_cap, sliding_window", [
    (8, None, None), (16, None, None), (8, 30.0, 13), (16, 20.0, 21)])
def test_packed_mix_with_padding_and_unused_rows(block_size, soft_cap, sliding_window):
    """vLLM v1's packed batch in one call: decodes, a fresh prefill over several tiles, chunks on
    a cached prefix (one exactly two tiles long); T padded past the real tokens; B larger than
    num_seqs, with the unused rows holding tokens and context that must be ignored."""
    rng = np.random.default_rng(block_size + (sliding_window or 0))
    K, group, H, S = 2, 2, 64, block_size
    rows = [(37, 1), (40, 40), (70, 21), (9, 1), (48, 2 * BLOCK_Q)]  # (context, new tokens)
    num_seqs, B, M = len(rows), len(rows) + 3, 10
    num_real = sum(q for _, q in rows)
    T = num_real + 17
    # The unused rows have tokens up to T and a context, to show they are ignored.
    cu = np.cumsum([0] + [q for _, q in rows] + [5, T - num_real - 5, 0]).astype(np.int32)
    cl = jnp.asarray([c for c, _ in rows] + [20, 30, 40], jnp.int32)
    k_pages, v_pages = pool(rng, K, H, S, B * M + 2, jnp.float32)
    q = jnp.asarray(rng.standard_normal((T, K * group, H)), jnp.float32)
    bt = block_tables_for(rng, B, M, B * M + 2)
    args = (q, k_pages, v_pages, bt, cl, jnp.asarray(cu))
    kw = dict(scale=H ** -0.5, soft_cap=soft_cap, sliding_window=sliding_window)
    out = np.asarray(ragged_paged_attention(*args, jnp.int32(num_seqs), interpret=True, **kw))
    ref = ragged_reference(*args, num_seqs, **kw)
    assert_close(out[:num_real], ref[:num_real], jnp.float32)
    assert np.isnan(out[num_real:]).all()  # padding and unused rows: no program wrote them
    if sliding_window is not None:  # the window really cuts: the output differs without it
        full = ragged_reference(*args, num_seqs, **{**kw, "sliding_window": None})
        assert np.abs(np.asarray(full[:num_real]) - out[:num_real]).max() > 1e-3


def cdiv(a, b):
    return -(-a // b)


def pallas_call_grids(fn, *args):
    """The grid of every pallas_call in fn's jaxpr (searched through nested jaxprs)."""
    from jax.extend.core import jaxprs_in_params

    grids = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                grids.append(tuple(eqn.params["grid_mapping"].grid))
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids


@pytest.mark.parametrize("T, B", [(256, 8), (8, 8), (64, 256), (1000, 3), (2048, 64)])
def test_ragged_grid_covers_query_tiles_not_rows_times_max_q_len(T, B):
    K, N, H, S, M, P = 2, 4, 64, 16, 16, 64
    f32, i32 = (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32),
                lambda *s: jax.ShapeDtypeStruct(s, jnp.int32))
    grids = pallas_call_grids(functools.partial(ragged_paged_attention, scale=0.125),
                              f32(T, N, H), f32(K, P, S, H), f32(K, P, S, H), i32(B, M), i32(B),
                              i32(B + 1), i32())
    # One program per possible query tile and KV head; the old grid was (B, K, cdiv(T, BLOCK_Q)).
    bound = min(T, (T + min(B, T) * (BLOCK_Q - 1)) // BLOCK_Q)
    assert grids == [(bound, K)] and bound == max_query_tiles(T, B)
    assert bound <= cdiv(T, BLOCK_Q) + B


# One compilation per shape, rather than one per operation and shape when run eagerly.
jitted_query_tiles = jax.jit(query_tiles, static_argnums=2)


def test_query_tiles_map_every_row_once_and_bound_is_tight():
    rng = np.random.default_rng(0)
    for _ in range(200):
        B, T = int(rng.integers(1, 12)), int(rng.integers(1, 200))
        num_seqs = int(rng.integers(0, B + 1))
        cuts = np.sort(rng.integers(0, T + 1, num_seqs))  # any split of up to T tokens
        cu = np.concatenate([[0], cuts, np.full(B - num_seqs, T)]).astype(np.int32)
        # One tile budget per B (the bound at the largest T): a compile per B, not per draw.
        G = max_query_tiles(200, B)
        seq, row0, n = map(np.asarray, jitted_query_tiles(jnp.asarray(cu), num_seqs, G))
        q_lens = np.diff(cu)[:num_seqs]
        assert n[0] == sum(cdiv(q, BLOCK_Q) for q in q_lens) <= max_query_tiles(T, B)
        covered = [cu[s] + r for s, r0 in zip(seq[:n[0]], row0[:n[0]])
                   for r in range(r0, min(r0 + BLOCK_Q, cu[s + 1] - cu[s]))]
        assert sorted(covered) == list(range(cu[num_seqs]))  # every real row, exactly once
        assert all(s < num_seqs and r0 < cu[s + 1] - cu[s]
                   for s, r0 in zip(seq[:n[0]], row0[:n[0]]))
    # Tight: min(B, T) - 1 one-token sequences and one holding the rest reach the bound.
    for T, B in [(256, 8), (8, 8), (64, 256), (1000, 3), (100, 8), (17, 2), (1, 1)]:
        n = min(B, T)
        q_lens = [1] * (n - 1) + [T - n + 1]
        assert sum(cdiv(q, BLOCK_Q) for q in q_lens) == max_query_tiles(T, B)


@pytest.mark.parametrize("call", [
    lambda q, kp, bt, cl: paged_attention(q[:, :5], kp, kp, bt, cl, scale=1.0, interpret=True),
    lambda q, kp, bt, cl: paged_attention(q, kp, kp, bt.astype(jnp.float32), cl, scale=1.0),
    lambda q, kp, bt, cl: paged_attention(q.astype(jnp.bfloat16), kp, kp, bt, cl, scale=1.0),
    lambda q, kp, bt, cl: paged_attention(q[..., :32], kp, kp, bt, cl, scale=1.0),
    lambda q, kp, bt, cl: ragged_paged_attention(q, kp, kp, bt, cl, jnp.zeros(3, jnp.int32), 1,
                                                 scale=1.0),
])
def test_bad_shapes_or_dtypes_raise_value_error_naming_them(call):
    q = jnp.ones((4, 6, 64), jnp.float32)
    kp = jnp.ones((2, 8, 16, 64), jnp.float32)
    bt, cl = jnp.zeros((4, 2), jnp.int32), jnp.ones((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"block_tables\(4, 2\)"):
        call(q, kp, bt, cl)


# -- CUDA lowering on this CPU machine ---------------------------------------------------------

def engine_kernel_configs():
    """(kernel, kwargs, arg shapes) for every configuration the engine's models call."""
    configs = []
    # (q heads, kv heads, head_dim): SmolLM2-135M, the tests' tiny Llama, a Llama-3-8B-like.
    for N, K, H in [(9, 3, 64), (4, 2, 16), (32, 8, 128)]:
        for dtype in (jnp.bfloat16, jnp.float32):
            S, B, M, T, P = 16, 8, 16, 256, 512
            pages = jax.ShapeDtypeStruct((K, P, S, H), dtype)
            i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
            configs.append((paged_attention, dict(scale=H ** -0.5, k_splits=1),
                            (jax.ShapeDtypeStruct((B, N, H), dtype), pages, pages, i32(B, M),
                             i32(B))))
            configs.append((ragged_paged_attention, dict(scale=H ** -0.5),
                            (jax.ShapeDtypeStruct((T, N, H), dtype), pages, pages, i32(B, M),
                             i32(B), i32(B + 1), i32())))
    return configs


@pytest.mark.parametrize("kernel, kwargs, shapes", engine_kernel_configs())
def test_kernels_lower_for_cuda(kernel, kwargs, shapes):
    from jax import export

    exported = export.export(
        jax.jit(functools.partial(kernel, **kwargs)), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*shapes)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_engine_greedy_ids_equal_between_pallas_interpret_and_xla(make_llm, tiny_model_dir):
    from jaxpaged import SamplingParams

    prompts = ["Hi", "a prompt of a few more words", "one two three four five six seven eight"]
    # 10 tokens: the first from the prompt, 8 in one multi-step call (`num_scheduler_steps`,
    # the decode kernel in a scan), the last alone.
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for backend in ("xla", "pallas-interpret"):
        llm = make_llm(tiny_model_dir, attention_backend=backend, max_model_len=64,
                       block_size=8)
        outputs[backend] = [o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.llm_engine.runner
        assert runner.num_multi_step_executables > 0
    assert outputs["pallas-interpret"] == outputs["xla"]
