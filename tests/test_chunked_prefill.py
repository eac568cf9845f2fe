"""Chunked prefill through the engine: prompts longer than the step's token budget are computed
over several steps, beside running decodes, and give the same tokens as unchunked prompts."""

import pytest

from jaxpaged import SamplingParams
from jaxpaged.worker.buckets import bucket

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 7, "a short one",
           "numbers: " + " ".join(str(i) for i in range(40))]


def test_chunked_prefill_gives_the_same_ids_as_unchunked(make_llm, tiny_model_dir):
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)]
    whole = make_llm(tiny_model_dir, enable_prefix_caching=False).generate(
        PROMPTS, params, use_tqdm=False)
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    steps = []
    schedule = llm.llm_engine.scheduler.schedule

    def recording():
        out = schedule()
        if out is not None:
            steps.append([(s.num_computed_tokens, q, s.num_tokens)
                          for s, q in zip(out.seqs, out.num_scheduled_tokens)])
        return out

    llm.llm_engine.scheduler.schedule = recording
    chunked = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(whole, chunked):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
    for c_whole, c_chunked in zip(whole[2].outputs[0].logprobs, chunked[2].outputs[0].logprobs):
        for token_id, lp in c_whole.items():
            assert c_chunked[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)
    assert all(sum(q for _, q, _ in step) <= 16 for step in steps)
    # Some step decoded one sequence while computing a chunk of another's prompt.
    assert any(any(q == 1 for _, q, _ in step) and any(done + q < n for done, q, n in step)
               for step in steps)


def test_prompt_logprobs_longer_than_the_budget_is_a_value_error(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        llm.generate(PROMPTS[0], SamplingParams(prompt_logprobs=1), use_tqdm=False)
    out = llm.generate("a short prompt here", SamplingParams(prompt_logprobs=1, max_tokens=2),
                       use_tqdm=False)
    assert out[0].prompt_logprobs[0] is None and len(out[0].prompt_logprobs) > 1


def record_steps(llm) -> list[list[tuple[bool, int]]]:
    """Patches the scheduler to record each step as [(is a decode, tokens)] per row."""
    steps = []
    schedule = llm.llm_engine.scheduler.schedule

    def recording():
        out = schedule()
        if out is not None:
            steps.append([(s.num_output_tokens > 0 and s.num_computed_tokens + 1 == s.num_tokens,
                           q) for s, q in zip(out.seqs, out.num_scheduled_tokens)])
        return out

    llm.llm_engine.scheduler.schedule = recording
    return steps


def test_a_step_that_decodes_caps_its_prompt_tokens(make_llm, tiny_model_dir):
    """long_prefill_token_threshold / max_num_partial_prefills bound the prompt tokens of a step
    with decodes (to the threshold, plus the padding of the packed step that the decodes and the
    threshold leave); a step without decodes uses the whole budget; the tokens do not change."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    uncapped = make_llm(tiny_model_dir, long_prefill_token_threshold=0, max_num_partial_prefills=4,
                        enable_prefix_caching=False)
    capped = make_llm(tiny_model_dir, long_prefill_token_threshold=8, max_num_partial_prefills=1,
                      enable_prefix_caching=False)
    outputs = []
    for llm in (uncapped, capped):
        steps = record_steps(llm)
        engine = llm.llm_engine
        engine.add_request({"prompt_token_ids": list(range(5, 45))}, params)
        engine.step()  # the first prompt alone: no decodes yet
        for prompt in PROMPTS:  # join while the first one decodes
            engine.add_request(prompt, params)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        outputs.append(sorted((o.prompt_token_ids, o.outputs[0].token_ids) for o in finished))
    assert outputs[0] == outputs[1]
    assert steps[0] == [(False, 40)]  # no decodes: the whole prompt in one step
    mixed = [step for step in steps if any(decode for decode, _ in step)]
    prefills = [[q for decode, q in step if not decode] for step in mixed]
    num_decodes = [sum(decode for decode, _ in step) for step in mixed]
    assert all(len(p) <= 1 and sum(p) <= bucket(d + 8) - d for p, d in zip(prefills, num_decodes))
    assert any(sum(p) > 8 for p in prefills)  # a chunk took padding the threshold left
    assert sum(1 for p in prefills if p) > 10  # the prompts were chunked beside the decodes


@pytest.mark.parametrize("field, value", [("long_prefill_token_threshold", -1),
                                          ("max_num_partial_prefills", 0),
                                          ("max_num_partial_prefills", 1.5)])
def test_prefill_cap_settings_are_checked(make_llm, tiny_model_dir, field, value):
    with pytest.raises(ValueError, match=field):
        make_llm(tiny_model_dir, **{field: value})
