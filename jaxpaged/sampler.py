"""The batched sampler: one jitted function, per-sample parameters, per-sample random keys.

A batch may mix greedy and sampled rows, any temperature / top-k / top-p / min-p, penalties and
logit biases without recompiling per mix: per-sample parameters are arrays. Features no sample of
the step uses are left out of the arrays (`None`), which picks a smaller compiled variant.

A sample's random key is `fold_in(fold_in(key(seed_lo), seed_hi), output_index)`, so a seeded
request draws the same tokens whatever else shares its batch. Several samples may draw from one
logits row (the n completions of a prompt right after its prefill), each with its own seed.

Order of processing (vLLM's): logit bias and token masks, then repetition / frequency / presence
penalties, then temperature, min-p, top-k and top-p. Returned log-probabilities are those of the
raw model logits (before any of these).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-sample arrays (R samples, V vocabulary); optional fields are None when unused."""

    row: jax.Array  # i32[R] the logits row each sample draws from
    temperature: jax.Array  # f32[R]; 0 is greedy
    top_k: jax.Array  # i32[R]; <= 0 keeps all
    top_p: jax.Array  # f32[R] in (0, 1]
    min_p: jax.Array  # f32[R] in [0, 1]
    seeds: jax.Array  # u32[R, 2] low and high 32 bits of each sample's seed
    output_index: jax.Array  # i32[R] tokens generated before this one
    logit_bias: jax.Array | None = None  # f32[R, V] added to the logits; -inf masks a token
    output_counts: jax.Array | None = None  # i32[R, V] occurrences in the output so far
    prompt_mask: jax.Array | None = None  # bool[R, V] token occurs in the prompt
    repetition_penalty: jax.Array | None = None  # f32[R]
    frequency_penalty: jax.Array | None = None  # f32[R]
    presence_penalty: jax.Array | None = None  # f32[R]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R] raw log-probability of each sampled token
    ranks: jax.Array  # i32[R] 1-based rank of each sampled token under the raw distribution
    top_ids: jax.Array | None  # i32[R, k] most likely tokens, when logprobs were asked for
    top_logprobs: jax.Array | None  # f32[R, k]


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


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks to -inf every logit outside each row's top-k, then outside its top-p nucleus.

    Args:
      logits: f32[R, V] (already divided by temperature).
      top_k: i32[R]; <= 0 keeps all V.
      top_p: f32[R] in (0, 1]; the smallest set of most likely tokens whose probability reaches
        top_p is kept (the most likely token always is).

    Returns:
      f32[R, V]. Tokens tied with the last kept one are kept too.
    """
    R, V = logits.shape
    desc = -jnp.sort(-logits, axis=-1)  # [R, V] sorted high to low
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    rank = jnp.arange(V)[None, :]
    desc = jnp.where(rank < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.sum((mass_before < top_p[:, None]) & (rank < k[:, None]), axis=-1)
    cutoff = jnp.take_along_axis(desc, (num_kept - 1)[:, None], axis=-1)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def argmax(x: jax.Array) -> jax.Array:
    """i32[R] index of each row's largest value (the first, on ties), as `jnp.argmax`.

    A max, then the least index holding it: two plain reductions, which XLA's CPU backend
    vectorizes; `jnp.argmax` lowers to a (value, index) pair reduction that it does not (4x
    slower over a [46, 49152] logits array here).
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)


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
      logits: f32[B, V] next-token logits, one row per sequence of the step.
      md: per-sample arrays.
      all_greedy: static; True skips sorting and drawing.
      num_logprobs: static; k of the top-k log-probabilities returned (0: none).

    Returns:
      `SamplerOutput` with i32[R] token ids and their raw log-probabilities.
    """
    if all_greedy and md.logit_bias is None and md.output_counts is None:
        # Nothing changes the logits: reduce the step's rows, then pick each sample's row
        # (no [R, V] gather).
        tokens = argmax(logits)
        stats = _logprob_stats(logits, tokens, num_logprobs)
        picked = [None if a is None else a[md.row] for a in (tokens, *stats)]
        return SamplerOutput(*picked)
    raw = logits[md.row]
    x = raw if md.logit_bias is None else raw + md.logit_bias
    if md.output_counts is not None:
        x = apply_penalties(x, md)
    tokens = argmax(x)
    if not all_greedy:
        scaled = x / jnp.where(md.temperature > 0, md.temperature, 1.0)[:, None]
        probs = jax.nn.softmax(scaled, axis=-1)
        scaled = jnp.where(probs >= md.min_p[:, None] * probs.max(-1, keepdims=True), scaled,
                           -jnp.inf)
        scaled = apply_top_k_top_p(scaled, md.top_k, md.top_p)
        keys = jax.vmap(_sample_key)(md.seeds, md.output_index)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        tokens = jnp.where(md.temperature > 0, drawn, tokens)
    return SamplerOutput(tokens, *_logprob_stats(raw, tokens, num_logprobs))


sample_jit = jax.jit(sample, static_argnames=("all_greedy", "num_logprobs"))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def prompt_logprobs(logits: jax.Array, input_ids: jax.Array, query_lens: jax.Array, *,
                    num_logprobs: int):
    """Log-probabilities of each prompt token given the ones before it, from a prefill.

    Args:
      logits: f32[B, Q, V] logits at every new token of the step.
      input_ids: i32[B, Q] the step's tokens; position i predicts token i + 1.
      query_lens: i32[B].
      num_logprobs: static top-k (0: none).

    Returns:
      (last f32[B, V] logits at each row's last token, target logprobs f32[B, Q], their ranks
      i32[B, Q], top ids i32[B, Q, k] or None, top logprobs f32[B, Q, k] or None).
    """
    B, Q, V = logits.shape
    target = jnp.concatenate([input_ids[:, 1:], jnp.zeros_like(input_ids[:, :1])], axis=1)
    stats = _logprob_stats(logits.reshape(B * Q, V), target.reshape(B * Q), num_logprobs)
    target_lp, ranks, top_ids, top_lp = [
        None if a is None else a.reshape(B, Q, *a.shape[1:]) for a in stats]
    last = logits[jnp.arange(B), jnp.maximum(query_lens - 1, 0)]
    return last, target_lp, ranks, top_ids, top_lp
