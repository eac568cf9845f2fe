"""Bucketed shapes: after `precompile`, serving a mixed workload compiles no new model step
(counted through the jitted step's cache, not timed)."""

import re

import jax
import pytest

from jaxpaged import SamplingParams
from jaxpaged.pallas_kernels import cpu_attention, make_attention_backend


@pytest.mark.parametrize("backend", ["cpu", "xla", "pallas-interpret"])
def test_after_precompile_a_mixed_workload_compiles_no_new_step(make_llm, tiny_model_dir,
                                                                backend):
    if backend == "cpu" and not cpu_attention.available():
        pytest.skip("no C++ compiler")
    llm = make_llm(tiny_model_dir, max_model_len=64, num_kv_blocks=64, max_num_seqs=2,
                   max_num_batched_tokens=16, precompile=True, attention_backend=backend)
    runner = llm.llm_engine.runner
    shapes = runner.step_shapes(16)
    assert llm.stats()["num_compilations"] == len(shapes)
    # One shape per token bucket (1, 2, 3, 4, 6, 8, 12, 16); the Pallas backends also compile
    # the decode-only steps of the buckets that many sequences fill (1 and 2 here).
    assert len(shapes) == 8 + (2 if backend.startswith("pallas") else 0)
    shared = "a shared instruction prefix that spans more than one block of tokens " * 2
    prompts = [shared + "first", "short", shared + "second question here",
               "a prompt long enough to be chunked under a 16 token budget", "x y z",
               shared + "third"]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]
    params[1] = SamplingParams(n=2, seed=1, max_tokens=5, ignore_eos=True)
    assert max(len(llm.get_tokenizer()(p).input_ids) for p in prompts) > 16  # one is chunked
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outputs) > 0  # prefix cache hits happened
    assert llm.stats()["num_compilations"] == len(shapes)


@pytest.mark.parametrize("backend,most", [("cpu", 32), ("xla", 32), ("pallas", 64),
                                          ("pallas-interpret", 64)])
def test_step_shapes_under_the_default_serving_limits(make_llm, tiny_model_dir, backend,
                                                      most):
    # The shapes `precompile` compiles (the test above checks it compiles exactly these) under
    # `LLM`'s default limits: 256 sequences, a 2,048-token budget. The "pallas" backend's
    # shapes are the same as its interpreter's; its kernels cannot run here, so only its
    # metadata is built.
    if backend == "cpu" and not cpu_attention.available():
        pytest.skip("no C++ compiler")
    llm = make_llm(tiny_model_dir, max_model_len=2048, num_kv_blocks=512,
                   attention_backend="pallas-interpret" if backend == "pallas" else backend)
    runner, sc = llm.llm_engine.runner, llm.llm_engine.scheduler_config
    assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (256, 2048)
    if backend == "pallas":
        runner.backend = make_attention_backend("pallas")
    shapes = runner.step_shapes(sc.max_num_batched_tokens)
    assert len(shapes) <= most
    assert len({T for T, _ in shapes}) == 22  # 1, 2, 3, 4, 6, 8, ..., 1536, 2048


def test_shared_blocks_outnumbering_the_pool_take_a_longer_context_list(make_llm,
                                                                        tiny_model_dir):
    # 24 completions of one 3-block prompt list 72 cached blocks in a decode step, more than
    # the 64-block pool holds (they are shared): that step's flat context list must take the
    # most its sequences can hold, and give the tokens a roomy pool gives.
    prompt = {"prompt_token_ids": list(range(100, 148))}
    params = SamplingParams(n=24, seed=3, max_tokens=4, ignore_eos=True)
    small = make_llm(tiny_model_dir, max_model_len=128, num_kv_blocks=64, max_num_seqs=32)
    runner = small.llm_engine.runner
    if runner.backend.name != "cpu":
        pytest.skip("no C++ compiler: no flat block list")
    lengths = []
    prepare = runner.inputs.prepare
    runner.inputs.prepare = lambda *a, **k: (b := prepare(*a, **k), lengths.append(
        len(b.attention.context_blocks)))[0]
    got = small.generate([prompt], params, use_tqdm=False)[0].outputs
    big = make_llm(tiny_model_dir, max_model_len=128, num_kv_blocks=256, max_num_seqs=32)
    want = big.generate([prompt], params, use_tqdm=False)[0].outputs
    assert max(lengths) == 24 * 8 > 64  # 24 sequences of at most 128 / 16 blocks
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_precompile_rejects_an_unknown_value(tiny_model_dir):
    from jaxpaged import LLM

    with pytest.raises(ValueError, match="'always'"):
        LLM(tiny_model_dir, max_model_len=64, num_kv_blocks=64, precompile="always")


@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_compiled_step_copies_neither_the_pool_nor_any_weight(make_llm, tiny_model_dir, backend):
    # The pool is donated and threaded through every layer's attention, and each layer's
    # matmuls read its own weights in place: a copy of the pool, or a copied slice of a weight
    # (as a layer scan over stacked weights makes), would cost a pass over that memory on
    # every step.
    llm = make_llm(tiny_model_dir, max_model_len=64, num_kv_blocks=64, attention_backend=backend)
    runner = llm.llm_engine.runner
    if backend == "auto" and runner.backend.name != "cpu":
        pytest.skip("no C++ compiler: 'auto' is the 'xla' case")
    hlo = runner.lower_step(8).compile().as_text()
    L, _, K, P, S, H = runner.kv_cache.shape
    pools = {(L, 2, K, P, S, H), (L, 2, K, P * S, H)}
    weights = {tuple(w.shape[-2:]) for w in jax.tree.leaves(runner.params) if w.ndim >= 2}
    free = ("parameter", "bitcast", "get-tuple-element")  # views, no data moved
    moved = []
    for dims, op in re.findall(r"= f32\[([\d,]+)\]\S* ([\w-]+)\(", hlo):
        dims = tuple(int(d) for d in dims.split(","))
        if (dims in pools and op == "copy") or (dims[-2:] in weights and op not in free
                                                and all(d == 1 for d in dims[:-2])):
            moved.append((op, dims))
    assert moved == []


def test_precompile_a_list_of_step_sizes(make_llm, tiny_model_dir):
    """`precompile=[n]` (a one-shot command's decode step) compiles the steps of n tokens'
    bucket alone (and its multi-step decoding call) and no sampler variant; a size that is not
    an int >= 1 is a ValueError."""
    llm = make_llm(tiny_model_dir, max_model_len=64, num_kv_blocks=64, max_num_seqs=4,
                   max_num_batched_tokens=32, precompile=[3])
    runner = llm.llm_engine.runner
    assert [T for T, _ in runner.step_shapes(32)].count(3) == 1  # 3 is its own bucket
    assert llm.stats()["num_compilations"] == 1
    # its k-step decode, and no sampler variant
    assert runner.num_multi_step_executables == 1
    assert runner.programs.num_executables(runner.programs.sample) == 0
    for bad in ([0], [1.5], [True], "1"):
        with pytest.raises(ValueError, match="precompile"):
            make_llm(tiny_model_dir, precompile=bad)
