"""No request can kill or stall the engine (offline): logprobs=0, more completions than
`max_num_seqs`, non-finite numbers, bounded stop lists matched in time proportional to the new
text, and faults in a step isolated to the request they come from."""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxpaged import (BeamSearchParams, EngineDeadError, InvalidRequestError, SamplingParams)
from jaxpaged.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from jaxpaged.engine.stop_strings import StopStrings, StopStringState
from output_utils import assert_idle

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]


# -- logprobs=0: the sampled token's log-probability, no alternatives -----------------------

def test_logprobs_zero_gives_the_sampled_token_alone(tiny_llm):
    greedy = dict(temperature=0, max_tokens=4)
    [zero, two] = tiny_llm.generate(
        [PROMPTS[0]] * 2, [SamplingParams(logprobs=0, prompt_logprobs=0, **greedy),
                           SamplingParams(logprobs=2, prompt_logprobs=2, **greedy)],
        use_tqdm=False)
    c0, c2 = zero.outputs[0], two.outputs[0]
    assert c0.token_ids == c2.token_ids
    for token, entry0, entry2 in zip(c0.token_ids, c0.logprobs, c2.logprobs):
        assert list(entry0) == [token]
        assert entry0[token].logprob == pytest.approx(entry2[token].logprob, abs=1e-5)
        assert entry0[token].rank == entry2[token].rank == 1  # greedy
    assert c0.cumulative_logprob == pytest.approx(c2.cumulative_logprob, abs=1e-4)
    assert zero.prompt_logprobs[0] is None
    for token, entry0, entry2 in zip(zero.prompt_token_ids[1:], zero.prompt_logprobs[1:],
                                     two.prompt_logprobs[1:]):
        assert list(entry0) == [token]
        assert entry0[token].logprob == pytest.approx(entry2[token].logprob, abs=1e-5)


def test_logprobs_zero_alone_in_a_sampled_batch(tiny_llm):
    """The crash's exact shape: no sample of the step asks for k > 0."""
    [out] = tiny_llm.generate(PROMPTS[1], SamplingParams(n=2, logprobs=0, max_tokens=3, seed=1),
                              use_tqdm=False)
    for c in out.outputs:
        assert [list(entry) for entry in c.logprobs] == [[t] for t in c.token_ids]
        assert c.cumulative_logprob == pytest.approx(
            sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)), abs=1e-4)


# -- requests that could never be scheduled are refused at once -----------------------------

@pytest.mark.parametrize("field,params", [
    ("n", dict(n=9)), ("n", dict(n=1_000_000)), ("best_of", dict(n=2, best_of=300))])
def test_more_completions_than_max_num_seqs_is_refused(tiny_llm, field, params):
    engine = tiny_llm.llm_engine  # max_num_seqs=8
    with pytest.raises(InvalidRequestError, match="max_num_seqs=8") as e:
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, **params))
    assert e.value.param == field
    assert not engine.has_unfinished_requests()
    [ok] = tiny_llm.generate(PROMPTS[0], SamplingParams(n=8, max_tokens=2), use_tqdm=False)
    assert len(ok.outputs) == 8


def test_more_beams_than_max_num_seqs_is_refused(tiny_llm):
    with pytest.raises(InvalidRequestError, match="max_num_seqs=8") as e:
        tiny_llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=9, max_tokens=2))
    assert e.value.param == "beam_width"


@pytest.mark.parametrize("field,value", [
    ("temperature", math.inf), ("temperature", math.nan), ("repetition_penalty", 1e309),
    ("top_p", math.nan), ("logit_bias", {5: math.inf}), ("presence_penalty", -math.inf)])
def test_non_finite_numbers_are_refused(field, value):
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_stop_list_is_bounded():
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)
    for stop in (["x"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_STRING_CHARS + 1)],
                 ["s" * 200 + str(i) for i in range(10_000)]):
        with pytest.raises(InvalidRequestError, match="at most") as e:
            SamplingParams(stop=stop)
        assert e.value.param == "stop"


def test_out_of_vocabulary_ids_name_their_field(tiny_llm):
    engine = tiny_llm.llm_engine
    for field, value in [("stop_token_ids", [3, 49152]), ("logit_bias", {49152: 1.0}),
                         ("allowed_token_ids", [49999])]:
        with pytest.raises(InvalidRequestError, match="49") as e:
            engine.add_request(PROMPTS[0], SamplingParams(**{field: value}))
        assert e.value.param == field
    assert not engine.has_unfinished_requests()


