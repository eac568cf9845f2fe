"""Speculative decoding's acceptance rule: which of the target's draws become output tokens.

A row verifying k proposals d_1..d_k (`jaxpaged.spec_decode`) is sampled by the target at each
of its k + 1 positions, as any decode is sampled (`sampler.sample`, the key of output token t
being `fold_in(key(seed), t)`): x_i is the target's draw after the row's tokens and d_1..d_i.
The row outputs x_1.. up to and including the first x_i that differs from d_(i+1), or all k + 1
when every proposal equals the draw at its position (vLLM's `v1/sample/rejection_sampler.py`).

This is Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding",
section 2.3) for a proposal distribution that puts all its mass on one token: accepting d with
probability p(d), and otherwise sampling from p without d, is drawing x ~ p and accepting iff
x = d. So every output token is the target's draw at its position given the tokens before it:
greedy outputs equal decoding without speculation, sampled ones keep the target's distribution,
and a seeded request draws the same tokens with or without speculation.
"""

from __future__ import annotations

import numpy as np


def rejection_sample(token_ids: np.ndarray, rows: np.ndarray, positions: np.ndarray,
                     spec_token_ids: list[list[int]]) -> np.ndarray:
    """Which draws are output tokens.

    Args:
      token_ids: i32[D], the target's draws.
      rows: i32[D], each draw's batch row (an index into `spec_token_ids`).
      positions: i32[D], the proposals of its row each draw comes after (0 for a row without
        proposals, whose draws, one per completion, are all output).
      spec_token_ids: per row, its proposals ([] for most rows).

    Returns:
      bool[D]: a row's draws up to its first that differs from the proposal at its position.
    """
    token_ids, rows, positions = (np.asarray(a, np.int64) for a in (token_ids, rows, positions))
    num_spec = np.array([len(s) for s in spec_token_ids], np.int64)
    proposed = positions < num_spec[rows]
    # The proposal each draw is checked against (-1 past the row's proposals: never checked).
    flat = np.array([t for s in spec_token_ids for t in s] + [-1], np.int64)
    starts = np.concatenate([[0], np.cumsum(num_spec)[:-1]])
    draft = np.where(proposed, flat[np.where(proposed, starts[rows] + positions, -1)], -1)
    rejected_at = np.full(len(spec_token_ids), np.iinfo(np.int64).max)
    mismatch = proposed & (token_ids != draft)
    np.minimum.at(rejected_at, rows[mismatch], positions[mismatch])
    return positions <= rejected_at[rows]
