"""The runner's persistent input batch: rows that join, leave, change and reorder keep the
arrays a from-scratch build gives (no model)."""

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.core.sequence import Sequence
from jaxpaged.worker.input_batch import InputBatch

S, MAX_BLOCKS, V = 4, 8, 64
EOS = {2}


def make_seq(i, prompt_len=6, **params):
    seq = Sequence(f"r{i}", 0, list(range(10 + i, 10 + i + prompt_len)),
                   SamplingParams(max_tokens=20, **params), seed=100 + i)
    seq.block_table = [10 * i + b for b in range(-(-prompt_len // S))]
    return seq


def scratch_tables(seqs):
    """Each sequence's block table, built from scratch."""
    out = np.zeros((len(seqs), MAX_BLOCKS), np.int32)
    for i, seq in enumerate(seqs):
        out[i, :len(seq.block_table)] = seq.block_table
    return out


def check(batch, seqs):
    rows = batch.sync(seqs, S)
    n = [len(s.block_table) for s in seqs]
    got = batch.block_tables[rows]
    want = scratch_tables(seqs)
    for i in range(len(seqs)):  # only a table's own blocks are read
        np.testing.assert_array_equal(got[i, :n[i]], want[i, :n[i]])
    assert len(set(rows.tolist())) == len(seqs)


def test_rows_joining_leaving_growing_and_reordered_keep_their_block_tables():
    batch = InputBatch(4, MAX_BLOCKS, V)
    a, b, c = make_seq(0), make_seq(1), make_seq(2)
    check(batch, [a, b])
    for seq in (a, b):  # their prompts computed, then decodes that append a block
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids += [5, 6, 7]
        seq.block_table.append(seq.block_table[-1] + 1)
    check(batch, [b, a, c])  # reordered, one joins
    a.block_table[a.num_computed_tokens // S] = 99  # copy-on-write of the block written
    check(batch, [a, c])
    del b.block_table[1:]  # trimmed (rejected proposals)
    b.num_computed_tokens = 4
    check(batch, [c, b])
    # Preempted: blocks freed, then new ones from the start; told or not, the row follows.
    a.num_computed_tokens, a.block_table = 4, [50, 51, 52]
    check(batch, [a, b, c])
    batch.remove([c.seq_id])
    assert c.seq_id not in batch.row_of and batch.num_rows == 2
    check(batch, [c, a])


def test_a_full_batch_drops_the_rows_the_step_does_not_use():
    batch = InputBatch(2, MAX_BLOCKS, V)
    a, b, c = make_seq(0), make_seq(1), make_seq(2)
    check(batch, [a, b])
    check(batch, [c, b])  # a's row goes to c
    assert set(batch.row_of) == {b.seq_id, c.seq_id}
    with pytest.raises(ValueError, match="more than 2"):
        batch.sync([a, b, c], S)


def scratch_dense(samples):
    """The dense arrays as the runner built them on the host before the input batch."""
    R = 1 << (len(samples) - 1).bit_length()
    bias = np.zeros((R, V), np.float32)
    counts, prompt_mask = np.zeros((R, V), np.int32), np.zeros((R, V), bool)
    for i, (_, seq, _, _) in enumerate(samples):
        p = seq.params
        if p.allowed_token_ids is not None:
            bias[i] = -np.inf
            bias[i, p.allowed_token_ids] = 0.0
        for t, v in (p.logit_bias or {}).items():
            bias[i, t] += v
        if seq.num_output_tokens < p.min_tokens:
            bias[i, list(p.stop_token_ids) + ([] if p.ignore_eos else list(EOS))] = -np.inf
        np.add.at(counts[i], seq.output_token_ids, 1)
        prompt_mask[i, seq.token_ids[:seq.num_prompt_tokens]] = True
    return bias, counts, prompt_mask


def test_sampling_metadata_equals_a_from_scratch_build():
    seqs = [make_seq(0, temperature=0.7, top_k=5, logit_bias={3: 1.5, 7: -2.0}),
            make_seq(1, allowed_token_ids=[1, 2, 3], logit_bias={2: 0.5}, seed=3),
            make_seq(2, temperature=0, min_tokens=4, stop_token_ids=[9], repetition_penalty=1.2),
            make_seq(3, presence_penalty=0.5, frequency_penalty=0.1, logprobs_mode="processed")]
    batch = InputBatch(8, MAX_BLOCKS, V, EOS)
    for step in range(3):
        batch.sync(seqs[::-1] if step % 2 else seqs, S)
        samples = [(i, seq, 0, []) for i, seq in enumerate(seqs)] + [(0, seqs[0], 1, [])]
        md = batch.sampling_metadata(samples)
        bias, counts, prompt_mask = scratch_dense(samples)
        np.testing.assert_array_equal(np.asarray(md.logit_bias), bias)
        np.testing.assert_array_equal(np.asarray(md.output_counts), counts)
        np.testing.assert_array_equal(np.asarray(md.prompt_mask), prompt_mask)
        np.testing.assert_array_equal(md.temperature[:5], np.float32([0.7, 1.0, 0.0, 1.0, 0.7]))
        assert md.top_k[0] == 5 and md.top_k[2] == 0  # greedy rows are never truncated
        assert md.seeds[4].tolist() == [101, 0] and md.seeds[0].tolist() == [100, 0]
        assert md.output_index[:5].tolist() == [step] * 5
        assert md.processed_logprobs.tolist() == [False] * 3 + [True] + [False] * 4
        for seq in seqs:  # each draws one token (so min_tokens' mask goes)
            seq.token_ids.append(3 + step)


def test_no_dense_arrays_for_samples_without_bias_or_penalties():
    seqs = [make_seq(0), make_seq(1, temperature=0)]
    batch = InputBatch(4, MAX_BLOCKS, V)
    batch.sync(seqs, S)
    md = batch.sampling_metadata([(i, s, 0, []) for i, s in enumerate(seqs)])
    assert md.logit_bias is None and md.output_counts is None and md.prompt_mask is None


def test_the_scheduler_hands_out_the_sequences_that_left_since_the_last_step():
    from jaxpaged.config import SchedulerConfig
    from jaxpaged.core.block_manager import BlockManager
    from jaxpaged.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=4,
                                      max_num_batched_tokens=64), BlockManager(16, S))
    a, b = make_seq(0), make_seq(1)
    a.block_table = b.block_table = []
    sched.add(a)
    sched.add(b)
    assert sched.schedule().finished_seq_ids == []
    sched.finish(a, "abort")
    out = sched.schedule()
    assert out.finished_seq_ids == [a.seq_id] and out.seqs == [b]
    assert sched.schedule().finished_seq_ids == []  # handed out once