def test_a_preempted_prompt_logprobs_request_is_not_stuck(tight_llm):
    """Found by the property test below: a request with prompt_logprobs, preempted once its
    prompt and output exceeded max_num_batched_tokens, waited at the head of the queue forever
    (its recompute was held to one unchunked step)."""
    llm = tight_llm  # 12 blocks of 16 tokens, 48-token steps: at 97 tokens each needs a 7th
    engine = llm.llm_engine
    preemptions = engine.scheduler.num_preemptions
    greedy = dict(temperature=0, ignore_eos=True)
    first = engine.add_request({"prompt_token_ids": list(range(200, 230))},
                               SamplingParams(max_tokens=90, **greedy))
    engine.step()  # admitted first, so the other one is the preemption victim
    scored = SamplingParams(max_tokens=70, prompt_logprobs=1, **greedy)
    second = engine.add_request({"prompt_token_ids": list(range(100, 130))}, scored)
    finished = {}
    for _ in range(1000):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if len(finished) == 2:
            break
    assert sorted(finished) == sorted([first, second])
    assert engine.scheduler.num_preemptions > preemptions
    [alone] = llm.generate({"prompt_token_ids": list(range(100, 130))}, scored, use_tqdm=False)
    assert finished[second].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(finished[second].prompt_logprobs) == 30
    assert_idle(llm)


# -- stop strings: the automaton equals a plain search ----------------------------------------

def _naive(stops: list[str], text: str, window: tuple[int, int]) -> tuple[int, int] | None:
    """The earliest-starting stop string whose end lies in the window (lo, hi]; the shortest
    of those starting there (it is completed first)."""
    best = None
    for stop in stops:
        for start in range(len(text) - len(stop) + 1):
            stop_end = start + len(stop)
            if text[start:stop_end] == stop and window[0] < stop_end <= window[1]:
                best = min(best or (start, len(stop)), (start, len(stop)))
    return best


def _naive_held_back(stops: list[str], text: str) -> int:
    return max([n for stop in stops for n in range(1, len(stop))
                if n <= len(text) and text.endswith(stop[:n])], default=0)


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text("ab\u00e9", min_size=1, max_size=5), min_size=1, max_size=6),
       chunks=st.lists(st.text("ab\u00e9c", max_size=4), max_size=12))
@example(stops=["abcd", "c"], chunks=["abcd"])  # a longer string starting earlier wins
@example(stops=["aa", "a"], chunks=["aa"])  # a tie: the shorter is completed first
def test_stop_automaton_equals_a_plain_search(stops, chunks):
    state, text = StopStringState(StopStrings(stops)), ""
    for chunk in chunks:
        text += chunk
        found = state.feed(chunk, len(text))
        assert found == _naive(stops, text, (len(text) - len(chunk), len(text)))
        assert state.num_held_back == _naive_held_back(stops, text)


def test_stop_strings_cut_the_text_as_before(tiny_llm):
    [ref] = tiny_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24),
                              use_tqdm=False)
    text = ref.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    many = [f"never {i}" for i in range(MAX_STOP_STRINGS - 1)] + [stop]
    for include in (False, True):
        [out] = tiny_llm.generate(PROMPTS[2], SamplingParams(
            temperature=0, max_tokens=24, stop=many, include_stop_str_in_output=include),
            use_tqdm=False)
        c = out.outputs[0]
        cut = text.index(stop) + (len(stop) if include else 0)
        assert (c.text, c.finish_reason, c.stop_reason) == (text[:cut], "stop", stop)


# -- fault isolation --------------------------------------------------------------------------

def _fault_for_seed(seed: int):
    def hook(out):
        if any(s.params.seed == seed for s in out.seqs):
            raise RuntimeError(f"injected fault (seed {seed})")
    return hook


# Every kind of pool: float, and 8-bit (codes and scales), whose faults used to read as a lost
# pool and kill the engine.
POOL_DTYPES = ["auto", "int8", "fp8"]


