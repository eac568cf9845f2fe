"""Multi-step decoding (`num_scheduler_steps`; a k-step decode is one `ModelRunner.launch`
whose program, `StepPrograms.run_steps`, runs k steps): k decode steps in one device call give
the outputs of k single steps (greedy ids equal, cumulative logprobs within 1e-4) across a
waiting queue, chunked prefill, preemption, stop tokens and strings, forked completions and
requests it does not apply to; the scheduler books k tokens' slots and gives back those a
stopped sequence leaves. KV blocks are all free after each engine (`make_llm`'s leak check)."""

from __future__ import annotations

import pytest

from jaxpaged import SamplingParams
from jaxpaged.config import SchedulerConfig
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.sequence import Sequence
from jaxpaged.sample.sampler import SampledToken
from output_utils import assert_idle, assert_same_outputs

K = 4
PROMPTS = [{"prompt_token_ids": ids} for ids in (
    [5, 6, 7, 8, 9, 10], list(range(3, 43)), [42] * 9, [7, 8, 9], list(range(100, 170)),
    [11, 12])]
MAX_TOKENS = [9, 17, 3, 30, 12, 22]


@pytest.fixture(scope="module")
def single_step_llm(tiny_model_dir):
    """One engine decoding one step a call (max_num_seqs 8): the references of the tests below
    that run at those limits. No prefix cache: each reference computes its prompts afresh, as
    the multi-step engine it is compared with (logprobs are compared exactly)."""
    from jaxpaged import LLM
    return LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=256, max_num_seqs=8,
               num_scheduler_steps=1, enable_prefix_caching=False, precompile=False)


def _single_steps(llm, params):
    """The outputs of `llm` (one step a call) for PROMPTS[:len(params)], leak-checked."""
    outs = llm.generate(PROMPTS[:len(params)], params, use_tqdm=False)
    assert_idle(llm)
    return outs


def _generate(make_llm, model_dir, params, k, **kwargs):
    """(outputs, whether a multi-step call ran) of one engine with `num_scheduler_steps=k`."""
    llm = make_llm(model_dir, num_scheduler_steps=k, **kwargs)
    outs = llm.generate(PROMPTS[:len(params)], params, use_tqdm=False)
    runner = llm.llm_engine.runner
    return outs, runner.num_multi_step_executables > 0


# A plain batch is tests/test_step_modes.py's k-step case.
@pytest.mark.parametrize("options", [
    # a queue (2 seats), prompts chunked over several steps, and 7 blocks of 16 tokens for
    # sequences of up to 82: lookahead that does not fit, and a preemption (asserted below)
    dict(max_num_seqs=2, max_num_batched_tokens=16, long_prefill_token_threshold=8,
         num_kv_blocks=7, max_model_len=96),
    # an 8-bit pool (codes and scales carried through the scan) and W8A8 weights
    dict(max_num_seqs=8, kv_cache_dtype="int8", quantization="w8a8"),
], ids=["queue-chunks-and-preemption", "8-bit"])
def test_multi_step_gives_the_outputs_of_single_steps(make_llm, tiny_model_dir, options):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    ref, ran = _generate(make_llm, tiny_model_dir, params, 1, **options)
    assert not ran
    outs, ran = _generate(make_llm, tiny_model_dir, params, K, **options)
    assert ran
    assert_same_outputs(outs, ref)
    if "num_kv_blocks" in options:
        assert make_llm.built[-1].llm_engine.scheduler.num_preemptions > 0


