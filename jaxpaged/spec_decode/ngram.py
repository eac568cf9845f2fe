"""Prompt lookup (vLLM's "ngram" method): proposals copied from the sequence's own tokens."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jaxpaged.core.sequence import Sequence
from jaxpaged.config import SpeculativeConfig


def ngram_proposal(token_ids: list[int] | np.ndarray, k: int, n_max: int, n_min: int
                   ) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, for the largest n in [n_min, n_max] that occurs (vLLM's prompt lookup); [] if none.
    """
    tokens = np.asarray(token_ids, np.int64)
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = tokens[L - n:]
        # Windows of n tokens starting at 0 .. L - n - 1 (not the suffix itself).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig, context=None):
        self.config = config

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        c = self.config
        return [ngram_proposal(seq.token_ids, k, c.prompt_lookup_max, c.prompt_lookup_min)
                if k else [] for seq, k in zip(seqs, ks)]

    def release(self, live: Iterable[Sequence]) -> None:
        """Nothing kept per sequence."""
