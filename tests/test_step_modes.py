"""Every kind of step on the one step path (`ModelRunner.launch` / `collect`) gives the tokens of
synchronous single steps: async scheduling, k-step decoding and speculative (n-gram) steps run
one workload that batches, chunks prompts, preempts, stops on tokens and strings and forks
seeded sampled completions, and each equals the synchronous engine's outputs (greedy ids and
seeded samples equal, cumulative and per-token logprobs within 1e-4, the same finish reasons and
text). Each mode's own mechanism is asserted to have run, and every block is free after."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from output_utils import assert_idle, assert_same_outputs

PROMPTS = [{"prompt_token_ids": ids} for ids in (
    [5, 6, 7, 8, 9, 10], list(range(3, 43)), [42] * 9 + [43, 44] * 6, [7, 8, 9],
    list(range(100, 170)), [11, 12, 11, 12, 11, 12])]
# A pool of 12 blocks of 16 for up to 8 sequences of up to ~90 tokens: the workload preempts.
OPTIONS = dict(max_model_len=128, num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=32,
               precompile=False)
MODES = {
    "async": dict(async_scheduling=True, num_scheduler_steps=1),
    "k-step": dict(num_scheduler_steps=4),
    "speculative": dict(num_scheduler_steps=1, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}),
}


def _workload(ref_outputs=None) -> list[SamplingParams]:
    """Greedy rows (plain, with logprobs, with a stop token and a stop string taken from the
    plain run `ref_outputs`) and a seeded sampled row forking into two completions."""
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
             for n in (30, 40, 60, 25, 20, 45)]
    if ref_outputs is None:
        return plain
    ids, text = ref_outputs[1].outputs[0].token_ids, ref_outputs[5].outputs[0].text
    params = list(plain)
    params[1] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                               stop_token_ids=[ids[12]], logprobs=2)
    params[5] = SamplingParams(temperature=0, max_tokens=45, ignore_eos=True,
                               stop=[text[len(text) // 2:len(text) // 2 + 3]])
    params[3] = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=25,
                               ignore_eos=True, logprobs=1)
    return params


def _run(llm: LLM, params) -> list:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_idle(llm)
    return outs


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """(the workload, the synchronous engine's outputs of it, and of the plain greedy rows)."""
    llm = LLM(tiny_model_dir, num_scheduler_steps=1, **OPTIONS)
    plain = _run(llm, _workload())
    params = _workload(plain)
    outs = _run(llm, params)
    assert llm.stats()["num_preemptions"] > 0  # the small pool preempted
    finish = {c.finish_reason for o in outs for c in o.outputs}
    assert "stop" in finish and "length" in finish
    assert len(outs[3].outputs) == 2
    return params, outs, plain


@pytest.mark.parametrize("mode", MODES)
def test_every_step_mode_gives_the_synchronous_outputs(tiny_model_dir, reference, mode):
    params, ref, ref_plain = reference
    llm = LLM(tiny_model_dir, **OPTIONS, **MODES[mode])
    engine = llm.llm_engine
    outs = _run(llm, params)
    assert_same_outputs(outs, ref)
    if mode == "async":
        assert engine.async_scheduling.num_overlapped_steps > 0
        return
    # Plain greedy rows alone: they decode k steps a call, or verify proposals, once nothing
    # waits.
    assert_same_outputs(_run(llm, _workload()), ref_plain)
    if mode == "k-step":
        assert engine.runner.num_multi_step_executables > 0
    else:
        assert engine.scheduler.num_spec_drafts > 0
