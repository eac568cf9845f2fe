"""Sampling parameters, with vLLM's names, defaults and ranges."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    """How to sample the completion of one prompt (vLLM's `SamplingParams` subset).

    Invalid values raise `ValueError` naming the field and the value, when the object is built.
    """

    n: int = 1  # completions returned per prompt
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # tokens kept; 0 or -1 means all
    max_tokens: int | None = 16  # tokens generated at most; None means up to max_model_len
    seed: int | None = None  # per-request seed: same seed, same tokens, whatever the batch
    stop_token_ids: list[int] | None = None  # token ids that end the completion (kept in ids)
    ignore_eos: bool = False  # keep generating past the model's EOS token
    skip_special_tokens: bool = True  # leave special tokens out of the text

    def __post_init__(self):
        def bad(field: str, rule: str):
            raise ValueError(f"SamplingParams.{field} {rule}, got {getattr(self, field)!r}")

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an int >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an int: -1, 0 (both mean off) or >= 1")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an int >= 1 or None")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            bad("seed", "must be an int in [0, 2**64) or None")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative ints")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
