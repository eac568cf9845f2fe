"""Speculative decoding: proposals for each decoding sequence, verified in one packed step.

Before a step, a proposer guesses the next k tokens of each decoding sequence (`NgramProposer`:
the tokens that followed the latest earlier occurrence of the sequence's last n-gram, vLLM's
prompt lookup; `DraftModelProposer`: k greedy steps of a smaller model with its own KV pool and
block tables). The scheduler gives such a sequence 1 + k query tokens (its last token and the
proposals) in the step's packed batch; the runner samples the target at each of those positions
as it samples any decode (`ModelRunner.execute`), the sampler's key for output token t being the
same `fold_in(key(seed), t)`, and keeps the proposals up to the first one that differs from the
target's own draw, plus that draw (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", section 2.3, with a proposal distribution that puts all its mass on one
token: accepting proposal d with probability p(d) and otherwise sampling from p without d is
drawing x ~ p and accepting iff x = d). So every output token is the target's draw at its
position given the tokens before it: greedy outputs equal decoding without speculation, sampled
ones keep the target's distribution, and a seeded request draws the same tokens with or without
speculation (up to the float rounding of a step of k + 1 tokens against one).

The rejected proposals' KV slots are overwritten by later tokens, and blocks past the
sequence's tokens go back to the block manager after the step (`BlockManager.trim`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

import numpy as np

from jaxpaged.core.sequence import Sequence

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys.

    method: "ngram" (prompt lookup) or "draft_model" (implied by `model`).
    num_speculative_tokens: k, the tokens proposed per sequence and step.
    prompt_lookup_max / prompt_lookup_min: the longest and shortest n-gram matched ("ngram";
      vLLM's defaults: one given sets both, neither gives 5).
    model: the draft model (a path or an embedded model name; "draft_model"), with the
      target's vocabulary.
    disable_by_batch_size: no proposals in a step in which more sequences decode than this
      (None: never off); the default, `DEFAULT_DISABLE_BY_BATCH_SIZE`, is where verification
      stopped paying on this project's CPU (`bench/speculative.py`; README, "Speculative
      decoding").
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = 8  # DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"speculative_config: {name} must be an int >= 1, "
                                 f"got {value!r}")

        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            positive(name)
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not one of "
                             f"{SPECULATIVE_METHODS}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs a 'model'")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: 'model' is for method 'draft_model', "
                                 "not 'ngram'")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min {lo} is larger than "
                                 f"prompt_lookup_max {hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, config: dict | str | None) -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the server's `--speculative-config`); None stays None.

        Raises:
          ValueError: not a JSON object, an unknown key, or a bad value (named).
        """
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {config!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        config = dict(config)
        if config.get("model") is not None:
            config.setdefault("method", "draft_model")
        return cls(**config)


# Decoding sequences above which a step proposes nothing, by default (see SpeculativeConfig).
DEFAULT_DISABLE_BY_BATCH_SIZE = SpeculativeConfig.disable_by_batch_size


def num_proposals(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many proposals `seq` may take: at most k, and leaving room for the token the target
    draws after them within `max_tokens` and `max_model_len`; 0 for a sequence whose outputs
    the proposals would change how they are computed (a grammar, penalties, min_tokens not
    reached, a scoring sequence)."""
    p = seq.params
    if (seq.matcher is not None or seq.scoring is not None
            or seq.num_output_tokens < p.min_tokens or p.repetition_penalty != 1
            or p.frequency_penalty or p.presence_penalty):
        return 0
    room = min(p.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens) - 1
    return max(0, min(k, room))


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

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        c = self.config
        return [ngram_proposal(seq.token_ids, k, c.prompt_lookup_max, c.prompt_lookup_min)
                if k else [] for seq, k in zip(seqs, ks)]

    def release(self, live: Iterable[Sequence]) -> None:
        """Nothing kept per sequence."""


class DraftModelProposer:
    """k greedy tokens of a draft model per sequence: one packed step computes what the draft
    has not seen of every sequence (its prompt the first time, then the tokens accepted since),
    then k - 1 packed decode steps. The draft keeps its own KV pool, block manager and a
    `Sequence` per target sequence; its computed tokens stay valid while they equal the target's
    (accepted proposals are the draft's own tokens), so each step catches up from there.

    Args:
      runner: the draft's `ModelRunner` (its own pool).
      block_manager: the draft pool's blocks (no prefix caching).
      max_num_batched_tokens: tokens in one catch-up step; a sequence whose catch-up does not
        fit computes part of it and proposes nothing this step.
    """

    def __init__(self, config: SpeculativeConfig, runner, block_manager,
                 max_num_batched_tokens: int):
        import jax
        import jax.numpy as jnp

        self.config, self.runner, self.block_manager = config, runner, block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.drafts: dict[int, Sequence] = {}  # target seq_id -> the draft's sequence
        self._argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))

    def _draft_of(self, seq: Sequence) -> Sequence:
        draft = self.drafts.get(seq.seq_id)
        if draft is None:
            draft = self.drafts[seq.seq_id] = Sequence(seq.request_id, seq.index, [],
                                                       seq.params, seq.seed)
        # Valid computed tokens: the prefix the draft computed that the target still has.
        n = min(draft.num_computed_tokens, seq.num_tokens - 1)
        lo = max(0, n - self.config.num_speculative_tokens - 1)
        same = np.asarray(draft.token_ids[lo:n]) == np.asarray(seq.token_ids[lo:n])
        draft.num_computed_tokens = lo + (int(np.argmin(same)) if not same.all() else n - lo)
        draft.token_ids = list(seq.token_ids)
        return draft

    def _run(self, drafts: list[Sequence], qs: list[int]) -> np.ndarray:
        """One packed draft step; the greedy next token of each row, i32[len(drafts)]."""
        logits = self.runner._run_step(self.runner.prepare(drafts, qs))
        return np.asarray(self._argmax(logits))[:len(drafts)]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in seqs]
        rows, qs, budget = [], [], self.max_num_batched_tokens
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k == 0 or budget == 0:
                continue
            draft = self._draft_of(seq)
            q = min(draft.num_tokens - draft.num_computed_tokens, budget)
            if not self.block_manager.can_append(draft, q + k - 1):
                self.block_manager.free(draft)
                del self.drafts[seq.seq_id]
                continue
            self.block_manager.append_slots(draft, q + k - 1)
            rows.append(i)
            qs.append(q)
            budget -= q
        if not rows:
            return proposals
        drafts = [self.drafts[seqs[i].seq_id] for i in rows]
        tokens = self._run(drafts, qs)
        for draft, q in zip(drafts, qs):
            draft.num_computed_tokens += q
        live = [j for j, (draft, q) in enumerate(zip(drafts, qs))
                if draft.num_computed_tokens == draft.num_tokens]  # caught up: it proposes
        for j in live:
            proposals[rows[j]].append(int(tokens[j]))
        for step in range(1, max((ks[rows[j]] for j in live), default=0)):
            live = [j for j in live if ks[rows[j]] > step]
            for j in live:
                drafts[j].token_ids.append(proposals[rows[j]][-1])
            tokens = self._run([drafts[j] for j in live], [1] * len(live))
            for j, token in zip(live, tokens):
                drafts[j].num_computed_tokens += 1
                proposals[rows[j]].append(int(token))
        return proposals

    def release(self, live: Iterable[Sequence]) -> None:
        """Frees the draft state of every target sequence not in `live` (finished, preempted)."""
        keep = {seq.seq_id for seq in live}
        for seq_id in [s for s in self.drafts if s not in keep]:
            self.block_manager.free(self.drafts.pop(seq_id))
