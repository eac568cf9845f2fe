"""The experts each token was routed to, returned with a request's output
(`SamplingParams.return_routed_experts`): the record that rollout routing replay (R3; Ma et al.
2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers",
arXiv:2510.11370) hands to training, so that the trainer's forward pass routes every token of
a rollout to the experts the engine used. vLLM returns the same record as
`CompletionOutput.routed_experts` (`enable_return_routed_experts`).

Every step of a Mixture-of-Experts model returns each MoE layer's expert ids for its tokens
(`models.moe.recording_routes`). The host keeps them twice:
  - by pool slot (`RoutedExperts.slots`), whichever request computed them: a prefix-cache hit
    reuses blocks another request computed, and their tokens' routes are read from there;
  - by position in each sequence that asked (`Sequence.routed_experts`), written as its tokens
    are computed, so that a finished sequence's record outlives its blocks.
Routes are a function of the tokens before them, as the KV is, so a reused (prefix-cached)
token has the routes it had. A sequence's record keeps the first routes written for each of
its tokens: a preempted sequence's recomputation (whose step, of another size, may round a
near tie the other way) does not rewrite the routes its next tokens were sampled under, and
the outputs can hand out read-only views of the record that later steps never change. A
verifying step's rejected proposals are written past the sequence's last token, where the
token that is computed there later overwrites them.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from jaxpaged.models.moe import SparseMoeBlock

ROUTE_DTYPE = np.int16  # expert ids; a model with more experts than it holds is refused


class RoutedExperts:
    """The routes of every pool slot's token: `slots: i16[P * S, L_moe, k]` (P blocks of S =
    `block_size` tokens, L_moe MoE layers, k experts per token, most likely first)."""

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, top_k: int):
        self.block_size = block_size
        self.slots = np.zeros((num_blocks * block_size, num_layers, top_k), ROUTE_DTYPE)

    @classmethod
    def for_model(cls, model: nnx.Module, num_blocks: int, block_size: int
                  ) -> "RoutedExperts | None":
        """The store for `model`'s MoE layers, or None for a model without them.

        Raises:
          ValueError: more experts than `ROUTE_DTYPE` holds.
        """
        blocks = [node for _, node in nnx.iter_graph(model) if isinstance(node, SparseMoeBlock)]
        if not blocks:
            return None
        num_experts = max(b.router.kernel.shape[-1] for b in blocks)
        if num_experts > np.iinfo(ROUTE_DTYPE).max + 1:
            raise ValueError(f"{num_experts} experts do not fit the routes' "
                             f"{np.dtype(ROUTE_DTYPE).name}")
        return cls(num_blocks, block_size, len(blocks), max(b.routing.top_k for b in blocks))

    def record(self, seqs, starts: np.ndarray, counts: np.ndarray, slot_mapping: np.ndarray,
               routes: np.ndarray) -> None:
        """Writes one step's routes.

        Args:
          seqs: the step's sequences (`core.sequence.Sequence`), in row order; those finished
            since the step was launched (async scheduling) keep their record as it was.
          starts, counts: i32[S] each row's first position computed and how many.
          slot_mapping: i32[T] each token's pool slot (-1: padding).
          routes: i16[L_moe, T, k] the step's expert ids, the rows' tokens packed in order.
        """
        by_token = routes.transpose(1, 0, 2).astype(ROUTE_DTYPE)  # [T, L, k]
        real = slot_mapping >= 0
        self.slots[slot_mapping[real]] = by_token[real]
        first = np.cumsum(counts) - counts
        for seq, start, n, f in zip(seqs, starts.tolist(), counts.tolist(), first.tolist()):
            if seq.params.return_routed_experts and not seq.is_finished:
                self._write(seq, start, by_token[f:f + n])

    def record_steps(self, seqs, starts: np.ndarray, slot_mappings: np.ndarray,
                     routes: np.ndarray) -> None:
        """Writes k decode steps' routes (a k-step decode, `ModelRunner.launch`): `slot_mappings: i32[k, T]`,
        `routes: i16[k, L_moe, T, k_experts]`; row r's token is token r of each step, at
        position `starts[r] + i` in step i."""
        ones = np.ones(len(seqs), np.int32)
        for i in range(routes.shape[0]):
            self.record(seqs, starts + i, ones, slot_mappings[i], routes[i])

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy-on-write: block dst[i]'s slots take block src[i]'s routes, as its KV does."""
        view = self.slots.reshape(-1, self.block_size, *self.slots.shape[1:])
        view[np.asarray(dst)] = view[np.asarray(src)]

    def _write(self, seq, start: int, rows: np.ndarray) -> None:
        """Positions start.. of `seq` take `rows`, but for those of its tokens already recorded
        (recomputed after preemption: the first routes stay); positions before `start` that it
        has no record of (a prefix-cache hit) are read from the slots of its blocks."""
        known, need = seq.num_routed, start + len(rows)
        final = min(known, seq.num_tokens - 1)  # rows of its tokens, recorded: kept
        capacity = 0 if seq.routed_experts is None else len(seq.routed_experts)
        if capacity < need:
            grown = np.zeros((max(need, 2 * capacity), *self.slots.shape[1:]), ROUTE_DTYPE)
            if known:
                grown[:known] = seq.routed_experts[:known]
            seq.routed_experts = grown
        if known < start:
            pos = np.arange(known, start)
            table = np.asarray(seq.block_table, np.int64)
            seq.routed_experts[known:start] = self.slots[
                table[pos // self.block_size] * self.block_size + pos % self.block_size]
        first = max(start, final)
        seq.routed_experts[first:need] = rows[first - start:]
        seq.num_routed = max(known, need)


def routes_of(seq) -> np.ndarray | None:
    """i16[N - 1, L_moe, k] the routes of `seq`'s tokens but its last (N tokens; the last has
    not been through the model), or None where it did not ask: a read-only view of its record,
    whose rows no later step changes (`RoutedExperts._write`)."""
    if seq.routed_experts is None:
        return None
    view = seq.routed_experts[:min(seq.num_routed, seq.num_tokens - 1)]
    view.flags.writeable = False
    return view
