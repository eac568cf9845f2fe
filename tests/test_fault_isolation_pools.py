"""Fault isolation over every kind of KV pool (float, int8, fp8): the requests beside a faulty
one get the tokens they get in a run without it.

A row's numbers depend on the rows beside it (the step's padded size): ulp-level differences
in its keys and values, which an 8-bit pool turns into whole-code differences when a value sits
near a rounding boundary, enough to change a sampled token. So the requests that survive a
faulty step must run it again together, as the step would have run without the faulty request
(`FaultIsolatingExecutor`), not keep the results of their runs one at a time.
"""

from __future__ import annotations

import pytest

from jaxpaged import SamplingParams

POOL_DTYPES = ["auto", "int8", "fp8"]
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
FAULTY_SEED = 666


def _fault_for_seed(seed: int, seen: list | None = None):
    """A fault hook that raises in any step holding a row of the request seeded `seed`, and
    records the rows of every step it is called with in `seen`."""
    def hook(out):
        if seen is not None:
            seen.append([(s.request_id, s.seq_id) for s in out.seqs])
        if any(s.params.seed == seed for s in out.seqs):
            raise RuntimeError(f"injected fault (seed {seed})")
    return hook


def _run_with_and_without_the_faulty_request(llm, good: list[SamplingParams]):
    """(outputs of PROMPTS[:len(good)] alone, outputs with a faulty request after them)."""
    runner = llm.llm_engine.runner
    runner.fault_hook = None
    ref = llm.generate(PROMPTS[:len(good)], good, use_tqdm=False)
    runner.fault_hook = _fault_for_seed(FAULTY_SEED)
    try:
        outs = llm.generate(PROMPTS[:len(good) + 1],
                            good + [SamplingParams(max_tokens=12, seed=FAULTY_SEED)],
                            use_tqdm=False)
    finally:
        runner.fault_hook = None
    return ref, outs


def _assert_unaffected(ref, outs) -> None:
    *kept, failed = outs
    assert [[c.token_ids for c in o.outputs] for o in kept] == \
        [[c.token_ids for c in r.outputs] for r in ref]
    assert all(o.error is None for o in kept)
    assert failed.finished and f"injected fault (seed {FAULTY_SEED})" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error"]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])  # a float pool never showed it
def test_a_seeded_sampled_request_beside_a_faulty_one_keeps_its_tokens(
        make_llm, default_model_dir, kv_cache_dtype):
    """SmolLM2: on 8-bit pools this request's completions drawn from its lone rerun of the
    prefill differed from a run without the faulty request (almost every seed)."""
    llm = make_llm(default_model_dir, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    for seed in (0, 1):
        good = [SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=seed),
                SamplingParams(temperature=0, max_tokens=12)]
        _assert_unaffected(*_run_with_and_without_the_faulty_request(llm, good))
    stats = llm.stats()
    assert stats["num_failed_requests"] == 2


@pytest.mark.parametrize("kv_cache_dtype", POOL_DTYPES)
def test_the_requests_beside_a_faulty_one_rerun_the_step_together(
        make_llm, tiny_model_dir, kv_cache_dtype):
    """The tiny model: after the lone runs, the survivors run the step once more as one step of
    their rows in the step's order, and keep the tokens of a run without the faulty request."""
    llm = make_llm(tiny_model_dir, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
    good = [SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5),
            SamplingParams(temperature=0, max_tokens=12)]
    ref = llm.generate(PROMPTS[:2], good, use_tqdm=False)
    seen = []
    llm.llm_engine.runner.fault_hook = _fault_for_seed(FAULTY_SEED, seen)
    outs = llm.generate(PROMPTS, good + [SamplingParams(max_tokens=12, seed=FAULTY_SEED)],
                        use_tqdm=False)
    _assert_unaffected(ref, outs)
    # The first step (the three prefills) faulted; then each request alone, the faulty one
    # failing; then the two survivors together.
    first, *alone, together = seen[:5]
    assert [len(rows) for rows in (first, *alone, together)] == [3, 1, 1, 1, 2]
    assert together == [row for row in first if row in alone[0] + alone[1]]
