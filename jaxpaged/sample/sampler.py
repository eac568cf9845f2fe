"""The batched sampler: one jitted function, per-sample parameters, per-sample random keys.

A batch may mix greedy and sampled rows, any temperature / top-k / top-p / min-p, penalties and
logit biases without recompiling per mix: per-sample parameters are arrays. Features no sample of
the step uses are left out of the arrays (`None`), which picks a smaller compiled variant.

A sample's random key is `fold_in(fold_in(key(seed_lo), seed_hi), output_index)`, so a seeded
request draws the same tokens whatever else shares its batch. The sampler takes one logits row
per sample, gathered from the step's rows by `gather_rows` (several samples may draw from one
row: the n completions of a prompt right after its prefill, each with its own seed), so its
compiled variants depend on the sample count R alone, not on the step's shape.

Order of processing (vLLM's): logit bias and token masks, then repetition / frequency / presence
penalties, then temperature, min-p, top-k and top-p. Returned log-probabilities are those of the
raw model logits (before any of these), or, for samples whose `logprobs_mode` is "processed",
of the distribution after all of them (-inf for the tokens they remove), the one the token is
drawn from; `token_logprobs` scores given tokens under the same processing.

Nothing sorts the vocabulary. Truncation reduces to one cutoff logit per row (the row keeps
every token at or above it): top-k and top-p read it off a `lax.top_k` candidate set of the
`num_candidates` largest logits, and a row whose top-p nucleus is larger than that set finds it
by bisection over the float values (`_nucleus_cutoff`), both exact. The token is then drawn by
inverse transform sampling over the kept tokens in vocabulary order, with one uniform number per
sample (`_inverse_cdf`), as FlashInfer's and vLLM's sampling kernels avoid sorting; a Gumbel-max
draw would need V random numbers per sample, several times the cost of the rest of the sampler
on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.worker.buckets import next_power_of_2

# Candidates taken for a top-p row when no top-k bounds it; its nucleus is found by bisection
# when these do not hold it.
TOP_P_CANDIDATES = 256
# Block length of the two-level inverse CDF: block masses, then one block's tokens.
_CDF_BLOCK = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-sample arrays (R samples, V vocabulary); optional fields are None when unused."""

    temperature: jax.Array  # f32[R]; 0 is greedy
    top_k: jax.Array  # i32[R]; <= 0 keeps all
    top_p: jax.Array  # f32[R] in (0, 1]
    seeds: jax.Array  # u32[R, 2] low and high 32 bits of each sample's seed
    output_index: jax.Array  # i32[R] tokens generated before this one
    min_p: jax.Array | None = None  # f32[R] in [0, 1]
    logit_bias: jax.Array | None = None  # f32[R, V] added to the logits; -inf masks a token
    # i32[R, ceil(V / 32)]: bit t % 32 of word t // 32 set where token t is allowed (structured
    # outputs' grammars, `jaxpaged.sample.structured_outputs`)
    token_bitmask: jax.Array | None = None
    output_counts: jax.Array | None = None  # i32[R, V] occurrences in the output so far
    prompt_mask: jax.Array | None = None  # bool[R, V] token occurs in the prompt
    repetition_penalty: jax.Array | None = None  # f32[R]
    frequency_penalty: jax.Array | None = None  # f32[R]
    presence_penalty: jax.Array | None = None  # f32[R]
    # bool[R]: the sample's log-probabilities are those of the processed distribution it is
    # drawn from (`SamplingParams.logprobs_mode` "processed"); None when no sample asks.
    processed_logprobs: jax.Array | None = None
    # Static: the top-k candidate set size C (`num_candidates`); 0 when no sample truncates.
    num_candidates: int = dataclasses.field(default=0, metadata=dict(static=True))


@dataclasses.dataclass
class SampledToken:
    """One draw of one row, on the host (what the scheduler appends)."""

    token_id: int
    logprob: float  # raw model log-probability of the token
    rank: int  # 1-based rank under the raw distribution
    # (token id, log-probability) of the `logprobs` most likely tokens, most likely first; empty
    # for logprobs=0 (only the sampled token's), None when the request asked for none
    top: list[tuple[int, float]] | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R] raw log-probability of each sampled token
    ranks: jax.Array  # i32[R] 1-based rank of each sampled token under the raw distribution
    top_ids: jax.Array | None  # i32[R, k] most likely tokens, when logprobs were asked for
    top_logprobs: jax.Array | None  # f32[R, k]


