"""Async scheduling (`async_scheduling`, `jaxpaged.engine.async_scheduling`): step i + 1 launched
before step i's draws are read gives the outputs of the synchronous loop (greedy ids and seeded
samples equal, cumulative logprobs within 1e-4, the same finish reasons and text) across
batching, a waiting queue with chunked prefill, preemption, stop tokens and strings, lengths,
n > 1, logprobs, requests it does not overlap (penalties, prompt logprobs), a speculative
proposer, and faults; each test asserts that steps did overlap where they should. KV blocks are
all free after each engine (`make_llm`'s leak check)."""

from __future__ import annotations

import pytest

from jaxpaged import SamplingParams
from output_utils import assert_same_outputs

PROMPTS = [{"prompt_token_ids": ids} for ids in (
    [5, 6, 7, 8, 9, 10], list(range(3, 43)), [42] * 9, [7, 8, 9], list(range(100, 170)),
    [11, 12])]
MAX_TOKENS = [9, 17, 3, 30, 12, 22]


def _generate(make_llm, model_dir, params, asynchronous, prompts=PROMPTS, **kwargs):
    """(outputs, steps overlapped) of one engine, with or without async scheduling, one step a
    call (multi-step decoding off in both); a step computing a token past a sequence's length
    is noted in `_past_length`."""
    llm = make_llm(model_dir, async_scheduling=asynchronous, num_scheduler_steps=1, **kwargs)
    max_model_len = llm.llm_engine.scheduler_config.max_model_len

    def check_lengths(out):  # no row computes the token after one that ends it by length
        _past_length.extend(seq for seq in out.seqs
                            if seq.num_output_tokens >= seq.params.max_tokens
                            or seq.num_tokens >= max_model_len)

    llm.llm_engine.runner.fault_hook = check_lengths
    outs = llm.generate(prompts[:len(params)], params, use_tqdm=False)
    stepper = llm.llm_engine.async_scheduling
    return outs, 0 if stepper is None else stepper.num_overlapped_steps


_past_length = []  # rows that computed a token past their sequence's max_tokens / max_model_len


def _compare(make_llm, model_dir, params, prompts=PROMPTS, **options):
    ref, overlapped = _generate(make_llm, model_dir, params, False, prompts, **options)
    assert overlapped == 0
    _past_length.clear()
    outs, overlapped = _generate(make_llm, model_dir, params, True, prompts, **options)
    assert_same_outputs(outs, ref)
    assert not _past_length
    return outs, overlapped


GREEDY = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
SEEDED = [SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=i, max_tokens=m,
                         ignore_eos=True) for i, m in enumerate(MAX_TOKENS)]