@pytest.mark.parametrize("kv_cache_dtype", POOL_DTYPES)
def test_a_step_fault_fails_only_its_request(make_llm, tiny_model_dir, kv_cache_dtype):
    llm = make_llm(tiny_model_dir, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
    good = [SamplingParams(temperature=0, max_tokens=12),
            SamplingParams(n=2, max_tokens=12, seed=5)]
    ref = llm.generate(PROMPTS[:2], good, use_tqdm=False)
    llm.llm_engine.runner.fault_hook = _fault_for_seed(666)
    bad = SamplingParams(max_tokens=12, seed=666)
    outs = llm.generate(PROMPTS, good + [bad], use_tqdm=False)
    assert [[c.text for c in o.outputs] for o in outs[:2]] == \
        [[c.text for c in r.outputs] for r in ref]
    assert all(o.error is None for o in outs[:2])
    failed = outs[2]
    assert failed.finished and "injected fault (seed 666)" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    # The engine goes on serving, and the failed request left no block behind.
    assert llm.generate(PROMPTS[0], good[0], use_tqdm=False)[0].outputs[0].text == \
        ref[0].outputs[0].text
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_failed_requests"] == 1


def test_a_fault_without_any_request_is_fatal(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, max_num_seqs=8)  # tiny_llm's limits: its programs

    def always(out):
        raise RuntimeError("injected fault in every step")

    llm.llm_engine.runner.fault_hook = always
    with pytest.raises(EngineDeadError, match="recurs on a step without any request"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.llm_engine.runner.fault_hook = None
    with pytest.raises(EngineDeadError):  # it stays dead
        llm.generate(PROMPTS[1], SamplingParams(max_tokens=4), use_tqdm=False)


def test_a_request_that_always_fails_never_stops_the_engine(make_llm, tiny_model_dir):
    """Alone in the engine, retried (as OpenAI's SDK retries a 500): each try fails alone, the
    padding-only probe passes, and the engine goes on."""
    llm = make_llm(tiny_model_dir, max_num_seqs=8)  # tiny_llm's limits: its programs
    llm.llm_engine.runner.fault_hook = _fault_for_seed(666)
    for _ in range(4):
        [bad] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, seed=666), use_tqdm=False)
        assert bad.outputs[0].finish_reason == "error"
    [ok] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, seed=1), use_tqdm=False)
    assert ok.outputs[0].finish_reason == "length"
    assert llm.stats()["num_failed_requests"] == 4


def test_a_fault_after_the_kv_writes_and_block_copies_is_rerun_safely(make_llm, tiny_model_dir,
                                                                     monkeypatch):
    """The fault comes after the step's copy-on-write copies and K/V writes (in the sampler's
    inputs), in the step where a good request's two completions first write into their shared
    partial block; the good request's completions equal an undisturbed run's."""
    llm = make_llm(tiny_model_dir, max_num_seqs=8)  # tiny_llm's limits: its programs
    runner = llm.llm_engine.runner
    good = SamplingParams(n=2, max_tokens=10, seed=5)
    [ref] = llm.generate(PROMPTS[1], good, use_tqdm=False)
    prepare, apply_copies = runner.sampler.prepare_sampling, runner.apply_copies
    events = []

    def faulty_prepare(samples):
        if any(seq.params.seed == 666 and seq.num_output_tokens == 1 for _, seq, _, _ in samples):
            events.append(("fault", len(samples)))
            raise RuntimeError("injected fault after the model step")
        return prepare(samples)

    def counted_copies(copies):
        events.append(("copy", len(copies)))
        apply_copies(copies)

    monkeypatch.setattr(runner.sampler, "prepare_sampling", faulty_prepare)
    monkeypatch.setattr(runner, "apply_copies", counted_copies)
    outs = llm.generate([PROMPTS[1], PROMPTS[2]], [good, SamplingParams(max_tokens=10, seed=666)],
                        use_tqdm=False)
    # The batched step copied the pair's shared block, wrote K/V and sampled for all three
    # rows, then failed; the rerun copied again before running the good request alone.
    kinds = [kind for kind, _ in events]
    i = kinds.index("fault")
    assert events[i] == ("fault", 3) and kinds[i - 1:i + 2] == ["copy", "fault", "copy"]
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in ref.outputs]
    assert outs[1].outputs[0].finish_reason == "error" and "after the model step" in outs[1].error