def num_candidates(top_ks, top_ps, vocab_size: int) -> int:
    """The candidate set size C for a step's sampled rows: 0 when none truncates by top-k or
    top-p, else a power of two (capped at V) covering every row's top-k and, for top-p rows
    with no top-k, `TOP_P_CANDIDATES`. Powers of two keep the compiled variants few."""
    need = 0
    for k, p in zip(top_ks, top_ps):
        if 0 < k < vocab_size:
            need = max(need, int(k))
        elif p < 1:
            need = max(need, TOP_P_CANDIDATES)
    return 0 if need == 0 else min(vocab_size, next_power_of_2(need))


def _sample_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
    return jax.random.fold_in(key, step)


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Repetition penalty (HF `RepetitionPenaltyLogitsProcessor`: divide positive logits, multiply
    negative ones, for tokens seen in prompt or output), then frequency and presence penalties
    (OpenAI semantics, output tokens only)."""
    counts = md.output_counts
    seen = md.prompt_mask | (counts > 0)
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - md.frequency_penalty[:, None] * counts
            - md.presence_penalty[:, None] * (counts > 0))


def _sortable(x: jax.Array) -> jax.Array:
    """i32 keys ordered as the f32 values x (no NaNs): the bits, magnitude flipped if negative."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _from_sortable(key: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ jnp.int32(0x7FFFFFFF), key),
                                        jnp.float32)