# Batching, a queue with chunked prefill and preemption, greedy and seeded, are
# tests/test_step_modes.py's async case; here the pool's own length limit.
@pytest.mark.parametrize("options", [
    # the pool's own length limit reached by a sequence: max_model_len 48 with prompts of 70
    # left out
    dict(max_num_seqs=8, max_model_len=48, enable_prefix_caching=False),
], ids=["max-model-len"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_async_gives_the_outputs_of_the_synchronous_loop(make_llm, tiny_model_dir, options,
                                                         sampling):
    params = GREEDY if sampling == "greedy" else SEEDED
    prompts = PROMPTS
    if options.get("max_model_len") == 48:
        prompts = [p for p in PROMPTS if len(p["prompt_token_ids"]) < 40]
        params = [SamplingParams(**{**_kwargs(p), "max_tokens": 64}) for p in params]
    _, overlapped = _compare(make_llm, tiny_model_dir, params[:len(prompts)], prompts, **options)
    assert overlapped > 0
    if "num_kv_blocks" in options:
        assert make_llm.built[-1].llm_engine.scheduler.num_preemptions > 0


def _kwargs(p: SamplingParams) -> dict:
    return dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                ignore_eos=p.ignore_eos)


def test_async_stops_where_the_synchronous_loop_stops(make_llm, tiny_model_dir):
    """Stop tokens and stop strings learned one step late end the output at the same token (the
    token computed after it is dropped), EOS included; the same with n = 3 and logprobs."""
    base = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    free, _ = _generate(make_llm, tiny_model_dir, base, False, max_num_seqs=8)
    params = []
    for i, (o, p) in enumerate(zip(free, base)):
        ids, text = o.outputs[0].token_ids, o.outputs[0].text
        if i == 2:  # three seeded completions forked after the prompt
            params.append(SamplingParams(temperature=0.8, seed=i, n=3, max_tokens=p.max_tokens))
        elif i % 2 and len(ids) > 6:  # a stop token, the 6th drawn (its first occurrence)
            params.append(SamplingParams(temperature=0, max_tokens=p.max_tokens,
                                         stop_token_ids=[ids[5]], logprobs=2))
        elif len(text) > 8:  # a stop string from the middle of the text
            params.append(SamplingParams(temperature=0, max_tokens=p.max_tokens,
                                         stop=[text[len(text) // 2:len(text) // 2 + 3]]))
        else:
            params.append(p)
    outs, overlapped = _compare(make_llm, tiny_model_dir, params, max_num_seqs=8)
    assert overlapped > 0
    assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert any(len(o.outputs) == 3 for o in outs)


def test_requests_it_cannot_overlap_run_synchronously(make_llm, tiny_model_dir, monkeypatch):
    """Penalties (they count output tokens) and prompt logprobs beside plain requests: the
    outputs are the synchronous loop's; steps overlap once those needs are met, and no launched
    step holds a penalized row, or a prompt-logprobs row before its first output."""
    from jaxpaged.engine import async_scheduling

    launched_params, real = [], async_scheduling.book_launched
    # (params, whether the row computed its prompt before any output) of each launched row
    monkeypatch.setattr(async_scheduling, "book_launched", lambda scheduler, out: (
        launched_params.extend((s.params, s.num_output_tokens == 0) for s in out.seqs),
        real(scheduler, out))[1])
    params = list(GREEDY)
    params[1] = SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3,
                               ignore_eos=True)
    params[3] = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1, ignore_eos=True)
    _, overlapped = _compare(make_llm, tiny_model_dir, params, max_num_seqs=8)
    assert overlapped > 0 and launched_params
    # Penalties never overlap; prompt logprobs only once the prompt's step has been read.
    assert not any(p is params[1] or (p is params[3] and before_output)
                   for p, before_output in launched_params)


def test_a_speculative_proposer_runs_synchronously(make_llm, tiny_model_dir):
    """With n-gram speculation the engine steps synchronously: outputs as without async."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    outs, overlapped = _compare(make_llm, tiny_model_dir, params, max_num_seqs=8,
                                speculative_config=spec)
    assert overlapped == 0
    assert make_llm.built[-1].llm_engine.scheduler.num_spec_drafts > 0


def test_aborting_a_request_whose_step_is_in_flight(make_llm, tiny_model_dir):
    """A request aborted while its step runs is dropped when the step's draws are read; the
    others finish as they would, and every block is free after (the leak check)."""
    llm = make_llm(tiny_model_dir, async_scheduling=True, num_scheduler_steps=1, max_num_seqs=8)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    for _ in range(3):
        engine.step()
    assert engine.async_scheduling.in_flight is not None
    engine.abort_request(ids[1])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == sorted([ids[0], ids[2]])
    assert all(len(o.outputs[0].token_ids) == 12 for o in finished.values())


def test_a_fault_at_launch_is_isolated(make_llm, tiny_model_dir):
    """A step that raises for one request (the runner's fault hook, before anything runs) is
    run as the synchronous loop runs it: that request fails, the others give their outputs."""
    ref, _ = _generate(make_llm, tiny_model_dir, GREEDY[:3], False, max_num_seqs=8)
    llm = make_llm(tiny_model_dir, async_scheduling=True, num_scheduler_steps=1, max_num_seqs=8)
    engine = llm.llm_engine
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS[:3], GREEDY[:3])]
    calls = []

    def hook(out):
        calls.append(1)
        if len(calls) == 4 and any(s.request_id == ids[1] for s in out.seqs):
            raise RuntimeError("injected fault")
        if len(calls) > 4 and any(s.request_id == ids[1] for s in out.seqs) and \
                len({s.request_id for s in out.seqs}) == 1:
            raise RuntimeError("injected fault")

    engine.runner.fault_hook = hook
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[ids[1]].error is not None
    for i in (0, 2):
        assert finished[ids[i]].error is None
        assert finished[ids[i]].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert engine.async_scheduling.num_overlapped_steps > 0


def test_multi_step_calls_beside_async_steps(make_llm, tiny_model_dir):
    """With `num_scheduler_steps` 4 too, multi-step calls (nothing waiting, all greedy) run
    synchronously after the step in flight is read; the rest overlap. Outputs as without."""
    # prompts chunked over several steps (they overlap), then decodes alone (multi-step calls)
    ref, _ = _generate(make_llm, tiny_model_dir, GREEDY, False, max_num_seqs=8)
    llm = make_llm(tiny_model_dir, async_scheduling=True, num_scheduler_steps=4, max_num_seqs=8,
                   max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_outputs(outs, ref)
    runner = llm.llm_engine.runner
    assert runner.num_multi_step_executables > 0
    assert llm.llm_engine.async_scheduling.num_overlapped_steps > 0


def test_a_fault_reading_a_step_fails_its_requests(make_llm, tiny_model_dir, monkeypatch):
    """A step whose draws cannot be read (a fault on the device) fails the requests in it; the
    step launched after it is dropped and scheduled again, so a request that joined there
    finishes with the synchronous loop's outputs, and every block is free after."""
    ref, _ = _generate(make_llm, tiny_model_dir, GREEDY[:3], False, max_num_seqs=8)
    llm = make_llm(tiny_model_dir, async_scheduling=True, num_scheduler_steps=1, max_num_seqs=8)
    engine = llm.llm_engine
    first = [engine.add_request(p, params) for p, params in zip(PROMPTS[:2], GREEDY[:2])]
    real, calls = engine.runner.collect, []

    def collect(launched):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device fault")
        return real(launched)

    monkeypatch.setattr(engine.runner, "collect", collect)
    finished = {}
    late = None
    while engine.has_unfinished_requests():
        if len(calls) == 2 and late is None:  # joins the step launched beside the faulty one
            late = engine.add_request(PROMPTS[2], GREEDY[2])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert all(finished[r].error and "injected" in finished[r].error for r in first)
    assert finished[late].error is None
    assert finished[late].outputs[0].token_ids == ref[2].outputs[0].token_ids


@pytest.mark.parametrize("ending", ["abort", "fault"])
def test_forked_completions_end_with_their_request(make_llm, tiny_model_dir, monkeypatch,
                                                  ending):
    """n = 3 forks when its prompt's step is launched, a step before any output lists the
    completions: an abort then, or a fault reading that step, ends all three (no sequence is
    left running, every block free after), and the engine goes on."""
    llm = make_llm(tiny_model_dir, async_scheduling=True, num_scheduler_steps=1, max_num_seqs=8)
    engine = llm.llm_engine
    other = engine.add_request(PROMPTS[0], GREEDY[0])
    for _ in range(3):  # `other` decodes, its steps overlapping
        engine.step()
    forked = engine.add_request(PROMPTS[2], SamplingParams(temperature=0.8, seed=1, n=3,
                                                           max_tokens=6))
    real = engine.runner.collect
    if ending == "fault":
        def collect(launched):
            if any(s.request_id == forked for s in launched.out.seqs):
                raise RuntimeError("injected device fault")
            return real(launched)
        monkeypatch.setattr(engine.runner, "collect", collect)
    engine.step()  # launches the prompt's step: three completions in the scheduler
    assert sum(s.request_id == forked for s in engine.scheduler.running) == 3
    if ending == "abort":
        engine.abort_request(forked)
    finished = {}
    for _ in range(100):  # a left-over completion would keep the engine busy forever
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    if ending == "abort":
        assert finished[other].error is None
    else:  # the fault fails the step's requests (`other` shared it); the engine goes on
        assert "injected" in finished[forked].error
        out = llm.generate([PROMPTS[1]], GREEDY[1], use_tqdm=False)[0]
        assert out.error is None and len(out.outputs[0].token_ids) == GREEDY[1].max_tokens