@pytest.mark.parametrize("kv_cache_dtype", POOL_DTYPES)
def test_a_lost_kv_pool_is_fatal(make_llm, tiny_model_dir, kv_cache_dtype):
    import jax

    llm = make_llm(tiny_model_dir, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
    runner = llm.llm_engine.runner

    def lose_the_pool(out):  # as a fault in the step after the pool was donated
        jax.tree.map(lambda x: x.delete(), runner.kv_cache.pool)
        raise RuntimeError("injected fault after the pool was donated")

    runner.fault_hook = lose_the_pool
    with pytest.raises(EngineDeadError, match="pool was lost"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4), use_tqdm=False)


# -- property: any valid SamplingParams completes and frees every block ------------------------

floats = functools.partial(st.floats, allow_subnormal=False)  # XLA's CPU runtime flushes them
TOKEN = st.integers(0, 49151)


@st.composite
def sampling_params(draw) -> SamplingParams:
    """Any SamplingParams from the valid ranges (short outputs, to keep examples fast)."""
    n = draw(st.integers(1, 4))
    max_tokens = draw(st.integers(1, 20))
    return SamplingParams(
        n=n, best_of=draw(st.none() | st.integers(n, 5)), max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        temperature=draw(st.just(0.0) | floats(0, 2)), top_p=draw(floats(1e-3, 1)),
        top_k=draw(st.integers(-1, 100)), min_p=draw(floats(0, 1)),
        presence_penalty=draw(floats(-2, 2)), frequency_penalty=draw(floats(-2, 2)),
        repetition_penalty=draw(floats(0.1, 3)), seed=draw(st.none() | st.integers(0, 2**64 - 1)),
        stop=draw(st.lists(st.text(min_size=1, max_size=3), max_size=4)),
        stop_token_ids=draw(st.lists(TOKEN, max_size=3)),
        include_stop_str_in_output=draw(st.booleans()), ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, 20)),
        prompt_logprobs=draw(st.none() | st.integers(0, 20)),
        skip_special_tokens=draw(st.booleans()),
        logit_bias=draw(st.dictionaries(TOKEN, floats(-100, 100), max_size=3)),
        allowed_token_ids=draw(st.none() | st.lists(TOKEN, min_size=1, max_size=5)))


@pytest.fixture(scope="module")
def tight_llm(tiny_model_dir):
    """A pool of 12 blocks (192 tokens) and 48-token steps: forks preempt one another and
    prompts are chunked."""
    from jaxpaged import LLM
    return LLM(tiny_model_dir, precompile=False,
               max_model_len=128, num_kv_blocks=12, max_num_seqs=8,
               max_num_batched_tokens=48)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(params=sampling_params(), prompts=st.lists(st.sampled_from(PROMPTS + ["Hi " * 30]),
                                                  min_size=1, max_size=3))
@example(params=SamplingParams(logprobs=0, temperature=0, max_tokens=2), prompts=["Hello"])
@example(params=SamplingParams(n=4, best_of=5, max_tokens=20, ignore_eos=True),
         prompts=["Hi " * 30] * 3)
# Found by this test: forks preempted after prompt + output passed the step budget never came
# back when they asked for prompt_logprobs (see test_a_preempted_prompt_logprobs_request...).
@example(params=SamplingParams(n=2, max_tokens=20, prompt_logprobs=1, ignore_eos=True),
         prompts=["Hi " * 30] * 3)
# Every token masked (allowed 0, min_tokens masks stop token 0): a sampled row with nothing to
# draw from once gave an out-of-range token id.
@example(params=SamplingParams(temperature=1.0, stop_token_ids=[0], max_tokens=1, min_tokens=1,
                               allowed_token_ids=[0]), prompts=["Hello, my name is"])
def test_any_valid_sampling_params_complete_and_free_every_block(tight_llm, params, prompts):
    engine = tight_llm.llm_engine
    request_ids = [engine.add_request(p, params) for p in prompts]
    finished = {}
    for _ in range(5000):  # a bound, so that a request that never finishes fails, not hangs
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if len(finished) == len(request_ids):
            break
    assert sorted(finished) == sorted(request_ids)
    for out in finished.values():
        assert out.error is None and len(out.outputs) == params.n
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids)
            assert len(c.token_ids) <= params.max_tokens
            if params.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
                assert all(t in entry and len(entry) <= params.logprobs + 1
                           for t, entry in zip(c.token_ids, c.logprobs))
        if params.prompt_logprobs is not None:
            assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert_idle(tight_llm)