def test_multi_step_stops_where_single_steps_stop(make_llm, tiny_model_dir, single_step_llm):
    """Stop tokens and stop strings met inside a multi-step call end the output at the same
    token, the text cut as before; the draws after it are dropped."""
    base = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    free = _single_steps(single_step_llm, base)
    params = []
    for i, (o, p) in enumerate(zip(free, base)):
        ids, text = o.outputs[0].token_ids, o.outputs[0].text
        if i % 2 and len(ids) > 6:  # a stop token, the 6th drawn (its first occurrence)
            params.append(SamplingParams(temperature=0, max_tokens=p.max_tokens,
                                         stop_token_ids=[ids[5]]))
        elif len(text) > 8:  # a stop string from the middle of the text
            params.append(SamplingParams(temperature=0, max_tokens=p.max_tokens,
                                         stop=[text[len(text) // 2:len(text) // 2 + 3]]))
        else:
            params.append(p)
    ref = _single_steps(single_step_llm, params)
    outs, ran = _generate(make_llm, tiny_model_dir, params, K, max_num_seqs=8)
    assert ran
    assert_same_outputs(outs, ref)
    assert any(o.outputs[0].finish_reason == "stop" for o in ref)


def test_multi_step_decodes_forked_completions(make_llm, tiny_model_dir, single_step_llm):
    """n = 3 greedy completions share their prompt's blocks: the lookahead slots copy the
    shared last block (copy-on-write) before the call, and each completion equals the others."""
    params = [SamplingParams(temperature=0, n=3, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)]
    ref = _single_steps(single_step_llm, params)
    outs, ran = _generate(make_llm, tiny_model_dir, params, K, max_num_seqs=8)
    assert ran
    assert_same_outputs(outs, ref)


def test_requests_that_sample_run_single_steps_beside_greedy_ones(make_llm, tiny_model_dir,
                                                                 single_step_llm):
    """Seeded sampling, logprobs and min_tokens need the sampler: a batch holding such a
    request decodes one step at a time (the same outputs as without multi-step), and greedy
    requests alone run several in a row."""
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=2, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=3, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    ref = _single_steps(single_step_llm, params)
    outs, ran = _generate(make_llm, tiny_model_dir, params, K, max_num_seqs=8)
    assert_same_outputs(outs, ref)
    assert outs[1].outputs[0].logprobs == ref[1].outputs[0].logprobs
    # The greedy request runs on for 6 tokens after the others finish: multi-step then.
    assert ran


def test_llm_decodes_8_steps_a_call_unless_told_and_serving_1(tiny_llm):
    from jaxpaged.engine.arg_utils import EngineArgs

    assert tiny_llm.llm_engine.scheduler_config.num_scheduler_steps == 8
    assert tiny_llm.llm_engine.runner.num_scheduler_steps == 8
    assert tiny_llm.engine_args.num_scheduler_steps is None  # as given (a manifest's)
    config = EngineArgs(model=tiny_llm.llm_engine.model_dir).create_engine_config()
    assert config.scheduler.num_scheduler_steps == 1  # the server's engine


def test_bad_num_scheduler_steps_is_named():
    with pytest.raises(ValueError, match="num_scheduler_steps must be an int >= 1, got 0"):
        SchedulerConfig(max_model_len=64, num_scheduler_steps=0)


def _running(sched: Scheduler, n: int, prompt_len: int, max_tokens: int) -> list[Sequence]:
    """n sequences admitted and past their prefill (one token drawn each)."""
    seqs = [Sequence(f"r{i}", 0, list(range(1, prompt_len + 1)),
                     SamplingParams(temperature=0, max_tokens=max_tokens), seed=0)
            for i in range(n)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert out.num_steps == 1
    sched.update_from_output(out, [[SampledToken(100, -1.0, 1, None)] for _ in seqs])
    return seqs


def test_scheduler_books_k_slots_and_gives_back_a_stopped_sequences():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_scheduler_steps=K), bm,
                      eos_token_ids={2})
    a, b = _running(sched, 2, prompt_len=7, max_tokens=20)
    out = sched.schedule()
    assert out.num_steps == K and out.seqs == [a, b] and out.num_scheduled_tokens == [1, 1]
    # 8 tokens, K more computed from position 7: slots up to 7 + K = 11 tokens, 3 blocks each
    assert len(a.block_table) == len(b.block_table) == 3
    draws = [[SampledToken(t, -0.5, 1, None) for t in ts] for ts in ([3, 4, 5, 6], [3, 2, 9, 9])]
    update = sched.update_from_output(out, draws)
    assert a.output_token_ids == [100, 3, 4, 5, 6] and a.num_computed_tokens == 7 + K
    assert [t.token_id for _, t in update.appended[1][1]] == [3, 2]  # EOS ends b: 9 9 dropped
    assert b.is_finished and b.finish_reason == "stop" and b.block_table == []
    assert bm.num_free_blocks == 16 - len(a.block_table)


def test_scheduler_runs_single_steps_while_a_sequence_cannot_take_k():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=9, num_scheduler_steps=K), bm)
    short, = _running(sched, 1, prompt_len=6, max_tokens=20)  # room for 2 before max_model_len
    assert sched.schedule().num_steps == 1
    sched.finish(short, "abort")
    seq, = _running(sched, 1, prompt_len=3, max_tokens=20)
    sched.add(Sequence("w", 0, [1, 2, 3], SamplingParams(max_tokens=5), seed=0))
    assert sched.schedule().num_steps == 1  # something waits: it joins the next step


def test_a_sequence_reaching_max_tokens_in_a_call_drops_its_later_draws():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_model_len=64, num_scheduler_steps=K), bm)
    a, b = _running(sched, 2, prompt_len=7, max_tokens=20)
    b.params = SamplingParams(temperature=0, max_tokens=3)  # 2 tokens left: fewer than K
    out = sched.schedule()
    assert out.num_steps == K
    draws = [[SampledToken(t, -0.5, 1, None) for t in (5, 6, 7, 8)] for _ in range(2)]
    sched.update_from_output(out, draws)
    assert a.output_token_ids == [100, 5, 6, 7, 8]
    assert b.output_token_ids == [100, 5, 6] and b.finish_reason == "length"
    assert bm.num_free_blocks == 16 - len(a.block_table)
