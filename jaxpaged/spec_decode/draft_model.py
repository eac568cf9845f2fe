"""Draft-model proposals: k greedy tokens of a smaller model with the target's vocabulary."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.sequence import Sequence
from jaxpaged.model_loader.loader import load_model_from_dir
from jaxpaged.model_loader.model_store import resolve_model
from jaxpaged.models import load_config
from jaxpaged.config import SpeculativeConfig
from jaxpaged.spec_decode.registry import ProposerContext
from jaxpaged.worker.kv_cache import resolve_kv_cache_dtype
from jaxpaged.worker.model_runner import ModelRunner


def build_draft_model_proposer(config: SpeculativeConfig, context: ProposerContext
                               ) -> "DraftModelProposer":
    """The draft model of `config.model`, loaded as the target is (a folder, a GGUF file or an
    embedded model: `resolve_model`, `load_model_from_dir`) in the target's dtype and attention
    backend, with its own runner and a KV pool of as many blocks as the target's (no prefix
    caching).

    Raises:
      ValueError: the draft's vocabulary differs from the target's, or it cannot be loaded.
    """
    draft_dir = resolve_model(config.model)
    draft_config = load_config(draft_dir)
    vocab_size = context.model_config.vocab_size
    if draft_config.vocab_size != vocab_size:
        raise ValueError(f"speculative_config: the draft model {config.model!r} has "
                         f"vocab_size {draft_config.vocab_size}, the target {vocab_size}; it "
                         "must share the tokenizer")
    draft = load_model_from_dir(draft_dir, draft_config, context.dtype,
                                context.attention_backend)
    cache_config = dataclasses.replace(context.cache_config, num_kv_blocks=context.num_blocks,
                                       enable_prefix_caching=False)
    sched = context.scheduler_config
    # The draft's pool is float, of the model's dtype, whatever the target's pool is.
    runner = ModelRunner(draft, cache_config, context.num_blocks,
                         resolve_kv_cache_dtype("auto", context.dtype),
                         max_num_seqs=sched.max_num_seqs, max_model_len=sched.max_model_len,
                         compilation_cache_dir=context.compilation_cache_dir)
    return DraftModelProposer(config, runner,
                              BlockManager(context.num_blocks, cache_config.block_size),
                              sched.max_num_batched_tokens)


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

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner,
                 block_manager: BlockManager, max_num_batched_tokens: int):
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
        logits = self.runner.compute_logits(drafts, qs)
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
