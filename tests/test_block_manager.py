"""Block manager and scheduler without a model: exact block ids, free order, queue moves."""

import pytest

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.worker.buckets import bucket
from jaxpaged.config import SchedulerConfig
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.sequence import Sequence, SequenceStatus


def seq(num_tokens, max_tokens=16):
    return Sequence("r", 0, list(range(num_tokens)), SamplingParams(max_tokens=max_tokens), 0)


def test_allocate_takes_blocks_in_free_list_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(5), seq(4)
    assert bm.allocate(a) is not None
    bm.allocate(b)
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert bm.num_free_blocks == 5
    assert bm.ref_counts[:3] == [1, 1, 1]


def test_append_takes_a_block_only_at_a_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(3)
    bm.allocate(s)
    s.num_computed_tokens = 3
    s.token_ids.append(7)  # 4th token: still fits block 0
    bm.append_slots(s, 1)
    assert s.block_table == [0]
    s.num_computed_tokens = 4
    s.token_ids.append(8)  # 5th token needs a second block
    assert bm.can_append(s, 1)
    bm.append_slots(s, 1)
    assert s.block_table == [0, 1]


def test_free_returns_blocks_and_reuse_order_is_fifo():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = seq(4), seq(2)
    bm.allocate(a)  # [0, 1]
    bm.allocate(b)  # [2]
    bm.free(a)  # free list: 3, 1, 0
    assert a.block_table == [] and bm.num_free_blocks == 3
    c = seq(6)
    bm.allocate(c)
    assert c.block_table == [3, 1, 0]
    assert bm.ref_counts == [1, 1, 1, 1]


def test_allocate_without_room_returns_none_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=2)
    s = seq(5)
    assert bm.allocate(s) is None
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_allocate_twice_raises():
    bm = BlockManager(num_blocks=4, block_size=2)
    s = seq(3)
    assert bm.allocate(s) == [0, 1]
    with pytest.raises(RuntimeError, match="already holds blocks"):
        bm.allocate(s)


def make_scheduler(num_blocks=16, block_size=4, padded_tokens=None, **kwargs):
    kwargs.setdefault("max_model_len", 32)
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**kwargs), bm, padded_tokens=padded_tokens), bm


def run_decode_tokens(out):
    """What the engine does after a step: count computed tokens, append a dummy token."""
    for s, q in zip(out.seqs, out.num_scheduled_tokens):
        s.num_computed_tokens += q
        s.token_ids.append(1)


def test_prefill_respects_max_num_seqs_and_token_budget():
    sched, _ = make_scheduler(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=32)
    seqs = [seq(10), seq(10), seq(10)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.seqs == seqs[:2] and out.num_scheduled_tokens == [10, 10]
    assert list(sched.waiting) == seqs[2:]
    run_decode_tokens(out)
    out = sched.schedule()  # max_num_seqs reached: decode
    assert out.seqs == seqs[:2] and out.num_scheduled_tokens == [1, 1]


def test_a_parent_holds_seats_for_its_forks_until_they_exist():
    """n=2: the parent's child is forked only after its prompt is computed, so until then the
    parent counts twice against max_num_seqs (this once let 3 sequences run with a limit of 2)."""
    sched, _ = make_scheduler(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=8)
    parent, other = seq(10), seq(3)
    parent.num_forks = 1
    sched.add(parent)
    sched.add(other)
    out = sched.schedule()  # the parent's first chunk of 8; the other may not join
    assert out.seqs == [parent] and out.num_scheduled_tokens == [8]
    assert list(sched.waiting) == [other]
    run_decode_tokens(out)
    out = sched.schedule()  # still chunking: two seats held, none free
    assert out.seqs == [parent] and list(sched.waiting) == [other]


@pytest.mark.parametrize("max_num_partial_prefills", [1, 2])
def test_chunked_prefill_cuts_prompts_to_the_budget_and_decodes_go_first(
        max_num_partial_prefills):
    sched, _ = make_scheduler(max_num_seqs=8, max_model_len=32, max_num_batched_tokens=16,
                              max_num_partial_prefills=max_num_partial_prefills,
                              long_prefill_token_threshold=3)
    a, b = seq(10), seq(10)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # nothing decodes, so no cap: a whole, then b's first 6 tokens
    assert out.seqs == [a, b] and out.num_scheduled_tokens == [10, 6]
    assert out.completes(0) and not out.completes(1)
    a.num_computed_tokens += 10
    a.token_ids.append(1)
    b.num_computed_tokens += 6
    c = seq(20)
    sched.add(c)
    # a decodes: a's decode first, then at most 3 prompt tokens for each of at most
    # max_num_partial_prefills prompts (b's, then c's)
    out = sched.schedule()
    if max_num_partial_prefills == 1:
        assert out.seqs == [a, b] and out.num_scheduled_tokens == [1, 3]
        assert list(sched.waiting) == [c]
    else:
        assert out.seqs == [a, b, c] and out.num_scheduled_tokens == [1, 3, 3]
    assert out.completes(0) and not out.completes(1)


@pytest.mark.parametrize("max_num_partial_prefills, expected", [(1, [1] * 5 + [7]),
                                                                  (2, [1] * 5 + [7, 4])])
def test_capped_prompt_chunks_take_the_padding_of_the_step(max_num_partial_prefills, expected):
    """With the packed layout's padding (`buckets.bucket`), 5 decodes and a threshold of 4 make
    9 tokens of a padded 12 (partial prefills 1) or 13 of 16 (2): the capped chunks take the
    rest, the first prompt first."""
    sched, _ = make_scheduler(num_blocks=32, max_num_seqs=8, max_model_len=32,
                              max_num_batched_tokens=16, long_prefill_token_threshold=4,
                              max_num_partial_prefills=max_num_partial_prefills,
                              padded_tokens=bucket)
    decoding = [seq(2) for _ in range(5)]
    for s in decoding:
        sched.add(s)
    run_decode_tokens(sched.schedule())
    b, c = seq(20), seq(20)
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    assert out.seqs[:5] == decoding and out.num_scheduled_tokens == expected
    assert sum(expected) == bucket(5 + 4 * max_num_partial_prefills)


def test_prompt_logprobs_requests_are_never_chunked():
    sched, _ = make_scheduler(max_num_seqs=8, max_model_len=32, max_num_batched_tokens=16)
    a = seq(10)
    b = Sequence("r", 0, list(range(10)), SamplingParams(prompt_logprobs=1), 0)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # b would need a chunk: it waits for a step with room
    assert out.seqs == [a] and list(sched.waiting) == [b]


def test_finished_sequence_is_replaced_next_step():
    sched, bm = make_scheduler(max_num_seqs=1)
    a, b = seq(3), seq(3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a]
    run_decode_tokens(out)
    sched.finish(a, "length")
    assert a.status is SequenceStatus.FINISHED and bm.num_free_blocks == 16
    out = sched.schedule()
    assert out.seqs == [b] and out.num_scheduled_tokens == [3]


def test_decode_preempts_most_recent_sequence_when_blocks_run_out():
    sched, bm = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    a, b = seq(4), seq(4)  # 2 blocks each: the pool is full after both prefills
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a, b]
    run_decode_tokens(out)  # each now has 5 tokens, 4 computed; block 3 of each needed
    out = sched.schedule()
    assert out.preempted == [b] and out.seqs == [a]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and list(sched.waiting) == [b]
    assert a.block_table == [0, 1, 3] and sched.num_preemptions == 1
    assert b.token_ids[-1] == 1  # its generated token is kept for the recompute


