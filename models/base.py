"""The model contract: what every model family takes and returns in one engine step.

A family is an `nnx.Module` whose `__call__(kv_cache, batch, all_positions)` runs one step over
the paged KV pool and returns `(logits, kv_cache)`; `forward` is the pure function the runner
jits. Its `dense_forward(input_ids, attention_mask)` runs the same layers on the same parameters
as a plain causal forward over a padded batch (no pool: for training, `jax.grad`);
`dense_forward` below is its pure form. The engine and the runner see a model only through
this module: `ModelInput`, `forward` and the `ModelConfig` fields below. Families register in
`models.registry`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.pallas_kernels.backends import AttentionMetadata, AttentionSpec
from jaxpaged.pallas_kernels.plan import KernelPlan


class ModelConfig(Protocol):
    """What the engine and the runner read of a family's config (the rest is the model's)."""

    vocab_size: int  # V
    num_hidden_layers: int  # L
    num_key_value_heads: int  # K: the KV pool's heads
    head_dim: int  # H
    max_position_embeddings: int  # the longest sequence the model takes, in tokens
    eos_token_ids: tuple[int, ...]

    # A sequence longer than this rotates with other RoPE factors (longrope), so each step
    # passes `ModelInput.rope_seq_lens`, and a sequence is computed again when it passes it.
    rope_switch_length: int | None

    tensor_parallel_size: int  # devices the model is split over (heads, MLP, vocabulary)
    kernels: KernelPlan  # the kernels its layers run (`pallas_kernels.plan`)

    def for_tensor_parallel(self, tp: int, expert_parallel: bool = False) -> "ModelConfig":
        """The config split over tp devices (KV heads repeated where fewer than tp; a
        Mixture-of-Experts model's experts split by hidden unit, or whole with
        `expert_parallel`, which a model without experts refuses with a ValueError)."""

    def attention_spec(self, layer: int) -> AttentionSpec:
        """Layer `layer`'s attention: scale, sliding window, logit soft-cap."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelInput:
    """One step's batch, packed: the T new tokens of all its sequences on one axis, padded at
    the end to a bucket (int32 NumPy or jax arrays). `attention` says which sequence each token
    belongs to and where its K/V go (`pallas_kernels.backends.AttentionMetadata`)."""

    input_ids: jax.Array  # i32[T] new token ids
    positions: jax.Array  # i32[T] their positions in their sequences
    attention: AttentionMetadata
    # i32[T], only for configs with a `rope_switch_length` (longrope): the length of each
    # token's sequence, every token known at this step (the prompt and the output so far).
    rope_seq_lens: jax.Array | None = None
    # i32[R]: the tokens to return logits at, f32[R, V], in place of each sequence's last
    # (speculative decoding verifies every proposal); None: the last of each.
    logits_indices: jax.Array | None = None
    # i32[T], only for an engine serving LoRA adapters: each token's adapter slot (0: none;
    # `models.lora`).
    lora_slots: jax.Array | None = None


def forward(graphdef: nnx.GraphDef, params: nnx.State, kv_cache: jax.Array,
            batch: ModelInput, all_positions: bool = False) -> tuple[jax.Array, jax.Array]:
    """The pure step function: `jax.jit(partial(forward, graphdef), donate_argnums=1)`.

    Args:
      graphdef, params: `nnx.split(model)` of a registered model.
      kv_cache: f[L, 2, K, P, S, H] the pool; donated, so the write is in place.
      batch: `ModelInput`.
      all_positions: static; logits at every token, f32[T, V] (prompt logprobs).

    Returns:
      (f32[S, V] logits at each sequence's last new token (f32[T, V] with `all_positions`),
      updated kv_cache).
    """
    return nnx.merge(graphdef, params)(kv_cache, batch, all_positions)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseBatch:
    """A padded batch for a dense forward: what the attention layers read instead of the
    paged `AttentionMetadata` (`models.layers.dense_attention`)."""

    mask: jax.Array  # bool[B, T] real tokens (padding left or right is False)
    positions: jax.Array  # i32[B, T] each token's position among its row's real tokens


def dense_forward(graphdef: nnx.GraphDef, params: nnx.State, input_ids: jax.Array,
                  attention_mask: jax.Array | None = None) -> jax.Array:
    """The pure dense forward: `jax.jit(partial(dense_forward, graphdef))`, differentiable in
    `params` (the engine's tree, `LLM.get_params`).

    Args:
      graphdef, params: `nnx.split(model)` of a registered model.
      input_ids: i32[B, T] token ids.
      attention_mask: bool or int [B, T], 1 at real tokens (left or right padding 0); None: all
        real. Positions count real tokens only, so a left-padded row computes as unpadded.

    Returns:
      f32[B, T, V] logits at every token (garbage at padding).
    """
    return nnx.merge(graphdef, params).dense_forward(input_ids, attention_mask)


def pooled_hidden_states(graphdef: nnx.GraphDef, params: nnx.State, input_ids: jax.Array,
                         attention_mask: jax.Array, pooling: str = "last",
                         normalize: bool = True) -> jax.Array:
    """Embeddings of a right-padded batch: the final hidden states (after the final norm, HF's
    `last_hidden_state`) of the dense forward, pooled over each row's real tokens.

    Args:
      graphdef, params: `nnx.split(model)` of a registered model.
      input_ids: i32[B, T]; attention_mask: [B, T], 1 at real tokens (padding at the right,
        at least one real token per row).
      pooling: static; "last" (the last real token, vLLM's default for causal models) or
        "mean" (the real tokens' mean).
      normalize: static; divide each row by its L2 norm.

    Returns:
      f32[B, D].
    """
    B, T = input_ids.shape
    mask = jnp.asarray(attention_mask).astype(bool)
    h = nnx.merge(graphdef, params).dense_hidden_states(input_ids, mask)
    h = h.reshape(B, T, -1).astype(jnp.float32)
    if pooling == "last":
        last = jnp.sum(mask, axis=-1) - 1
        out = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    else:
        out = jnp.sum(jnp.where(mask[..., None], h, 0), axis=1) / jnp.sum(
            mask, axis=-1, keepdims=True)
    if normalize:
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out
