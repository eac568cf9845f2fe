"""Continuous batching: which sequences run in the next step.

Each step is a prefill step or a decode step. Waiting sequences are admitted (prefill) in arrival
order while `max_num_seqs`, the token budget `max_num_batched_tokens` and the free blocks allow;
when none can be admitted, every running sequence decodes one token. A sequence that finishes
leaves at once, so a waiting one takes its place in the next step. When a decode needs a block and
none is free, the most recently admitted running sequence is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue, keeping its generated tokens.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from jaxpaged.block_manager import BlockManager
from jaxpaged.config import SchedulerConfig
from jaxpaged.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes; the model runner turns it into device arrays."""

    seqs: list[Sequence]  # in batch-row order
    num_scheduled_tokens: list[int]  # new tokens per row: the uncomputed ones, or 1 for a decode
    is_prefill: bool
    preempted: list[Sequence]  # sent back to waiting while building this step
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput | None:
        """The next step's batch, or None when nothing is waiting or running."""
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> SchedulerOutput | None:
        seqs, num_tokens = [], []
        while (self.waiting and len(self.running) + 1 + self.waiting[0].num_forks
               <= self.config.max_num_seqs):  # a parent brings its forks along
            seq = self.waiting[0]
            n = seq.num_tokens - self.block_manager.num_cached_prefix_tokens(seq)
            if (sum(num_tokens) + n > self.config.max_num_batched_tokens
                    or not self.block_manager.can_allocate(seq)):
                break
            self.block_manager.allocate(seq)  # sets num_computed_tokens past a cached prefix
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            seqs.append(seq)
            num_tokens.append(n)
        if not seqs:
            return None
        return SchedulerOutput(seqs, num_tokens, is_prefill=True, preempted=[])

    def _schedule_decode(self) -> SchedulerOutput | None:
        seqs, preempted, copies = [], [], []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                copies += self.block_manager.append_slots(seq)
                seqs.append(seq)
        if not seqs and not preempted:
            return None
        return SchedulerOutput(seqs, [1] * len(seqs), is_prefill=False, preempted=preempted,
                               blocks_to_copy=copies)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Adds `child` beside its running `parent`, sharing its blocks."""
        self.block_manager.fork(parent, child)
        self.running.append(child)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | None = None) -> None:
        """Marks `seq` finished and frees its blocks (it may be running or waiting)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
