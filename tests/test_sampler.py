"""The batched sampler: greedy rows, truncation sets against a sort-based reference, draws
against the exact distribution (chi-square), and per-row seeds."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st
from scipy import stats

from jaxpaged.sample.sampler import (SamplingMetadata, TOP_P_CANDIDATES, gather_rows, num_candidates,
                              sample_jit, top_k_top_p_cutoff)

# Jitted as the sampler runs it: one compile per (V, num_candidates), where op-by-op dispatch of
# its bisection took most of a property test's time.
cutoff_jit = jax.jit(top_k_top_p_cutoff, static_argnums=3)

V = 6
PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = np.log(PROBS).astype(np.float32)


def metadata(num, vocab_size=V, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
             seeds=None, output_index=None):
    full = lambda v, dtype: np.broadcast_to(np.asarray(v, dtype), (num,)).copy()
    top_k, top_p = full(top_k, np.int32), full(top_p, np.float32)
    return SamplingMetadata(
        temperature=full(temperature, np.float32),
        top_k=top_k, top_p=top_p, min_p=full(min_p, np.float32) if np.any(min_p) else None,
        seeds=np.zeros((num, 2), np.uint32) if seeds is None else seeds,
        output_index=full(0 if output_index is None else output_index, np.int32),
        num_candidates=num_candidates(top_k, top_p, vocab_size))


def tokens_of(logits, md, rows=None, all_greedy=False):
    """Sample i draws from logits row rows[i] (default: row 0 for every sample)."""
    rows = np.zeros(len(md.temperature), np.int32) if rows is None else rows
    return np.asarray(sample_jit(gather_rows(logits, rows), md, all_greedy=all_greedy,
                                 num_logprobs=0).token_ids)


def draw_counts(logits, num, seed=1, **params):
    """Token counts of `num` seeded draws from the one row `logits` (distinct output indices)."""
    md = metadata(num, len(logits), seeds=np.tile([seed, 0], (num, 1)).astype(np.uint32),
                  output_index=np.arange(num), **params)
    return np.bincount(tokens_of(np.asarray(logits, np.float32)[None], md),
                       minlength=len(logits))


def reference_kept(x, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's truncation by a full sort, in float64: (bool[V] kept, the distance from top_p of
    the nearest cumulative mass, for skipping examples that rounding could decide)."""
    x = np.asarray(x, np.float64)
    if min_p:
        probs = np.exp(x - x.max())
        x = np.where(probs >= min_p * probs.max(), x, -np.inf)
    desc = np.sort(x)[::-1]
    k = top_k if 0 < top_k < len(x) else len(x)
    desc = desc[:k]
    probs = np.exp(desc - desc[0])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    num_kept = k if top_p >= 1 else int(np.sum(before < top_p))
    margin = np.inf if top_p >= 1 else np.min(np.abs(before - top_p))
    return (x >= desc[num_kept - 1]) & (x > -np.inf), margin


def kept_by(x, cutoff):
    """The tokens a row keeps under its cutoff (f32[1]): at or above it, and not masked."""
    return (x >= np.asarray(cutoff)[0]) & (x > -np.inf)


def reference_probs(x, **params):
    kept, _ = reference_kept(x, **params)
    probs = np.where(kept, np.exp(np.asarray(x, np.float64) - np.max(x)), 0.0)
    return probs / probs.sum()


def assert_follows(counts, probs, min_pvalue=1e-4):
    """Chi-square goodness of fit (fixed seeds, so the test is deterministic); no draws outside
    the support."""
    support = probs > 0
    assert counts[~support].sum() == 0, np.nonzero(counts * ~support)
    result = stats.chisquare(counts[support], probs[support] * counts.sum())
    assert result.pvalue > min_pvalue, result


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 1000)).astype(np.float32)
    temperature = np.array([0, 1.0, 0, 0.5], np.float32)
    md = metadata(4, 1000, temperature=temperature, top_p=0.9)
    mixed = tokens_of(logits, md, np.arange(4))
    greedy = tokens_of(logits, md, np.arange(4), all_greedy=True)
    np.testing.assert_array_equal(greedy, logits.argmax(-1))
    np.testing.assert_array_equal(mixed[[0, 2]], logits.argmax(-1)[[0, 2]])


@pytest.mark.parametrize("params", [
    {}, {"temperature": 0.5}, {"temperature": 1.7}, {"top_k": 2}, {"top_p": 0.6},
    {"min_p": 0.3}, {"top_k": 3, "top_p": 0.6}, {"top_k": 4, "top_p": 0.9, "min_p": 0.2}])
def test_draws_follow_the_truncated_softmax(params):
    temperature = params.get("temperature", 1.0)
    truncation = {k: v for k, v in params.items() if k != "temperature"}
    assert_follows(draw_counts(LOGITS, 20000, **params),
                   reference_probs(LOGITS / temperature, **truncation))


@pytest.mark.parametrize("params", [{}, {"top_p": 0.9}, {"top_k": 300, "top_p": 0.95}])
def test_draws_over_a_large_vocabulary(params):
    """Several inverse-CDF blocks; top_p 0.9 of a flat row holds more tokens than the
    TOP_P_CANDIDATES candidates, so its cutoff comes from the bisection."""
    logits = np.random.default_rng(3).standard_normal(1000).astype(np.float32) * 0.5
    probs = reference_probs(logits, **params)
    if params == {"top_p": 0.9}:
        assert np.count_nonzero(probs) > TOP_P_CANDIDATES
    assert_follows(draw_counts(logits, 60000, seed=5, **params), probs)


