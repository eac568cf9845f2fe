"""The research API on tiny random Llamas: weights in (`update_params`, `load_weights`),
log-probabilities out (`completion_logprobs`, `logprobs_mode`), memory back (`sleep`,
`wake_up`), and the dense forward on the served parameters. Tensor parallelism's side is in
test_tensor_parallel.py, every family's dense forward in test_families.py."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from conftest import TINY_CONFIG, copy_tokenizer
from jaxpaged import SamplingParams
from jaxpaged.engine.async_llm_engine import AsyncLLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time, " * 6]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Llama's architecture with other random weights."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny-llama-other")
    LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(path)
    copy_tokenizer(tiny_model_dir, path)
    return path


# tiny_llm's limits: engines built in the tests reuse its programs
LIMITS = dict(max_num_seqs=8)
SHARED_ENGINES = ("other_llm",)  # leak-checked after each test (conftest's no_leaks)


@pytest.fixture(scope="module")
def other_llm(other_model_dir):
    """An engine serving `other_model_dir` (tiny_llm's limits), read by the tests: the
    weights and greedy outputs an update should give. Leak-checked after each test."""
    from jaxpaged import LLM
    return LLM(other_model_dir, max_model_len=256, num_kv_blocks=256, precompile=False,
               **LIMITS)


def greedy_ids(llm, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


class CompileCounter:
    """Counts XLA compilations (JAX's own event, one per executable compiled)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, secs, **kwargs):
        self.count += event == COMPILE_EVENT


@pytest.fixture(scope="module")
def compiles():
    return CompileCounter()


# -- weights in ------------------------------------------------------------------------------

def test_update_params_serves_another_checkpoint_without_compiling(
        make_llm, tiny_model_dir, other_llm, compiles):
    llm, other = make_llm(tiny_model_dir, **LIMITS), other_llm
    before, want = greedy_ids(llm), greedy_ids(other)
    assert before != want
    n = compiles.count
    llm.update_params(other.get_params())
    assert greedy_ids(llm) == want
    assert compiles.count == n  # neither the update nor the step after it compiled
    # NumPy leaves in the pure nested dict form serve as well
    llm.update_params(jax.tree.map(np.asarray, nnx.to_pure_dict(
        make_llm(tiny_model_dir, **LIMITS).get_params())))
    assert greedy_ids(llm) == before


def test_update_params_drops_the_prefix_cache(make_llm, tiny_model_dir, other_llm):
    llm, other = make_llm(tiny_model_dir, **LIMITS), other_llm
    long = {"prompt_token_ids": list(range(100, 160))}
    llm.generate(long, GREEDY, use_tqdm=False)  # its blocks are cached
    llm.update_params(other.get_params())
    out = llm.generate(long, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # computed again, with the new weights
    assert out.outputs[0].token_ids == other.generate(long, GREEDY, use_tqdm=False)[0] \
        .outputs[0].token_ids


@pytest.mark.parametrize("change, message", [
    (lambda p: p["layers"][0]["mlp"].pop("down_proj"),
     r"missing \['layers.0.mlp.down_proj.kernel'\]"),
    (lambda p: p.update(extra={"w": np.zeros(3, np.float32)}), r"unknown \['extra.w'\]"),
    (lambda p: p["norm"].update(weight=np.ones(63, np.float32)),
     r"'norm.weight' is float32\[63\], the engine's is float32\[64\]"),
    (lambda p: p["norm"].update(weight=np.ones(64, np.float16)),
     r"'norm.weight' is float16\[64\], the engine's is float32\[64\]"),
])
def test_a_bad_update_raises_and_the_old_weights_keep_serving(make_llm, tiny_model_dir,
                                                              other_llm, change, message):
    llm = make_llm(tiny_model_dir, **LIMITS)
    before = greedy_ids(llm)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(other_llm.get_params()))
    change(params)
    with pytest.raises(ValueError, match=message):
        llm.update_params(params)
    assert greedy_ids(llm) == before


def test_load_weights_with_hf_names(make_llm, tiny_model_dir, other_model_dir, other_llm, compiles):
    llm, other = make_llm(tiny_model_dir, **LIMITS), other_llm
    before, want = greedy_ids(llm), greedy_ids(other)
    tensors = load_file(other_model_dir / "model.safetensors")
    n = compiles.count
    llm.load_weights(tensors.items())
    assert greedy_ids(llm) == want
    assert compiles.count == n
    # A subset: layer 1 and the q projections back to the tiny model's; the rest stays.
    mine = load_file(tiny_model_dir / "model.safetensors")
    subset = {k: v for k, v in mine.items() if "layers.1." in k or "q_proj" in k}
    llm.load_weights(subset.items())
    expected = make_llm(other_model_dir, **LIMITS)
    expected.load_weights(subset.items())
    assert greedy_ids(llm) == greedy_ids(expected) not in (before, want)
    # bfloat16 tensors (as HF checkpoints often are) are cast to the engine's dtype
    llm.load_weights((k, v.astype(jnp.bfloat16)) for k, v in mine.items())
    assert llm.get_params()["norm"]["weight"].dtype == jnp.float32
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.k_proj.weight' has shape "
                       r"\(3, 3\), the model expects \(32, 64\)"):
        llm.load_weights([("model.layers.0.self_attn.k_proj.weight", np.zeros((3, 3)))])
    with pytest.raises(ValueError, match="'model.layers.7.mlp.up_proj.weight' names no "
                       "parameter of this LlamaForCausalLM"):
        llm.load_weights([("model.layers.7.mlp.up_proj.weight", np.zeros((128, 64)))])
    with pytest.raises(ValueError, match="'vision_tower.weight' names no parameter"):
        llm.load_weights([("vision_tower.weight", np.zeros(3))])


def test_async_engine_updates_between_steps(make_llm, tiny_model_dir, other_model_dir, other_llm):
    llm, other = make_llm(tiny_model_dir, **LIMITS), other_llm
    want = greedy_ids(other)

    async def main():
        engine = AsyncLLMEngine(llm.llm_engine)
        await engine.update_params(other.get_params())
        outs = []
        for prompt in PROMPTS:
            async for out in engine.generate(prompt, GREEDY, prompt):
                pass
            outs.append(out.outputs[0].token_ids)
        await engine.load_weights(load_file(other_model_dir / "model.safetensors").items())
        await engine.shutdown()
        return outs

    assert asyncio.run(main()) == want


# -- log-probabilities out -------------------------------------------------------------------

def hf_teacher_forced(model_dir, prompt, completion) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return np.array([logprobs[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)])


def test_completion_logprobs_equal_transformers(make_llm, tiny_model_dir):
    # A 32-token budget chunks the longer pairs; the completions of one prompt share its
    # blocks through the prefix cache (hits counted).
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=32, **LIMITS)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 49152, 40).tolist()
    completions = [rng.integers(0, 49152, n).tolist() for n in (1, 7, 33, 60)]
    other = (rng.integers(0, 49152, 3).tolist(), rng.integers(0, 49152, 20).tolist())
    got = llm.completion_logprobs([prompt] * 4 + [other[0]], completions + [other[1]])
    assert llm.stats()["num_prefix_cache_hits"] == 3 * 2  # 2 full blocks of 16, 3 times
    for (p, c), lp in zip([(prompt, c) for c in completions] + [other], got):
        assert lp.dtype == np.float32 and lp.shape == (len(c),)
        np.testing.assert_allclose(lp, hf_teacher_forced(tiny_model_dir, p, c), atol=1e-4)
    # one prompt for all, and one completion alone (another step composition: equal up to
    # float32 summation order, bitwise only in batch-invariant mode)
    np.testing.assert_allclose(llm.completion_logprobs(prompt, completions[1])[0], got[1],
                               atol=1e-5)
    assert llm.completion_logprobs(prompt, [[]])[0].shape == (0,)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7),
                                      dict(temperature=0.8, top_k=40, top_p=0.9),
                                      dict(temperature=0, top_k=5)])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_completion_logprobs_equal_generate_logprobs(tiny_llm, sampling, mode):
    prompt = {"prompt_token_ids": list(range(300, 340))}
    params = SamplingParams(max_tokens=24, logprobs=2, logprobs_mode=mode, seed=7,
                            ignore_eos=True, **sampling)
    out = tiny_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    reported = np.array([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
    scored = tiny_llm.completion_logprobs(prompt["prompt_token_ids"], [out.token_ids],
                                          **(sampling if mode == "processed" else {}))[0]
    np.testing.assert_allclose(scored, reported, rtol=1e-5, atol=1e-5)
    if mode == "processed" and sampling.get("top_k"):
        # the top-k alternatives reported are in the truncated set (finite)
        assert all(np.isfinite(lp.logprob) for entry in out.logprobs for lp in entry.values())


def test_processed_logprobs_differ_from_raw_where_they_should(tiny_llm):
    prompt = {"prompt_token_ids": list(range(300, 340))}
    outs = {mode: tiny_llm.generate(prompt, SamplingParams(
        max_tokens=8, logprobs=0, logprobs_mode=mode, temperature=0.5, top_k=3, seed=1),
        use_tqdm=False)[0].outputs[0] for mode in ("raw", "processed")}
    assert outs["raw"].token_ids == outs["processed"].token_ids  # the same draws
    raw, processed = ([e[t].logprob for e, t in zip(o.logprobs, o.token_ids)]
                      for o in outs.values())
    assert all(p > r for p, r in zip(processed, raw))  # sharper and truncated: more likely
    scored = tiny_llm.completion_logprobs(prompt["prompt_token_ids"], [[5, 6]], top_k=3)[0]
    assert np.isneginf(scored).all()  # tokens outside the top 3 have no probability


def test_completion_logprobs_bad_input_is_named(tiny_llm):
    with pytest.raises(ValueError, match="got 2 prompts for 1 completions"):
        tiny_llm.completion_logprobs([[1, 2], [3]], [[4]])
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        tiny_llm.completion_logprobs([[]], [[4]])
    with pytest.raises(ValueError, match=r"not ids in \[0, 49152\)"):
        tiny_llm.completion_logprobs([[1]], [[49152]])
    with pytest.raises(ValueError, match="fewer than max_model_len=256"):
        tiny_llm.completion_logprobs([[1] * 200], [[2] * 56])
    with pytest.raises(ValueError, match="top_p must be in"):
        tiny_llm.completion_logprobs([[1]], [[2]], top_p=0)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        SamplingParams(logprobs_mode="logits")


# -- memory back -----------------------------------------------------------------------------

def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_sleep_releases_the_pool_then_the_weights(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, num_kv_blocks=512, **LIMITS)
    before_ids = greedy_ids(llm)
    runner = llm.llm_engine.runner
    pool = runner.kv_cache.nbytes
    weights = sum(x.nbytes for x in jax.tree.leaves(llm.get_params()))
    start = live_bytes()
    llm.sleep(1)
    assert start - live_bytes() >= pool
    with pytest.raises(RuntimeError, match=r"asleep \(sleep level 1\): call wake_up\(\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert greedy_ids(llm) == before_ids
    llm.sleep(2)
    assert start - live_bytes() >= pool + weights
    with pytest.raises(RuntimeError, match="released by sleep"):
        llm.get_params()
    llm.wake_up()  # the weights read again from the folder
    assert greedy_ids(llm) == before_ids
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 3"):
        llm.sleep(3)


def test_update_params_while_asleep(make_llm, tiny_model_dir, other_llm):
    llm, other = make_llm(tiny_model_dir, **LIMITS), other_llm
    want = greedy_ids(other)
    llm.sleep(2)
    llm.update_params(jax.tree.map(np.asarray, nnx.to_pure_dict(other.get_params())))
    llm.wake_up()  # keeps the weights given while asleep
    assert greedy_ids(llm) == want


# -- one model for training and inference ----------------------------------------------------

def test_dense_forward_equals_the_engine_and_trains(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, **LIMITS)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 49152, n).tolist() for n in (20, 12)]
    ids, mask = np.zeros((2, 20), np.int32), np.zeros((2, 20), bool)
    ids[0], mask[0] = rows[0], True
    ids[1, 8:], mask[1, 8:] = rows[1], True  # left-padded
    params = llm.get_params()
    logprobs = jax.nn.log_softmax(llm.dense_forward(params, ids, mask), axis=-1)
    engine = llm.completion_logprobs([r[:1] for r in rows], [r[1:] for r in rows])
    for b, (row, offset) in enumerate(zip(rows, (0, 8))):
        dense = [logprobs[b, offset + j, t] for j, t in enumerate(row[1:])]
        np.testing.assert_allclose(dense, engine[b], atol=1e-5)

    def loss(p):
        lp = jax.nn.log_softmax(llm.dense_forward(p, ids, mask)[:, :-1], axis=-1)
        target = jnp.take_along_axis(lp, jnp.asarray(ids[:, 1:])[..., None], axis=-1)[..., 0]
        return -jnp.sum(target * mask[:, 1:]) / mask[:, 1:].sum()

    value, grads = jax.value_and_grad(loss)(params)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    stepped = jax.tree.map(lambda p, g: p - 1.0 * g, params, grads)
    assert loss(stepped) < value  # a gradient step lowers the loss
    llm.update_params(stepped)  # and the engine serves the trained weights
    scored = llm.completion_logprobs([r[:1] for r in rows], [r[1:] for r in rows])
    assert -np.mean(np.concatenate(scored)) < -np.mean(np.concatenate(engine))


# -- what a review found ---------------------------------------------------------------------

def test_blocks_computed_across_an_update_are_never_cached(make_llm, tiny_model_dir,
                                                           other_llm):
    """A request still running when the weights change goes on filling blocks over the old
    weights' context: none of them may serve a later request."""
    llm, other = make_llm(tiny_model_dir, **LIMITS), other_llm
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(500, 540))}
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request(prompt, long)
    for _ in range(3):
        engine.step()
    llm.update_params(other.get_params())
    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
    first = finished[0].outputs[0].token_ids
    # Its prompt's blocks were dropped by the update; a request with the same tokens computes
    # them again with the new weights and caches them, and the next finds them: it must not
    # then find the old request's later blocks after them.
    again = {"prompt_token_ids": prompt["prompt_token_ids"] + first[:40]}
    want = other.generate(again, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for cached in (0, 64):
        out = llm.generate(again, GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == cached
        assert out.outputs[0].token_ids == want


def test_update_params_copies_what_it_is_given(make_llm, tiny_model_dir, other_llm):
    llm, other = make_llm(tiny_model_dir, **LIMITS), other_llm
    want = greedy_ids(other)
    given = jax.tree.map(lambda x: x + 0, other.get_params())  # the caller's own arrays
    llm.update_params(given)
    for x in jax.tree.leaves(given):  # as a donating training step would
        x.delete()
    assert greedy_ids(llm) == want
    with pytest.raises(ValueError, match="is a deleted array"):
        llm.update_params(given)
    host = jax.tree.map(np.array, nnx.to_pure_dict(
        make_llm(tiny_model_dir, **LIMITS).get_params()))
    before = greedy_ids(make_llm(tiny_model_dir, **LIMITS))
    llm.update_params(host)
    host["norm"]["weight"][:] = 0  # changing the NumPy arrays afterwards changes nothing served
    assert greedy_ids(llm) == before


def test_greedy_processed_logprobs_do_not_depend_on_the_batch(tiny_llm):
    prompt = {"prompt_token_ids": list(range(300, 340))}
    greedy = SamplingParams(temperature=0, top_k=5, min_p=0.2, max_tokens=6, logprobs=0,
                            logprobs_mode="processed")
    other = SamplingParams(temperature=1.0, top_k=40, seed=0, max_tokens=6)
    alone = tiny_llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    batched = tiny_llm.generate([prompt, prompt], [greedy, other], use_tqdm=False)[0].outputs[0]
    lps = lambda o: [e[t].logprob for e, t in zip(o.logprobs, o.token_ids)]
    assert batched.token_ids == alone.token_ids
    np.testing.assert_allclose(lps(batched), lps(alone), atol=1e-6)
    scored = tiny_llm.completion_logprobs(prompt["prompt_token_ids"], alone.token_ids,
                                          temperature=0, top_k=5)[0]
    np.testing.assert_allclose(scored, lps(alone), atol=1e-5)


def test_completion_logprobs_takes_arrays_and_names_the_field(tiny_llm):
    prompts = jnp.array([[5, 6, 7], [8, 9, 10]])
    completions = np.array([[11, 12], [13, 14]])
    got = tiny_llm.completion_logprobs(prompts, completions)
    want = tiny_llm.completion_logprobs([[5, 6, 7], [8, 9, 10]], [[11, 12], [13, 14]])
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    with pytest.raises(ValueError, match=r"completion_token_ids \[49152, -1\] are not ids") as e:
        tiny_llm.completion_logprobs([[1]], [[2, 49152, -1]])
    assert e.value.param == "completion_token_ids"
    with pytest.raises(ValueError, match="completion_token_ids must be a list"):
        tiny_llm.completion_logprobs([[1]], "hello")


def test_a_failed_scoring_raises(make_llm, tiny_model_dir):
    from jaxpaged.errors import RequestFailedError

    llm = make_llm(tiny_model_dir, **LIMITS)
    runner = llm.llm_engine.runner

    def fault(out):
        if any(seq.scoring is not None and seq.scoring.start == 3 for seq in out.seqs):
            raise RuntimeError("injected")

    runner.fault_hook = fault
    with pytest.raises(RequestFailedError, match="scoring completion 1 failed: .*injected"):
        llm.completion_logprobs([[1, 2], [1, 2, 3]], [[4], [5]])
    runner.fault_hook = None
    assert len(llm.completion_logprobs([[1, 2]], [[4]])[0]) == 1


def test_load_weights_input_errors(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir, **LIMITS)
    tensors = load_file(tiny_model_dir / "model.safetensors")
    llm.load_weights(tensors)  # a dict works as its items
    with pytest.raises(ValueError, match="'model.norm.weight' is int32, not a float array"):
        llm.load_weights([("model.norm.weight", np.ones(64, np.int32))])
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got True"):
        llm.sleep(True)
