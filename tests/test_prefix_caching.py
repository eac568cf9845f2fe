"""Automatic prefix caching: block-level bookkeeping without a model (exact block ids, LRU
eviction order), then cached == uncached greedy ids through the engine."""

from jaxpaged import SamplingParams
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.sequence import Sequence


def seq(token_ids, **params):
    return Sequence("r", 0, list(token_ids), SamplingParams(**params), 0)


def computed(bm: BlockManager, s: Sequence) -> None:
    """As after a step that computed every token but the last."""
    s.num_computed_tokens = s.num_tokens - 1
    bm.cache_full_blocks(s)


def test_a_shared_prefix_reuses_full_blocks_and_computes_the_rest():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq(range(10))  # blocks [0-3] [4-7] [8-9]
    bm.allocate(a)
    assert a.block_table == [0, 1, 2] and a.num_computed_tokens == 0
    computed(bm, a)  # 9 computed: two full blocks registered
    b = seq([0, 1, 2, 3, 4, 5, 6, 7, 99, 98, 97])  # same first two blocks
    assert bm.num_cached_prefix_tokens(b) == 8
    bm.allocate(b)
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert b.num_cached_tokens == 8
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    c = seq([0, 1, 2, 3, 50, 51, 52, 53])  # first block only
    bm.allocate(c)
    assert c.block_table == [0, 4] and c.num_cached_tokens == 4


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq(range(9))
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b = seq(range(8))  # exactly two full cached blocks
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and b.block_table == [0, 3]


def test_freed_cached_blocks_are_evicted_lru_only_when_the_free_list_is_empty():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = seq(range(5))  # blocks 0, 1 full; 2 partial
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    # Cached blocks 0, 1 are evictable (counted free); block 2 is plainly free.
    assert bm.num_free_blocks == 4 and list(bm.evictable_block_ids) == [1, 0]
    b = seq([7, 7])  # takes the free list first: block 3, then 2
    bm.allocate(b)
    assert b.block_table == [3]
    c = seq([8, 8, 8, 8, 8])  # needs 3: block 2, then evicts 1 (freed before 0)
    bm.allocate(c)
    assert c.block_table == [2, 1, 0]
    assert bm.cached_block_ids == {}


def test_a_hit_on_an_evictable_block_revives_it():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = seq(range(5))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    b = seq([0, 1, 2, 3, 9])
    assert bm.allocate(b) == [0, 1, 2]
    assert b.block_table == [0, 1, 2] and b.num_cached_tokens == 4
    assert bm.num_free_blocks == 0 and not bm.evictable_block_ids


def test_prompt_logprobs_requests_bypass_the_cache_and_caching_can_be_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(9), prompt_logprobs=1)
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    off = BlockManager(num_blocks=8, block_size=4)
    c = seq(range(9))
    off.allocate(c)
    computed(off, c)
    assert off.cached_block_ids == {} and off.num_cached_prefix_tokens(seq(range(9))) == 0


# -- through the engine ----------------------------------------------------------------------

def test_cache_hits_give_the_same_greedy_ids_as_misses(make_llm, tiny_model_dir):
    prefix = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [prefix + q for q in ("What is 2 + 2?", "Name a color.", "Say hi.")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    uncached = make_llm(tiny_model_dir, enable_prefix_caching=False).generate(
        prompts, params, use_tqdm=False)
    llm = make_llm(tiny_model_dir)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts, params, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    block = llm.llm_engine.cache_config.block_size
    # The repeated prompt hits every full block but the one holding its last token; the others
    # hit the full blocks of the token prefix they share with the first prompt.
    ids = [o.prompt_token_ids for o in rest]
    assert rest[0].num_cached_tokens == (len(ids[0]) - 1) // block * block
    for other, out in zip(ids[1:], rest[1:]):
        shared = next(i for i, (x, y) in enumerate(zip(ids[0], other)) if x != y)
        assert out.num_cached_tokens == shared // block * block > 0
    assert [o.outputs[0].token_ids for o in rest] == [o.outputs[0].token_ids for o in uncached]
    assert first[0].outputs[0].token_ids == uncached[0].outputs[0].token_ids
    stats = llm.stats()
    assert stats["num_prefix_cache_hits"] > 0


def test_reset_prefix_cache_frees_cached_blocks_only_when_idle():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = seq(range(5))
    bm.allocate(a)
    computed(bm, a)
    assert not bm.reset_prefix_cache()  # a still holds its blocks
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.cached_block_ids == {} and not bm.evictable_block_ids
    assert bm.num_free_blocks == 4 and bm.num_cached_prefix_tokens(seq(range(5))) == 0