def test_update_from_output_books_the_step_except_for_faulted_requests():
    """The scheduler advances num_computed_tokens (and caches the blocks that became full); a
    request a fault was traced to keeps its state, and its K/V never reach the prefix cache."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_model_len=32), bm)
    a = Sequence("a", 0, list(range(9)), SamplingParams(), 0)
    b = Sequence("b", 0, list(range(100, 109)), SamplingParams(), 0)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == [9, 9]
    update = sched.update_from_output(out, [[], []], {"b"})
    assert update.num_prompt_tokens == 9  # a's prompt tokens, not b's
    assert (a.num_computed_tokens, b.num_computed_tokens) == (9, 0)
    assert sorted(bm.cached_block_ids.values()) == a.block_table[:2]


def test_update_from_output_appends_forks_and_finishes():
    """The scheduler appends each row's sampled tokens, forks a request's other completions
    after its prompt, and finishes a sequence on EOS, a stop token (after min_tokens) or its
    length; a prompt chunk with more to come appends nothing."""
    from types import SimpleNamespace as Tok

    bm = BlockManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=12, max_num_batched_tokens=8), bm,
                      eos_token_ids={2})
    eos = Sequence("eos", 0, [5, 6, 7], SamplingParams(max_tokens=5), 0)
    stop = Sequence("stop", 0, [5, 6], SamplingParams(stop_token_ids=[9], min_tokens=2), 0)
    n2 = Sequence("n2", 0, [5] * 3, SamplingParams(n=2, max_tokens=2), 7)
    n2.num_forks = 1
    long = Sequence("long", 0, list(range(10)), SamplingParams(), 0)
    for s in (eos, stop, n2, long):
        sched.add(s)
    out = sched.schedule()
    assert out.seqs == [eos, stop, n2] and out.num_scheduled_tokens == [3, 2, 3]
    update = sched.update_from_output(out, [[Tok(token_id=4, logprob=-1.0)],
                                            [Tok(token_id=9, logprob=-2.0)],
                                            [Tok(token_id=3, logprob=-0.5),
                                             Tok(token_id=8, logprob=-0.25)]])
    assert update.num_prompt_tokens == 8
    (_, [(a, _)]), (_, [(b, _)]), (_, [(c, _), (child, _)]) = update.appended
    assert (a, b, c) == (eos, stop, n2) and child.index == 1 and child.seed == 8
    assert child in sched.running and child.block_table == n2.block_table
    assert (n2.output_token_ids, child.output_token_ids) == ([3], [8])
    assert (n2.cumulative_logprob, child.cumulative_logprob) == (-0.5, -0.25)
    assert not stop.is_finished  # 9 is a stop token, but min_tokens=2 holds it back
    out = sched.schedule()
    assert out.seqs == [eos, stop, n2, child, long] and out.num_scheduled_tokens[-1] == 4
    sampled = [[Tok(token_id=t, logprob=0.0)] for t in (2, 9, 1, 4)] + [[]]
    sched.update_from_output(out, sampled)
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    assert (stop.finish_reason, stop.stop_reason) == ("stop", 9)
    assert n2.finish_reason == child.finish_reason == "length"  # max_tokens=2
    assert long.output_token_ids == [] and long.num_computed_tokens == 4
    assert sched.running == [long]
