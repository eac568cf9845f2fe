"""The batched sampler: one jitted function, per-row parameters, per-row random keys.

A batch may mix greedy and sampled rows and any temperature / top-k / top-p without recompiling;
only an all-greedy batch takes a separate (argmax-only) compiled variant. A sample's random key is
`fold_in(fold_in(key(seed_lo), seed_hi), output_index)`, so a seeded request draws the same tokens
whatever else shares its batch. Several samples may draw from one logits row (the n completions
of a prompt right after its prefill), each with its own seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _sample_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
    return jax.random.fold_in(key, step)


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks to -inf every logit outside each row's top-k, then outside its top-p nucleus.

    Args:
      logits: f32[B, V] (already divided by temperature).
      top_k: i32[B]; <= 0 keeps all V.
      top_p: f32[B] in (0, 1]; the smallest set of most likely tokens whose probability reaches
        top_p is kept (the most likely token always is).

    Returns:
      f32[B, V]. Tokens tied with the last kept one are kept too.
    """
    B, V = logits.shape
    desc = -jnp.sort(-logits, axis=-1)  # [B, V] sorted high to low
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    rank = jnp.arange(V)[None, :]
    desc = jnp.where(rank < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.sum((mass_before < top_p[:, None]) & (rank < k[:, None]), axis=-1)
    cutoff = jnp.take_along_axis(desc, (num_kept - 1)[:, None], axis=-1)
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def sample(logits: jax.Array, row: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, seeds: jax.Array, output_index: jax.Array, *,
           all_greedy: bool) -> jax.Array:
    """Draws one token per sample.

    Args:
      logits: f32[B, V] next-token logits, one row per sequence of the step.
      row: i32[R] the logits row each sample draws from.
      temperature: f32[R]; 0 is greedy (argmax).
      top_k: i32[R]; top_p: f32[R] (see `apply_top_k_top_p`).
      seeds: u32[R, 2] low and high 32 bits of each sample's seed.
      output_index: i32[R] how many tokens the sample's sequence has generated before this one.
      all_greedy: static; True skips sorting and drawing.

    Returns:
      i32[R] token ids.
    """
    logits = logits[row]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        return greedy
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = apply_top_k_top_p(scaled, top_k, top_p)
    keys = jax.vmap(_sample_key)(seeds, output_index)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


sample_jit = jax.jit(sample, static_argnames=("all_greedy",))
