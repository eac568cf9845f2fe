"""KV block manager: a free list of physical blocks with reference counts.

The host-side half of PagedAttention (paper, section 4.2): a sequence holds a block table of
physical block ids, one per `block_size` tokens; blocks are taken from the free list as its tokens
arrive and go back when it finishes or is preempted. A reference count per block lets several
sequences hold the same block (memory sharing, section 4.4); a block returns to the free list when
its last reference goes.
"""

from __future__ import annotations

from collections import deque

from jaxpaged.sequence import Sequence


class BlockManager:
    """Allocates physical KV blocks to sequences.

    Methods come in check/act pairs: `can_allocate` / `allocate` for a sequence's prompt (or its
    recompute after preemption), `can_append` / `append_slots` for new tokens, `free` at the end.
    The `act` methods raise RuntimeError if their check would have failed: the scheduler must ask
    first.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.num_cow_copies = 0  # blocks copied on write since start

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one sequence."""
        return sum(1 for r in self.ref_counts if r > 1)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the free list holds blocks for all of `seq`'s current tokens."""
        return self.num_blocks_needed(seq.num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Gives `seq` (holding no blocks) blocks for all its current tokens."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks {seq.block_table}")
        if not self.can_allocate(seq):
            raise RuntimeError(f"allocate needs {self.num_blocks_needed(seq.num_tokens)} blocks, "
                               f"{self.num_free_blocks} free")
        seq.block_table = [self._take() for _ in range(self.num_blocks_needed(seq.num_tokens))]

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether slots fit for `num_new_tokens` tokens computed past `seq.num_computed_tokens`,
        counting the copies of shared blocks those tokens would be written into."""
        return (self._num_missing_blocks(seq, num_new_tokens)
                + len(self._shared_blocks_written(seq, num_new_tokens))) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Grows `seq`'s block table to hold `num_computed_tokens + num_new_tokens` tokens.

        A shared block (reference count > 1) about to be written is first copied into a new
        block of `seq`'s own (copy-on-write, PagedAttention section 4.4); full shared blocks are
        never written, so never copied.

        Returns:
          (src, dst) block ids whose contents the runner must copy before the step.
        """
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError(f"append_slots for {seq}: not enough free blocks")
        copies = []
        for i in self._shared_blocks_written(seq, num_new_tokens):
            src, dst = seq.block_table[i], self._take()
            self.ref_counts[src] -= 1
            seq.block_table[i] = dst
            copies.append((src, dst))
        self.num_cow_copies += len(copies)
        seq.block_table.extend(self._take()
                               for _ in range(self._num_missing_blocks(seq, num_new_tokens)))
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Makes `child` share every block of `parent` (one more reference each)."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        total = self.num_blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def _shared_blocks_written(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Indices in `seq`'s block table of shared blocks that the new tokens land in."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_table),
                   self.num_blocks_needed(seq.num_computed_tokens + num_new_tokens))
        return [i for i in range(first, last) if self.ref_counts[seq.block_table[i]] > 1]

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s reference to each of its blocks; unreferenced blocks become free."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []

    def _take(self) -> int:
        if not self.free_block_ids:
            raise RuntimeError("no free KV blocks")
        block_id = self.free_block_ids.popleft()
        assert self.ref_counts[block_id] == 0, block_id
        self.ref_counts[block_id] = 1
        return block_id
