"""The model contract: what every model family takes and returns in one engine step.

A family is an `nnx.Module` whose `__call__(kv_cache, batch, all_positions)` runs one step over
the paged KV pool and returns `(logits, kv_cache)`; `forward` is the pure function the runner
jits. The engine and the runner see a model only through this module: `ModelInput`, `forward`
and the `ModelConfig` fields below. Families register in `models.registry`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
from flax import nnx


class ModelConfig(Protocol):
    """What the engine and the runner read of a family's config (the rest is the model's)."""

    vocab_size: int  # V
    num_hidden_layers: int  # L
    num_key_value_heads: int  # K: the KV pool's heads
    head_dim: int  # H
    max_position_embeddings: int  # the longest sequence the model takes, in tokens
    eos_token_ids: tuple[int, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelInput:
    """One step's batch, padded to bucket sizes by the host (all int32 NumPy or jax arrays).

    Row b holds `query_lens[b]` new tokens; slots past it (and rows past the real batch) are
    padding with `query_lens == 0` and `slot_mapping == PAD_SLOT_ID`. The rows' cached blocks
    come either as padded `block_tables` (the Pallas kernels) or, when `context_blocks` is set,
    as one flat list (the XLA path, `pallas_kernels.paged_attention_xla_flat`; `block_tables`
    is then `[B, 0]`).
    """

    input_ids: jax.Array  # i32[B, Q] new token ids
    positions: jax.Array  # i32[B, Q] their positions in the sequence
    slot_mapping: jax.Array  # i32[B, Q] flat pool slot each new token's K/V is written to
    block_tables: jax.Array  # i32[B, M] blocks of each row's cached (Pallas: and new) tokens
    num_computed_tokens: jax.Array  # i32[B] tokens of the row already in the pool
    query_lens: jax.Array  # i32[B] new tokens in the row (0 for padding rows)
    context_blocks: jax.Array | None = None  # i32[NB] every row's cached blocks, row by row
    context_rows: jax.Array | None = None  # i32[NB] row of each (B for padding entries)
    context_lens: jax.Array | None = None  # i32[NB] cached tokens in each (0 for padding)
    # Packed layout (the "cpu" backend): i32[S + 1] first token of each of S sequences in the
    # one row of T tokens (B = 1, Q = T); the per-row arrays above are then per sequence.
    query_start_loc: jax.Array | None = None


def forward(graphdef: nnx.GraphDef, params: nnx.State, kv_cache: jax.Array,
            batch: ModelInput, all_positions: bool = False) -> tuple[jax.Array, jax.Array]:
    """The pure step function: `jax.jit(partial(forward, graphdef), donate_argnums=1)`.

    Args:
      graphdef, params: `nnx.split(model)` of a registered model.
      kv_cache: f[L, 2, K, P, S, H] the pool; donated, so the write is in place.
      batch: `ModelInput`.
      all_positions: static; logits at every new token, f32[B, Q, V].

    Returns:
      (f32[B, V] logits at each row's last new token (f32[S, V] per sequence when packed),
      updated kv_cache).
    """
    return nnx.merge(graphdef, params)(kv_cache, batch, all_positions)