def test_edge_settings_keep_the_reference_sets():
    x = np.array([2.0, 1.0, 1.0, 1.0, 0.5, -1.0, -np.inf, 3.0], np.float32)
    V = len(x)
    for top_k, top_p in [(1, 1.0), (V, 1.0), (V + 5, 1.0), (-1, 1.0), (2, 1.0), (0, 1e-6),
                         (0, 1.0), (3, 0.999), (0, 0.7), (5, 1e-6)]:
        cutoff = cutoff_jit(x[None], np.array([top_k], np.int32),
                            np.array([top_p], np.float32),
                            max(1, num_candidates([top_k], [top_p], V)))
        kept, _ = reference_kept(x, top_k, top_p)
        np.testing.assert_array_equal(kept_by(x, cutoff), kept, str((top_k, top_p)))
    # top_p 1 with top-k keeps all k even where float32 sums of the masses round to 1.
    x2 = np.r_[np.random.default_rng(7).normal(size=7) * 0.01, [-20.0, -20.0]].astype(np.float32)
    cutoff = cutoff_jit(x2[None], np.array([8], np.int32), np.ones(1, np.float32), 9)
    assert kept_by(x2, cutoff).all()
    # Ties at the cut stay: top_k 2 keeps 3.0, 2.0; top_k 3 keeps all three 1.0s as well.
    assert draw_counts(x, 4000, top_k=3)[[1, 2, 3]].min() > 0


def test_min_p_edges_keep_the_reference_sets():
    """min_p 1 keeps the most likely tokens (ties included), a tiny min_p keeps all; with
    top-k and top-p on what min-p leaves."""
    x = np.array([2.0, 0.5, 2.0, 1.5, 1.0, 0.0], np.float32)
    for params in [{"min_p": 1.0}, {"min_p": 0.5}, {"min_p": 1e-6}, {"min_p": 0.3, "top_k": 2},
                   {"min_p": 0.3, "top_p": 0.5}]:
        drawn = draw_counts(x, 3000, **params) > 0
        np.testing.assert_array_equal(drawn, reference_kept(x, **params)[0], str(params))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_cutoff_equals_the_sort_reference(data):
    V = data.draw(st.sampled_from([2, 3, 5, 8, 13, 31, 64, 80]))  # each (V, C) is a compile
    values = st.one_of(st.integers(-3, 3).map(float),  # ties
                       st.floats(-8, 8, allow_nan=False, allow_subnormal=False))
    x = np.array(data.draw(st.lists(values, min_size=V, max_size=V)), np.float32)
    top_k = data.draw(st.one_of(st.just(0), st.integers(-1, V + 3)))
    top_p = data.draw(st.one_of(st.just(1.0), st.floats(1e-4, 1.0)))
    kept, margin = reference_kept(x, top_k, top_p)
    assume(margin > 1e-5)  # float32 rounding may decide a mass this close to top_p
    # Any candidate count that covers top-k: small ones send top-p rows to the bisection.
    least = top_k if 0 < top_k < V else 1
    C = data.draw(st.sampled_from([c for c in (1, 2, 4, 8, 16, 32, 64, 128) if least <= c <= V]
                                  or [V]))
    cutoff = cutoff_jit(x[None], np.array([top_k], np.int32),
                        np.array([top_p], np.float32), C)
    np.testing.assert_array_equal(kept_by(x, cutoff), kept)


@pytest.mark.parametrize("params", [{}, {"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.1}])
def test_a_row_with_every_token_masked_gets_the_greedy_token(params):
    """allowed_token_ids=[0] with min_tokens masking stop token 0 masks the whole row: the
    sampled row answers token 0, as the greedy argmax does, never an out-of-range id."""
    R, vocab = 4, 300
    logits = np.random.default_rng(0).standard_normal((R, vocab)).astype(np.float32)
    md = dataclasses.replace(metadata(R, vocab, seeds=np.arange(2 * R, dtype=np.uint32)
                                      .reshape(R, 2), **params),
                             logit_bias=np.full((R, vocab), -np.inf, np.float32))
    np.testing.assert_array_equal(tokens_of(logits, md, np.arange(R)), np.zeros(R))


def test_num_candidates_covers_each_row():
    assert num_candidates([0, -1], [1.0, 1.0], 1000) == 0
    assert num_candidates([50], [1.0], 1000) == 64
    assert num_candidates([0], [0.95], 1000) == TOP_P_CANDIDATES
    assert num_candidates([700, 0], [1.0, 0.5], 1000) == 1000
    assert num_candidates([1000], [1.0], 1000) == 0  # top_k >= V is no truncation


def test_seeded_row_gives_the_same_token_in_any_batch_position():
    rng = np.random.default_rng(1)
    row = rng.standard_normal(500).astype(np.float32)

    def token_at(position, batch, seed=42, step=3, top_p=1.0):
        logits = rng.standard_normal((batch, 500)).astype(np.float32)
        logits[position] = row
        seeds = rng.integers(0, 2**32, (batch, 2)).astype(np.uint32)
        seeds[position] = (seed, 0)
        out_idx = rng.integers(0, 9, batch).astype(np.int32)
        out_idx[position] = step
        md = metadata(batch, 500, seeds=seeds, output_index=out_idx, top_p=top_p)
        return int(tokens_of(logits, md, np.arange(batch))[position])

    for top_p in (1.0, 0.8):
        first = token_at(0, 1, top_p=top_p)
        assert all(token_at(p, b, top_p=top_p) == first for p, b in [(3, 4), (7, 8), (0, 8)])
    assert len({token_at(0, 1, step=s) for s in range(20)}) > 1  # steps draw fresh keys
