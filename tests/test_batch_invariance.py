"""Batch invariance (`LLM(batch_invariant=True)`): 16 seeded requests, greedy and sampled at
temperature 1.0 with 5 logprobs, give bitwise the same token ids and log-probabilities run
alone, all together, chunked by a small token budget, from a warm prefix cache, and preempted
by a small pool: on the default backend with 16-feature heads and an intermediate size of 160
(the C++ kernel's generic path; XLA's fused dots), with the C++ kernel (in its invariant order)
on 64-feature heads, with the xla attention backend, and (slow) on SmolLM2."""

import numpy as np
import pytest

from jaxpaged import SamplingParams

rng = np.random.default_rng(0)
PROMPTS = [{"prompt_token_ids": rng.integers(100, 20000, n).tolist()}
           for n in rng.integers(5, 60, 16)]
PARAMS = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=12, logprobs=5,
                         ignore_eos=True) for i in range(16)]


def results(llm, rows=range(16)):
    """Each request's token ids and logprob entries, exactly as floats."""
    outs = llm.generate([PROMPTS[i] for i in rows], [PARAMS[i] for i in rows], use_tqdm=False)
    return {i: (o.outputs[0].token_ids,
                [sorted((t, lp.logprob, lp.rank) for t, lp in entry.items())
                 for entry in o.outputs[0].logprobs]) for i, o in zip(rows, outs)}


CONFIGS = {  # (attention backend, model fixture)
    "default-f160": ("auto", "f160_model_dir"),
    "cpu-h64": ("cpu", "head64_model_dir"),
    "xla": ("xla", "tiny_model_dir"),
    "default-smollm2": ("auto", "default_model_dir"),
}


@pytest.fixture(scope="module", params=[
    "default-f160", "cpu-h64", "xla", pytest.param("default-smollm2", marks=pytest.mark.slow)])
def alone(request):
    """(backend, model, each request's results run alone, the engine that ran them)."""
    from jaxpaged import LLM
    from jaxpaged.pallas_kernels import cpu_attention

    backend, fixture = CONFIGS[request.param]
    if backend == "cpu" and not cpu_attention.available():
        pytest.skip("no C++ compiler")
    model = request.getfixturevalue(fixture)
    llm = LLM(model, batch_invariant=True, max_model_len=256, num_kv_blocks=256,
              enable_prefix_caching=False, precompile=False, attention_backend=backend)
    out = {}
    for i in SMOLLM2_ROWS if request.param == "default-smollm2" else range(16):
        out.update(results(llm, [i]))
    return backend, model, out, llm


# SmolLM2 runs six of the requests (three greedy, three sampled; prompts of 7 to 51 tokens)
# together (the real model's shapes beside each other); the scheduler paths of the other cases
# (chunks, a 32-token budget, prefix-cache hits, preemption) are checked bitwise on each tiny
# configuration with all sixteen.
SMOLLM2_CASES = ("together",)
SMOLLM2_ROWS = range(6)


@pytest.mark.parametrize("case", ["together", "chunked", "chunked by 32", "warm prefix cache",
                                  "preempted"])
def test_bitwise_equal_to_alone(make_llm, alone, case, request):
    backend, model, alone, alone_llm = alone
    if request.node.callspec.params["alone"] == "default-smollm2" and case not in SMOLLM2_CASES:
        pytest.skip("checked on the tiny configurations")
    kw = dict(batch_invariant=True, enable_prefix_caching=case == "warm prefix cache",
              attention_backend=backend)
    if case == "chunked":
        kw.update(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    if case == "chunked by 32":
        kw.update(max_num_batched_tokens=32, long_prefill_token_threshold=16)
    if case == "preempted":
        kw.update(num_kv_blocks=20)
    # "together" runs on the engine that ran each request alone: the same options.
    llm = alone_llm if case == "together" else make_llm(model, **kw)
    rows = sorted(alone)
    if case == "warm prefix cache":
        results(llm)  # every prompt's full blocks cached
    got = results(llm, rows)
    if case == "warm prefix cache":
        assert llm.stats()["num_prefix_cache_hits"] > 0
    if case == "preempted":
        assert llm.stats()["num_preemptions"] > 0
    assert got == alone
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def test_probe_keeps_the_smallest_step_size_from_which_every_size_holds():
    from jaxpaged.platforms.cpu import probe_min_step_tokens

    calls = []

    def run(T, lengths, differ_below):
        calls.append((T, sum(lengths)))
        return np.full((len(lengths), 3), 1.0 if T < differ_below else 0.0, np.float32)

    assert probe_min_step_tokens(lambda T, n: run(T, n, 32)) == 32
    # Each candidate's tokens are run in a step of their own size and in one of 64.
    assert calls[:4] == [(48, 48), (64, 48), (32, 32), (64, 32)]
    assert probe_min_step_tokens(lambda T, n: run(T, n, 0)) == 16
    assert probe_min_step_tokens(lambda T, n: run(T, n, 64)) == 64
    # 24 differs though 16 holds: 16 would let a step of 24 differ from one of 64.
    odd = lambda T, n: np.full((len(n), 3), float(T == 24), np.float32)
    assert probe_min_step_tokens(odd) == 32


def test_batch_invariant_needs_a_cpu_backend(tiny_model_dir):
    from jaxpaged import LLM

    with pytest.raises(ValueError, match="runs on the 'cpu' or 'xla' attention backend, not "
                       "'pallas-interpret'"):
        LLM(tiny_model_dir, batch_invariant=True, attention_backend="pallas-interpret",
            precompile=False)


# Run in a fresh process with XLA's YNNPACK fusions off (XLA_FLAGS is read when jax starts):
# the engine then finds its projections row-invariant from 16 rows and pads steps to 16 tokens,
# not 64; the results must still not depend on the batch.
NO_YNN_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import test_batch_invariance as t
from jaxpaged import LLM
kw = dict(batch_invariant=True, max_model_len=256, num_kv_blocks=256, precompile=False,
          enable_prefix_caching=False)
rows = range(8)  # prompts of 5 to 51 tokens, greedy and sampled
alone = {}
one = LLM(sys.argv[1], **kw)
for i in rows:
    alone.update(t.results(one, [i]))
together = t.results(one, rows)
chunked = t.results(LLM(sys.argv[1], **kw, max_num_batched_tokens=16,
                        long_prefill_token_threshold=8), rows)
print(json.dumps(dict(floor=one.llm_engine.runner.min_step_tokens, together=together == alone,
                      chunked=chunked == alone)))
"""


def test_bitwise_equal_with_ynn_fusions_off(head64_model_dir):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, XLA_FLAGS="--xla_cpu_experimental_ynn_fusion_type=")
    res = subprocess.run([sys.executable, "-c", NO_YNN_SCRIPT, str(head64_model_dir),
                          str(Path(__file__).parent)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == dict(floor=16, together=True,
                                                                   chunked=True)
