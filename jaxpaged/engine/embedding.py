"""Embeddings (`LLM.embed`, `/v1/embeddings`): the model's final hidden states pooled over each
prompt, by the dense forward on the served parameters (no KV write, the pool untouched)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxpaged.errors import InvalidRequestError
from jaxpaged.models import pooled_hidden_states
from jaxpaged.worker.buckets import next_power_of_2

POOLING_TYPES = ("last", "mean")  # vLLM's LAST and MEAN


class Embedder:
    """Pools final hidden states of prompts for a model of `graphdef`, `hidden_size` wide."""

    EMBED_BATCH = 16  # prompts per embedding forward

    def __init__(self, graphdef, hidden_size: int):
        self.hidden_size = hidden_size
        self._pooled = jax.jit(functools.partial(pooled_hidden_states, graphdef),
                               static_argnames=("pooling", "normalize"))

    def embed(self, params, token_ids: list[list[int]], pooling: str = "last",
              normalize: bool = True) -> np.ndarray:
        """Embeddings of prompts (`models.pooled_hidden_states`), in batches of `EMBED_BATCH`
        prompts right-padded to a power of two of tokens and of rows, so few shapes compile.

        Args:
          params: the served parameter tree.
          token_ids: one list of ids per prompt.
          pooling: "last" (the last token's state) or "mean" (over the prompt's tokens).
          normalize: L2-normalize each embedding.

        Returns:
          f32[len(token_ids), hidden_size].

        Raises:
          InvalidRequestError (a ValueError): an unknown `pooling`, or an empty prompt.
        """
        if pooling not in POOLING_TYPES:
            raise InvalidRequestError("pooling", f"pooling must be one of {POOLING_TYPES}, "
                                      f"got {pooling!r}")
        if any(len(ids) == 0 for ids in token_ids):
            raise InvalidRequestError("input", "an input to embed is empty")
        out = []
        for start in range(0, len(token_ids), self.EMBED_BATCH):
            rows = token_ids[start:start + self.EMBED_BATCH]
            B, T = next_power_of_2(len(rows)), next_power_of_2(max(map(len, rows)))
            ids, mask = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
            mask[len(rows):, 0] = 1  # padding rows: one token, dropped below
            for i, row in enumerate(rows):
                ids[i, :len(row)], mask[i, :len(row)] = row, 1
            pooled = self._pooled(params, ids, mask, pooling=pooling, normalize=normalize)
            out.append(np.asarray(pooled)[:len(rows)])
        return np.concatenate(out) if out else np.zeros((0, self.hidden_size), np.float32)
