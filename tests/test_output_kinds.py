"""`SamplingParams.output_kind` (vLLM's `RequestOutputKind`): cumulative outputs, deltas that
add up to the same completion, the final output alone; and with deltas a step's host work per
request stays bounded as the output grows."""

import pytest

from jaxpaged import RequestOutputKind, SamplingParams

PROMPT = "a prompt for the output kinds, long enough to take a few blocks"


def run(engine, params, request_id="r"):
    """All the outputs of one request, step by step."""
    engine.add_request(PROMPT, params, request_id=request_id)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("stop", [None, ["e"]])
def test_deltas_add_up_to_the_cumulative_output(tiny_llm, stop):
    """Same seed, same tokens: the concatenated deltas (text, ids, logprobs) equal the final
    cumulative output; FINAL_ONLY reports only that; prompt logprobs come once."""
    engine = tiny_llm.llm_engine
    kinds = {}
    for kind in RequestOutputKind:
        params = SamplingParams(seed=7, max_tokens=24, logprobs=2, prompt_logprobs=1, n=2,
                                stop=stop, output_kind=kind)
        kinds[kind] = run(engine, params, f"r-{kind.name}")
    final = kinds[RequestOutputKind.CUMULATIVE][-1]
    assert final.finished and all(not o.finished for o in kinds[RequestOutputKind.CUMULATIVE][:-1])
    for o in kinds[RequestOutputKind.CUMULATIVE]:  # earlier outputs do not grow afterwards
        assert all(len(c.logprobs) == len(c.token_ids) for c in o.outputs)
    assert kinds[RequestOutputKind.FINAL_ONLY] == [
        kinds[RequestOutputKind.FINAL_ONLY][0]] and kinds[RequestOutputKind.FINAL_ONLY][0].finished
    assert final.metrics.num_generation_tokens == max(len(c.token_ids) for c in final.outputs)
    deltas = kinds[RequestOutputKind.DELTA]
    assert [o.prompt_logprobs is not None for o in deltas] == [True] + [False] * (len(deltas) - 1)
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    for reference in (final, kinds[RequestOutputKind.FINAL_ONLY][0]):
        for c in reference.outputs:
            parts = [d for o in deltas for d in o.outputs if d.index == c.index]
            assert "".join(d.text for d in parts) == c.text
            assert sum((d.token_ids for d in parts), []) == c.token_ids
            assert sum((d.logprobs for d in parts), []) == c.logprobs
            assert parts[-1].finish_reason == c.finish_reason
            assert parts[-1].cumulative_logprob == pytest.approx(c.cumulative_logprob)
            assert all(len(d.token_ids) <= 1 for d in parts)  # one new token a step


class CountingList(list):
    """A list that counts the items its slices copy."""

    copied = 0

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            CountingList.copied += len(item)
        return item


def copies_per_step(engine, kind, max_tokens):
    """Token ids and logprob entries copied out of the request's lists in each step."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1,
                            output_kind=kind)
    engine.add_request(PROMPT, params, request_id=f"count-{kind.name}")
    [seq] = engine.requests[f"count-{kind.name}"].seqs
    seq.token_ids, seq.logprobs = CountingList(seq.token_ids), CountingList(seq.logprobs)
    counts = []
    while engine.has_unfinished_requests():
        CountingList.copied = 0
        engine.step()
        counts.append(CountingList.copied)
    return counts


def test_a_delta_steps_host_work_does_not_grow_with_the_output(tiny_llm):
    """Counted, not timed: with CUMULATIVE each step copies the whole output so far (the
    counter sees it grow); with DELTA the copies per step stay under a bound that does not
    depend on the output length (the new token, and a full block's ids for its hash)."""
    engine = tiny_llm.llm_engine
    block_size = engine.cache_config.block_size
    cumulative = copies_per_step(engine, RequestOutputKind.CUMULATIVE, 120)
    assert cumulative[-1] >= 2 * 119  # ids and logprobs of all 119 earlier tokens
    delta = copies_per_step(engine, RequestOutputKind.DELTA, 120)
    assert len(delta) == len(cumulative)
    assert max(delta[1:]) <= 2 + 2 * block_size
    late, early = delta[len(delta) // 2:], delta[1:len(delta) // 2]
    assert sum(late) <= sum(early) + 2 * block_size


def test_delta_with_best_of_above_n_is_refused():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(n=1, best_of=2, output_kind=RequestOutputKind.DELTA)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