def _nucleus_cutoff(x: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[R] the smallest logit v of each row such that the tokens above v (strictly) hold less
    than top_p of the probability: the top-p cutoff, for rows with no top-k.

    Bisection over the float values' ordered bit patterns: the mass above t only changes at a
    logit, so the least t at which it falls below top_p is that logit; 32 halvings of the i32
    range find it exactly, each one masked sum over the row.
    """
    lo = jnp.full(top_p.shape, _sortable(jnp.float32(jnp.finfo(jnp.float32).min)))
    hi = _sortable(jnp.max(x, axis=-1))  # nothing lies above the row's maximum

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        above = jnp.sum(jnp.where(x > _from_sortable(mid)[:, None], probs, 0.0), axis=-1)
        fits = above < top_p
        return jnp.where(fits, lo, mid + 1), jnp.where(fits, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return _from_sortable(hi)


def top_k_top_p_cutoff(x: jax.Array, top_k: jax.Array, top_p: jax.Array,
                       num_candidates: int) -> jax.Array:
    """Each row's truncation cutoff: the row keeps exactly the logits >= its cutoff.

    The kept set is vLLM's: the top-k logits, then, with probabilities renormalized over them,
    the smallest set of most likely tokens whose probability reaches top_p (a token is kept
    while the mass before it is below top_p, so the most likely one always is); tokens tied
    with the last kept one are kept too.

    Args:
      x: f32[R, V] logits (already divided by temperature); -inf marks masked tokens.
      top_k: i32[R]; <= 0 or >= V keeps all.
      top_p: f32[R] in (0, 1]; 1 keeps all.
      num_candidates: static C >= every row's top-k below V (`num_candidates`).

    Returns:
      f32[R]: -inf for rows that keep everything.
    """
    R, V = x.shape
    C = num_candidates
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    # [R, C] high to low: the first C of a descending sort. The barrier keeps XLA from folding
    # later slices of `vals` into the top-k, which turns it back into a full sort on CPU.
    vals = jax.lax.optimization_barrier(jax.lax.top_k(x, C)[0])
    row_max = vals[:, :1]
    in_k = jnp.arange(C)[None, :] < k[:, None]
    exp_c = jnp.where(in_k, jnp.exp(vals - row_max), 0.0)
    full = jnp.exp(x - row_max)
    total = jnp.where(k <= C, jnp.sum(exp_c, axis=-1), jnp.sum(full, axis=-1))
    probs = exp_c / total[:, None]
    mass = jnp.cumsum(probs, axis=-1)
    in_p = (mass - probs < top_p[:, None]) | (top_p[:, None] >= 1)  # rounding can reach 1
    num_kept = jnp.sum(in_k & in_p, axis=-1)
    cutoff = jnp.take_along_axis(vals, (num_kept - 1)[:, None], axis=-1)[:, 0]
    # A row without top-k whose C candidates hold less than top_p: its nucleus reaches further.
    beyond = (k > C) & (top_p < 1) & (mass[:, -1] < top_p)
    cutoff = jax.lax.cond(
        jnp.any(beyond),
        lambda: jnp.where(beyond, _nucleus_cutoff(x, full / total[:, None], top_p), cutoff),
        lambda: cutoff)
    return jnp.where((k > C) & (top_p >= 1), -jnp.inf, cutoff)


def _first_true(mask: jax.Array) -> jax.Array:
    """i32[R] the first index where mask is set, or the row length when none is."""
    index = jnp.arange(mask.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(mask, index, mask.shape[-1]), axis=-1)


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """i32[R] one draw per row from f32[R, V] non-negative weights (not all 0), by the uniform
    u f32[R] in [0, 1): the token whose cumulative weight interval, in vocabulary order, holds
    u * total. Block masses first, then a prefix sum inside one block of `_CDF_BLOCK`."""
    R, V = weights.shape
    nb = -(-V // _CDF_BLOCK)
    w = jnp.pad(weights, ((0, 0), (0, nb * _CDF_BLOCK - V))).reshape(R, nb, _CDF_BLOCK)
    block_mass = jnp.sum(w, axis=-1)
    cum_blocks = jnp.cumsum(block_mass, axis=-1)
    target = u * cum_blocks[:, -1]

    def pick(cum, mass, t):
        # The interval holding t; rounding can leave t past the last sum: then the last token
        # of positive weight.
        first = _first_true(cum > t[:, None])
        last = mass.shape[-1] - 1 - _first_true(jnp.flip(mass > 0, axis=-1))
        return jnp.where(first < mass.shape[-1], first, last)

    b = pick(cum_blocks, block_mass, target)
    within = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]
    before = jnp.take_along_axis(cum_blocks - block_mass, b[:, None], axis=-1)[:, 0]
    i = pick(jnp.cumsum(within, axis=-1), within, target - before)
    return b * _CDF_BLOCK + i


def argmax(x: jax.Array) -> jax.Array:
    """i32[R] index of each row's largest value (the first, on ties), as `jnp.argmax`.

    A max, then the least index holding it: two plain reductions, which XLA's CPU backend
    vectorizes; `jnp.argmax` lowers to a (value, index) pair reduction that it does not (4x
    slower over a [46, 49152] logits array here).
    """
    return _first_true(x == jnp.max(x, axis=-1, keepdims=True))


def _logprob_stats(raw: jax.Array, tokens: jax.Array, num_logprobs: int):
    """Raw log-probability and 1-based rank of `tokens` (i32[R]) in each row of raw f32[R, V],
    and the rows' top `num_logprobs`; from one logsumexp, without a [R, V] log_softmax."""
    lse = jax.nn.logsumexp(raw, axis=-1)
    token_logits = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(raw > token_logits[:, None], axis=-1).astype(jnp.int32)
    top_ids = top_logprobs = None
    if num_logprobs:
        top_logits, top_ids = jax.lax.top_k(raw, num_logprobs)
        top_logprobs = top_logits - lse[:, None]
    return token_logits - lse, ranks, top_ids, top_logprobs


def sample(logits: jax.Array, md: SamplingMetadata, *, all_greedy: bool,
           num_logprobs: int) -> SamplerOutput:
    """Draws one token per sample.

    Args:
      logits: f32[R, V] next-token logits, one row per sample (`gather_rows`).
      md: per-sample arrays.
      all_greedy: static; True skips truncation and drawing.
      num_logprobs: static; k of the top-k log-probabilities returned (0: none).

    Returns:
      `SamplerOutput` with i32[R] token ids and their raw log-probabilities.
    """
    x = logits if md.logit_bias is None else logits + md.logit_bias
    if md.token_bitmask is not None:
        x = jnp.where(unpack_bitmask(md.token_bitmask, x.shape[-1]), x, -jnp.inf)
    if md.output_counts is not None:
        x = apply_penalties(x, md)
    if all_greedy:
        tokens = argmax(x)
    else:
        x = processed_logits(x, md.temperature, md.top_k, md.top_p, md.num_candidates,
                             md.min_p)
        # Truncation keeps each row's maximum: the greedy rows' argmax (their x is unscaled).
        row_max = jnp.max(x, axis=-1, keepdims=True)
        tokens = _first_true(x == row_max)
        keys = jax.vmap(_sample_key)(md.seeds, md.output_index)
        u = jax.vmap(lambda key: jax.random.uniform(key, ()))(keys)
        drawn = _inverse_cdf(jnp.exp(x - row_max), u)
        # A row with every token masked (logit bias and min_tokens together can do that) has
        # nothing to draw from: it takes the greedy path's token, as a greedy row would.
        tokens = jnp.where((md.temperature > 0) & jnp.isfinite(row_max[:, 0]), drawn, tokens)
    stats = _logprob_stats(logits, tokens, num_logprobs)
    if md.processed_logprobs is not None:
        processed = _logprob_stats(x, tokens, num_logprobs)
        pick = md.processed_logprobs
        stats = [None if raw is None else
                 jnp.where(pick.reshape(-1, *(1,) * (raw.ndim - 1)), new, raw)
                 for raw, new in zip(stats, processed)]
    return SamplerOutput(tokens, *stats)


sample_jit = jax.jit(sample, static_argnames=("all_greedy", "num_logprobs"))


def greedy_draw(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(i32[R] each row's `argmax`, f32[R] its raw log-probability) for logits f32[R, V]: what
    `sample(all_greedy=True, num_logprobs=0)` draws for rows with no bias, penalty or grammar,
    computed by the model step itself (`ModelRunner`), so that plain greedy decoding makes no
    sampler call."""
    tokens = argmax(logits)
    return tokens, _logprob_stats(logits, tokens, 0)[0]


def pick_greedy(greedy: tuple[np.ndarray, np.ndarray], rows: list[int]) -> SamplerOutput:
    """`SamplerOutput` (token ids i32[n], logprobs f32[n], ranks i32[n], no top-k) of the n
    samples drawing from logits rows `rows`, from `greedy_draw`'s arrays (i32[R], f32[R]) on
    the host: an argmax has rank 1 under the distribution it is drawn from."""
    tokens, logprobs = greedy
    return SamplerOutput(tokens[rows], logprobs[rows], np.ones((len(rows),), np.int32), None,
                         None)


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """bool[R, V] from i32[R, ceil(V / 32)] (token t: bit t % 32 of word t // 32)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


@jax.jit
def gather_rows(logits: jax.Array, rows: jax.Array) -> jax.Array:
    """f32[R, V]: row rows[i] of the step's logits f32[B, V] for each sample i (i32[R])."""
    return logits[rows]


def precompile_inputs(vocab_size: int, sample_counts: list[int],
                      sharding: jax.sharding.Sharding | None = None
                      ) -> list[tuple[jax.ShapeDtypeStruct, SamplingMetadata, bool]]:
    """(logits' shape, metadata, all_greedy) of the variants worth compiling ahead of time: greedy
    and temperature-only (no top-k, top-p or min-p: the default `SamplingParams`) for each
    padded sample count R in `sample_counts`, logits laid out as `sharding` (None: on the
    default device)."""
    out = []
    for all_greedy in (True, False):
        for R in sample_counts:
            zeros = np.zeros((R,), np.int32)
            md = SamplingMetadata(temperature=np.ones((R,), np.float32), top_k=zeros,
                                  top_p=np.ones((R,), np.float32),
                                  seeds=np.zeros((R, 2), np.uint32), output_index=zeros)
            logits = jax.ShapeDtypeStruct((R, vocab_size), jnp.float32, sharding=sharding)
            out.append((logits, md, all_greedy))
    return out


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def prompt_logprobs(logits: jax.Array, input_ids: jax.Array, last: jax.Array, *,
                    num_logprobs: int):
    """Log-probabilities of each prompt token given the ones before it, from a packed step.

    Args:
      logits: f32[T, V] logits at every token of the step.
      input_ids: i32[T] the step's tokens; token t predicts token t + 1 (of the same sequence,
        for every token but a sequence's last).
      last: i32[S] each sequence's last token.
      num_logprobs: static top-k (0: none).

    Returns:
      (f32[S, V] logits at each sequence's last token, target logprobs f32[T], their ranks
      i32[T], top ids i32[T, k] or None, top logprobs f32[T, k] or None).
    """
    target = jnp.concatenate([input_ids[1:], jnp.zeros_like(input_ids[:1])])
    return (logits[last], *_logprob_stats(logits, target, num_logprobs))


def processed_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array, num_candidates: int,
                     min_p: jax.Array | None = None) -> jax.Array:
    """f32[R, V] the distribution `sample` draws from, from its (biased, penalized) logits:
    divided by temperature (1 where it is 0: greedy rows, which keep every token: the engine
    gives them no top-k, top-p or min-p), then -inf below min-p (f32[R], or None) and outside
    each row's top-k / top-p set (`num_candidates` static, `top_k_top_p_cutoff`)."""
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if min_p is not None:  # p >= min_p * p_max, as exp(x - max) >= min_p
        row_max = jnp.max(x, axis=-1, keepdims=True)
        x = jnp.where(jnp.exp(x - row_max) >= min_p[:, None], x, -jnp.inf)
    if num_candidates:
        cutoff = top_k_top_p_cutoff(x, top_k, top_p, num_candidates)
        x = jnp.where(x >= cutoff[:, None], x, -jnp.inf)
    return x


@functools.partial(jax.jit, static_argnames=("num_candidates",))
def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: jax.Array,
                   top_k: jax.Array, top_p: jax.Array, *, num_candidates: int) -> jax.Array:
    """f32[T] the log-probability of targets i32[T] under each row of f32[T, V] logits, after
    temperature (f32[T]) and top-k / top-p (i32[T], f32[T]; `num_candidates` static) as
    `sample` applies them, renormalized; -inf for a target they remove
    (`LLM.completion_logprobs`)."""
    x = processed_logits(logits, temperature, top_k, top_p, num_candidates)
    chosen = jnp.take_along_axis(x, targets[:, None], axis=-1)[:, 0]
    return chosen - jax.nn.logsumexp(x, axis=-1)
