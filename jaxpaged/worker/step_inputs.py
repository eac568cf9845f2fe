"""A step's inputs: the packed `ModelInput` of its sequences, built from the runner's persistent
input batch (`InputBatch`).

Every step is packed (vLLM v1's flattened batch): decodes and prompt chunks on one token axis
of T tokens, T padded to a bucket (`buckets.bucket`, at least `min_step_tokens`). The attention
backend adds how the step reads the cached blocks (`AttentionBackend.build_from_arrays`).
`model_input` is the one function that makes a `ModelInput`; a scheduled step
(`prepare`), a k-step decode (`decode_steps`: step i is step 0 with every position i later),
a padding-only step (`padding`) and a platform's probe all go through it. A new kind of step
input (image embeddings, a recurrent layer's state slots) is added there and nowhere else.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpaged.core.sequence import Sequence
from jaxpaged.models import ModelInput
from jaxpaged.pallas_kernels import StepLimits
from jaxpaged.worker.buckets import bucket
from jaxpaged.worker.input_batch import InputBatch


class StepInputs:
    """Builds each step's `ModelInput` for one runner (its backend, limits and input batch)."""

    def __init__(self, backend, limits: StepLimits, input_batch: InputBatch,
                 uses_rope_lengths: bool, uses_lora: bool, min_step_tokens: int = 1):
        """`uses_rope_lengths`: the model's RoPE switches with the sequence's length (longrope:
        every token carries its sequence's length); `uses_lora`: every token carries its
        adapter slot (so a step's shapes are the same whichever adapters run)."""
        self.backend, self.limits, self.input_batch = backend, limits, input_batch
        self.uses_rope_lengths, self.uses_lora = uses_rope_lengths, uses_lora
        # Steps of fewer tokens are padded up to this many (batch invariance's floor).
        self.min_step_tokens = min_step_tokens

    def step_tokens(self, num_tokens: int) -> int:
        """The padded token count T of a step of `num_tokens` tokens: their `bucket`, at least
        `min_step_tokens`."""
        return max(bucket(num_tokens), self.min_step_tokens)

    def model_input(self, T: int, block_tables: np.ndarray, num_computed_tokens: np.ndarray,
                    query_lens: np.ndarray, input_ids: np.ndarray | None = None,
                    seq_lens: np.ndarray | None = None, lora_slots: np.ndarray | None = None,
                    decode_only: bool | None = None) -> ModelInput:
        """The `ModelInput` of a step of T tokens (padded) over n sequences, packed in order.

        Args:
          block_tables: i32[n, max_blocks_per_seq] each sequence's blocks.
          num_computed_tokens: i32[n] tokens of each sequence already in the pool; its new
            tokens take the positions after them.
          query_lens: i32[n] new tokens of each sequence (their sum at most T).
          input_ids: i32[sum(query_lens)] the new tokens, packed; None: zeros (a k-step
            decode's inputs come from its draws on the device, padding steps have none).
          seq_lens: i32[n] each sequence's length this step (longrope models only); None: its
            computed and new tokens.
          lora_slots: i32[n] each sequence's adapter slot (LoRA engines only); None: 0.
          decode_only: the backend's variant; None: decided from `query_lens`.
        """
        q = np.asarray(query_lens, np.int32)
        computed = np.asarray(num_computed_tokens, np.int32)
        total = int(q.sum())
        ids, positions = np.zeros((T,), np.int32), np.zeros((T,), np.int32)
        if input_ids is not None:
            ids[:total] = input_ids
        token_row = np.repeat(np.arange(len(q)), q)
        positions[:total] = computed[token_row] + np.arange(total) - (np.cumsum(q) - q)[token_row]
        rope = lora = None
        if self.uses_rope_lengths:
            rope = np.zeros((T,), np.int32)
            rope[:total] = np.repeat(computed + q if seq_lens is None else seq_lens, q)
        if self.uses_lora:
            lora = np.zeros((T,), np.int32)
            if lora_slots is not None:
                lora[:total] = np.repeat(lora_slots, q)
        md = self.backend.build_from_arrays(self.limits, T, block_tables, computed, q,
                                            decode_only)
        return ModelInput(ids, positions, md, rope, lora_slots=lora)

    def padding(self, T: int, decode_only: bool = False) -> ModelInput:
        """A padding-only step of T tokens (a shape to compile or probe): it writes nothing."""
        empty = np.zeros((0,), np.int32)
        return self.model_input(T, np.zeros((0, self.limits.max_blocks_per_seq), np.int32),
                                empty, empty, decode_only=decode_only)

    def _rows(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(the sequences' block tables, i32[n] their computed tokens, i32[n] their adapter
        slots or None), the input batch synced with them."""
        rows = self.input_batch.sync(seqs, self.limits.block_size)
        n = len(seqs)
        computed = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int32, n)
        slots = (np.fromiter((seq.lora_slot for seq in seqs), np.int32, n) if self.uses_lora
                 else None)
        return self.input_batch.block_tables[rows], computed, slots

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int],
                spec_token_ids: list[list[int]] | None = None) -> ModelInput:
        """The step's sequences packed on one token axis of T = `step_tokens` of their
        tokens, in the order given (sequence i's logits are row i). A row's `spec_token_ids`
        (speculative proposals) follow its own tokens and are counted in its `num_new_tokens`.
        """
        tables, computed, slots = self._rows(seqs)
        total = sum(num_new_tokens)
        if total == len(seqs):  # one token each: the decodes' last tokens
            ids = [seq.token_ids[c] for seq, c in zip(seqs, computed.tolist())]
        else:
            ids = []
            for row, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
                first = seq.num_computed_tokens
                spec = spec_token_ids[row] if spec_token_ids else ()
                ids += seq.token_ids[first:first + n - len(spec)]
                ids += spec
        seq_lens = (np.fromiter((seq.num_tokens for seq in seqs), np.int32, len(seqs))
                    if self.uses_rope_lengths else None)
        return self.model_input(self.step_tokens(total), tables, computed, num_new_tokens,
                                np.asarray(ids, np.int32), seq_lens, slots)

    def decode_steps(self, seqs: list[Sequence], k: int
                     ) -> tuple[np.ndarray, ModelInput] | None:
        """(i32[T] the rows' last tokens, the k steps' `ModelInput` stacked on a leading axis)
        for decoding `seqs` k steps in a row in their booked blocks; None where the steps'
        shapes differ (a CPU step's flat block list can grow past the pool's size when many
        blocks are shared)."""
        tables, computed, slots = self._rows(seqs)
        n = len(seqs)
        T = self.step_tokens(n)
        first_ids = np.zeros((T,), np.int32)
        first_ids[:n] = [seq.token_ids[-1] for seq in seqs]
        ones = np.ones((n,), np.int32)
        steps = [self.model_input(T, tables, computed + i, ones, lora_slots=slots)
                 for i in range(k)]
        if len({tuple(np.shape(x) for x in jax.tree.leaves(s)) for s in steps}) > 1:
            return None
        return first_ids, stack(steps)


def stack(batches: list[ModelInput]) -> ModelInput:
    """The `ModelInput`s of k steps stacked on a leading axis of k (a k-step decode's scan)."""
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)
