"""The batched sampler: greedy rows, truncation sets, distributions, and per-row seeds."""

import numpy as np

from jaxpaged.sampler import SamplingMetadata, apply_top_k_top_p, sample_jit

V = 6
PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = np.log(PROBS).astype(np.float32)


def metadata(num, rows=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None,
             output_index=None):
    full = lambda v, dtype: np.broadcast_to(np.asarray(v, dtype), (num,)).copy()
    return SamplingMetadata(
        row=full(0 if rows is None else rows, np.int32), temperature=full(temperature, np.float32),
        top_k=full(top_k, np.int32), top_p=full(top_p, np.float32), min_p=full(min_p, np.float32),
        seeds=np.zeros((num, 2), np.uint32) if seeds is None else seeds,
        output_index=full(0 if output_index is None else output_index, np.int32))


def tokens_of(logits, md, all_greedy=False):
    return np.asarray(sample_jit(logits, md, all_greedy=all_greedy, num_logprobs=0).token_ids)


def draw(num, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    """`num` draws from LOGITS: num samples of the one row with distinct output indices."""
    md = metadata(num, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  seeds=np.tile([seed, 0], (num, 1)).astype(np.uint32),
                  output_index=np.arange(num))
    return np.bincount(tokens_of(LOGITS[None], md), minlength=V) / num


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 1000)).astype(np.float32)
    temperature = np.array([0, 1.0, 0, 0.5], np.float32)
    md = metadata(4, rows=np.arange(4), temperature=temperature)
    mixed = tokens_of(logits, md)
    greedy = tokens_of(logits, md, all_greedy=True)
    np.testing.assert_array_equal(greedy, logits.argmax(-1))
    np.testing.assert_array_equal(mixed[[0, 2]], logits.argmax(-1)[[0, 2]])


def test_frequencies_follow_softmax_of_logits_over_temperature():
    n = 20000
    np.testing.assert_allclose(draw(n), PROBS, atol=0.015)
    cooled = PROBS ** 2 / np.sum(PROBS ** 2)  # temperature 0.5 squares the probabilities
    np.testing.assert_allclose(draw(n, temperature=0.5), cooled, atol=0.015)


def test_top_k_and_top_p_keep_only_their_sets():
    n = 20000
    freq = draw(n, top_k=2)
    np.testing.assert_allclose(freq, np.r_[PROBS[:2] / PROBS[:2].sum(), [0] * 4], atol=0.015)
    # top_p=0.6: 0.4 < 0.6 so the second token is needed; the mass before the third is 0.65.
    freq = draw(n, top_p=0.6)
    np.testing.assert_allclose(freq, np.r_[PROBS[:2] / PROBS[:2].sum(), [0] * 4], atol=0.015)
    assert draw(2000, top_k=1)[0] == 1.0 and draw(2000, top_p=0.01)[0] == 1.0
    # min_p=0.3 keeps tokens with p >= 0.3 * 0.4 = 0.12: the first three.
    np.testing.assert_allclose(draw(n, min_p=0.3), np.r_[PROBS[:3] / PROBS[:3].sum(), [0] * 3],
                               atol=0.015)


def test_apply_top_k_top_p_masks_per_row():
    logits = np.tile(LOGITS, (3, 1))
    out = np.asarray(apply_top_k_top_p(logits, np.array([0, 3, 5], np.int32),
                                       np.array([0.75, 1.0, 0.7], np.float32)))
    kept = np.isfinite(out)
    assert kept.sum(-1).tolist() == [3, 3, 3]  # top-p 0.75: 0.4, 0.65 before the 3rd token
    np.testing.assert_array_equal(out[kept], np.tile(LOGITS[:3], 3))


def test_seeded_row_gives_the_same_token_in_any_batch_position():
    rng = np.random.default_rng(1)
    row = rng.standard_normal(500).astype(np.float32)

    def token_at(position, batch, seed=42, step=3):
        logits = rng.standard_normal((batch, 500)).astype(np.float32)
        logits[position] = row
        seeds = rng.integers(0, 2**32, (batch, 2)).astype(np.uint32)
        seeds[position] = (seed, 0)
        out_idx = rng.integers(0, 9, batch).astype(np.int32)
        out_idx[position] = step
        md = metadata(batch, rows=np.arange(batch), seeds=seeds, output_index=out_idx)
        return int(tokens_of(logits, md)[position])

    first = token_at(0, 1)
    assert all(token_at(p, b) == first for p, b in [(3, 4), (7, 8), (0, 8)])
    assert len({token_at(0, 1, step=s) for s in range(20)}) > 1  # steps draw fresh keys
