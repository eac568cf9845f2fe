"""KV block manager: a free list of physical blocks with reference counts.

The host-side half of PagedAttention (paper, section 4.2): a sequence holds a block table of
physical block ids, one per `block_size` tokens; blocks are taken from the free list as its tokens
arrive and go back when it finishes or is preempted. A reference count per block lets several
sequences hold the same block (memory sharing, section 4.4); a block returns to the free list when
its last reference goes.

Automatic prefix caching (vLLM's design): a full block whose K/V are computed is registered under
a hash of its parent block's hash and its own token ids, so the hash names the whole prefix up to
and including the block. A new sequence looks up the hashes of its leading full blocks and shares
the longest run that is cached (one more reference each), so only the rest of its prompt is
computed. A cached block whose last reference goes stays cached, in an LRU list of evictable
blocks; it is evicted (its hash dropped, its memory reused) only when the free list is empty,
least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from jaxpaged.core.sequence import Sequence


class BlockManager:
    """Allocates physical KV blocks to sequences.

    `allocate` gives a sequence's prompt (or its recompute after preemption) its blocks, or
    returns None when they do not fit, in one look at the prefix cache. New tokens go through the
    check/act pair `can_append` / `append_slots` (which raises RuntimeError if its check would
    have failed), and `free` ends a sequence.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # hold nothing cached
        self.ref_counts = [0] * num_blocks
        self.num_cow_copies = 0  # blocks copied on write since start
        # Prefix cache: hash -> block, the reverse, and unreferenced cached blocks in LRU order.
        self.cached_block_ids: dict[int, int] = {}
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.evictable_block_ids: OrderedDict[int, None] = OrderedDict()
        self.num_cache_queries = 0  # prompt blocks looked up, and found, since start
        self.num_cache_hits = 0
        # Bumped by a forced reset (new weights): a sequence allocated before it registers
        # none of its later blocks, whose K/V it computes over the old weights' context.
        self.cache_epoch = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: free, or cached with no reference (evictable)."""
        return len(self.free_block_ids) + len(self.evictable_block_ids)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one sequence."""
        return sum(1 for r in self.ref_counts if r > 1)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def allocate(self, seq: Sequence) -> list[int] | None:
        """Gives `seq` (holding no blocks) blocks for all its current tokens and returns its
        block table; returns None, changing nothing, when they do not fit.

        With prefix caching, the blocks of its longest cached prefix are shared and
        `seq.num_computed_tokens` starts past them (at least one token is left to compute, so
        the step yields the logits of the last one).

        Raises:
          RuntimeError: `seq` already holds blocks.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks {seq.block_table}")
        hits = self._cached_prefix(seq)
        num_revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # evictable now
        if (self.num_blocks_needed(seq.num_tokens) - len(hits) + num_revived
                > self.num_free_blocks):
            return None
        if self.enable_prefix_caching and seq.num_output_tokens == 0:
            self.num_cache_queries += self._num_cacheable_blocks(seq)
            self.num_cache_hits += len(hits)
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self.evictable_block_ids[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = hits + [self._take() for _ in
                                  range(self.num_blocks_needed(seq.num_tokens) - len(hits))]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        seq.cache_epoch = self.cache_epoch
        if seq.num_cached_tokens is None:  # the first allocation, not a recompute
            seq.num_cached_tokens = seq.num_computed_tokens
        return seq.block_table

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forgets every cached block; False (and nothing done) while any block is in use,
        unless `force`: then blocks in use are forgotten too (no later sequence shares them;
        they are freed as any other block when their sequences end). New weights make every
        cached K/V stale (`LLMEngine.update_params`)."""
        if any(self.ref_counts) and not force:
            return False
        if force:
            self.cache_epoch += 1
        self.free_block_ids.extend(self.evictable_block_ids)
        self.evictable_block_ids.clear()
        self.cached_block_ids.clear()
        self.block_hashes = [None] * self.num_blocks
        return True

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` that `allocate` would find in the prefix cache now."""
        return len(self._cached_prefix(seq)) * self.block_size

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of `seq`'s longest cached run of leading full blocks, leaving at
        least its last token uncached (for a scoring sequence, the token before the first one
        scored: its logits score that one). None for requests that want prompt logprobs (those
        need every prompt position computed)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits = []
        for h in self._full_block_hashes(seq, self._num_cacheable_blocks(seq)):
            block_id = self.cached_block_ids.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _num_cacheable_blocks(self, seq: Sequence) -> int:
        """Leading full blocks of `seq` the cache may give: those before its last token (for a
        scoring sequence, before the token whose logits score the first scored one)."""
        first_computed = seq.num_tokens - 1 if seq.scoring is None else seq.scoring.start - 1
        return first_computed // self.block_size

    def _full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of `seq`'s first `num_blocks` full blocks, memoized on the sequence:
        block i's hash covers the parent's hash and the block's token ids."""
        S = self.block_size
        while len(seq.block_hashes) < num_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else seq.cache_key
            seq.block_hashes.append(hash((parent, tuple(seq.token_ids[i * S:(i + 1) * S]))))
        return seq.block_hashes[:num_blocks]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers `seq`'s blocks that became full and computed since the last call (none
        if the cache was reset by force since `seq` was allocated)."""
        if not self.enable_prefix_caching or seq.cache_epoch != self.cache_epoch:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:  # no block became full (most steps)
            return
        hashes = self._full_block_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_table[i]
            if hashes[i] not in self.cached_block_ids and self.block_hashes[block_id] is None:
                self.cached_block_ids[hashes[i]] = block_id
                self.block_hashes[block_id] = hashes[i]
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether slots fit for `num_new_tokens` tokens computed past `seq.num_computed_tokens`,
        counting the copies of shared blocks those tokens would be written into."""
        missing, shared = self.append_plan(seq, num_new_tokens)
        return missing + len(shared) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Grows `seq`'s block table to hold `num_computed_tokens + num_new_tokens` tokens.

        A shared block (reference count > 1) about to be written is first copied into a new
        block of `seq`'s own (copy-on-write, PagedAttention section 4.4); full shared blocks are
        never written, so never copied.

        Returns:
          (src, dst) block ids whose contents the runner must copy before the step.

        Raises:
          RuntimeError: not enough free blocks (`can_append` is False).
        """
        copies = self.try_append_slots(seq, num_new_tokens)
        if copies is None:
            raise RuntimeError(f"append_slots for {seq}: not enough free blocks")
        return copies

    def try_append_slots(self, seq: Sequence, num_new_tokens: int = 1
                         ) -> list[tuple[int, int]] | None:
        """`append_slots`, or None (changing nothing) where the blocks do not fit."""
        missing, shared = self.append_plan(seq, num_new_tokens)
        if missing + len(shared) > self.num_free_blocks:
            return None
        copies = []
        for i in shared:
            src, dst = seq.block_table[i], self._take()
            self.ref_counts[src] -= 1
            seq.block_table[i] = dst
            copies.append((src, dst))
        self.num_cow_copies += len(copies)
        seq.block_table.extend(self._take() for _ in range(missing))
        return copies

    def append_plan(self, seq: Sequence, num_new_tokens: int) -> tuple[int, list[int]]:
        """(blocks to add, indices of shared blocks to copy) for `num_new_tokens` more tokens
        computed past `seq.num_computed_tokens`."""
        table, computed = seq.block_table, seq.num_computed_tokens
        needed = -(-(computed + num_new_tokens) // self.block_size)
        last = min(len(table), needed)
        ref_counts = self.ref_counts
        shared = [i for i in range(computed // self.block_size, last)
                  if ref_counts[table[i]] > 1]
        return max(0, needed - len(table)), shared

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Makes `child` share every block of `parent` (one more reference each)."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.cache_epoch = parent.cache_epoch
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1

    def trim(self, seq: Sequence) -> None:
        """Gives back the blocks past those that hold `seq.num_tokens` tokens (slots of rejected
        speculative tokens, `jaxpaged.spec_decode`); the next step appends to the rest."""
        keep = self.num_blocks_needed(seq.num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def _release(self, block_id: int) -> None:
        """Drops one reference to `block_id`: unreferenced, it becomes free, or evictable if
        cached."""
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hashes[block_id] is None:
                self.free_block_ids.append(block_id)
            else:
                self.evictable_block_ids[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s reference to each of its blocks; unreferenced blocks become free, or
        evictable if cached (last block first, so a prefix outlives its tails)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _take(self) -> int:
        """A free block, or else the least recently freed cached one, evicted."""
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        elif self.evictable_block_ids:
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            del self.cached_block_ids[self.block_hashes[block_id]]
            self.block_hashes[block_id] = None
        else:
            raise RuntimeError("no free KV blocks")
        assert self.ref_counts[block_id] == 0, block_id
        self.ref_counts[block_id] = 1
        return block_id
