"""Memory sharing (PagedAttention section 4.4): n completions fork from one prefill and share the
prompt's blocks by reference count; a shared block is copied only when written (copy-on-write)."""

from jaxpaged import SamplingParams
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.sequence import Sequence


def test_fork_shares_blocks_and_copy_on_write_copies_only_the_written_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent = Sequence("r", 0, list(range(10)), SamplingParams(), 0)  # blocks: full, full, 2/4
    bm.allocate(parent)
    parent.num_computed_tokens = 10
    child = parent.fork(index=1, seed=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table == [0, 1, 2]
    assert bm.ref_counts[:3] == [2, 2, 2] and bm.num_shared_blocks == 3
    for s in (parent, child):
        s.token_ids.append(99)
    assert bm.append_slots(child) == [(2, 3)]  # the partly filled block is copied, once
    assert child.block_table == [0, 1, 3] and bm.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.append_slots(parent) == []  # now its only holder: written in place
    assert parent.block_table == [0, 1, 2] and bm.num_cow_copies == 1
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 10 and bm.ref_counts == [0] * 10


def test_n_samples_share_prompt_blocks_and_equal_lone_seeded_runs(make_llm, tiny_model_dir):
    S, n, seed, max_tokens = 8, 4, 11, 14
    llm = make_llm(tiny_model_dir, block_size=S, num_kv_blocks=64)
    engine = llm.llm_engine
    prompt = "a prompt of some twenty tokens, give or take a few, to span three blocks"
    P = len(engine.tokenizer(prompt).input_ids)
    assert P % S and P > 2 * S  # full prompt blocks to share, and a partly filled one
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens,
                            ignore_eos=True)
    engine.add_request(prompt, params, request_id="shared")
    final, checked = None, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        seqs = engine.scheduler.running
        stats = engine.stats()
        if len(seqs) == n and seqs[0].num_output_tokens == 1:  # just forked: all blocks shared
            assert stats["num_used_blocks"] == stats["num_shared_blocks"] == -(-P // S)
        elif len(seqs) == n:  # decoding: the pool holds K/V of num_tokens - 1 tokens
            stored = seqs[0].num_tokens - 1
            own = -(-stored // S) - P // S  # blocks past the full prompt blocks, per sample
            assert stats["num_used_blocks"] == P // S + n * own
            assert stats["num_used_blocks"] < n * -(-stored // S)
            assert stats["num_shared_blocks"] == P // S
            checked += 1
        final = outputs[0] if outputs and outputs[0].finished else final
    assert checked >= max_tokens - 3
    assert engine.stats()["num_cow_copies"] == n - 1  # the partly filled prompt block
    samples = [c.token_ids for c in final.outputs]
    assert [c.index for c in final.outputs] == list(range(n))
    assert len(set(map(tuple, samples))) > 1
    for j, ids in enumerate(samples):  # each equals a lone request seeded seed + j
        alone = SamplingParams(temperature=1.0, seed=seed + j, max_tokens=max_tokens,
                               ignore_eos=True)
        assert llm.generate(prompt, alone, use_tqdm=False)[0].outputs[0].token_ids == ids
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples
