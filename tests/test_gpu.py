"""Numerical checks on a GPU (`pytest -m gpu`; skipped where jax's default backend is not
"gpu", so CI skips them): run them by hand on a lent machine with
`JAX_PLATFORMS=cuda .venv/bin/python -m pytest -m gpu tests/test_gpu.py`.

The Pallas kernels compiled for the GPU (not interpreted) against the pure-jnp reference, over
float32, bfloat16 and 8-bit pools; the engine on the Pallas backend against the xla backend
(greedy ids of a float32 tiny Llama) and against transformers on the GPU (bfloat16 greedy ids
where float32's margins are large); async scheduling against synchronous steps; the KV pool
sized from the GPU's memory."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxpaged import SamplingParams

pytestmark = pytest.mark.gpu

K, P, S, H, N = 2, 12, 16, 64, 4
TABLES = np.array([[3, 7, 1, 0], [5, 2, 9, 11]], np.int32)
LENS = np.array([45, 60], np.int32)


def pools(dtype):
    """(k, v) f[K, P, S, H] in `dtype`."""
    kk, kv = jax.random.split(jax.random.key(1))
    return (jax.random.normal(kk, (K, P, S, H)).astype(dtype),
            jax.random.normal(kv, (K, P, S, H)).astype(dtype))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_decode_and_ragged_kernels_equal_the_reference(dtype, tol):
    from jaxpaged.pallas_kernels.paged_attention import (paged_attention,
                                                         paged_attention_reference)
    from jaxpaged.pallas_kernels.ragged_paged_attention import (
        ragged_paged_attention, ragged_paged_attention_reference)

    k, v = pools(dtype)
    q = jax.random.normal(jax.random.key(2), (2, N, H)).astype(dtype)
    qr = jax.random.normal(jax.random.key(3), (5, N, H)).astype(dtype)
    cu = jnp.array([0, 3, 4], jnp.int32)
    with jax.default_matmul_precision("highest"):
        for splits in (1, 4):
            got = paged_attention(q, k, v, block_tables=TABLES, context_lens=LENS,
                                  scale=H ** -0.5, k_splits=splits)
            ref = paged_attention_reference(q, k, v, TABLES, LENS, scale=H ** -0.5)
            np.testing.assert_allclose(np.float32(got), np.float32(ref), atol=tol, rtol=tol)
        got = ragged_paged_attention(qr, k, v, TABLES, LENS, cu, 2, scale=H ** -0.5)[:4]
        ref = ragged_paged_attention_reference(qr, k, v, TABLES, LENS, cu, 2,
                                               scale=H ** -0.5)[:4]
    np.testing.assert_allclose(np.float32(got), np.float32(ref), atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_kernels_read_the_8bit_pool_as_the_reference_reads_it_decoded(kind):
    from jaxpaged.pallas_kernels.paged_attention import (paged_attention,
                                                         paged_attention_reference)
    from jaxpaged.pallas_kernels.reference import KV_CODE_DTYPES, dequantize_kv, quantize_kv

    k, v = pools(jnp.float32)
    (kc, ks), (vc, vs) = (quantize_kv(x, KV_CODE_DTYPES[kind][0]) for x in (k, v))
    q = jax.random.normal(jax.random.key(2), (2, N, H))
    with jax.default_matmul_precision("highest"):
        got = paged_attention(q, kc, vc, block_tables=TABLES, context_lens=LENS,
                              scale=H ** -0.5, k_scales=ks, v_scales=vs)
        ref = paged_attention_reference(q, dequantize_kv(kc, ks), dequantize_kv(vc, vs),
                                        TABLES, LENS, scale=H ** -0.5)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_the_pallas_backend_gives_the_xla_backends_greedy_ids(make_llm, tiny_model_dir):
    prompts = ["Hello, my name is", "The capital of France is", "1 2 3 4 5 6 7"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = {backend: [o.outputs[0].token_ids for o in make_llm(
        tiny_model_dir, attention_backend=backend, dtype="float32").generate(
        prompts, params, use_tqdm=False)] for backend in ("pallas", "xla")}
    assert ids["pallas"] == ids["xla"]


def test_bfloat16_greedy_ids_follow_transformers_on_the_gpu(make_llm, tiny_model_dir):
    """bfloat16 on both sides: the engine's greedy ids equal transformers' up to the first
    token where transformers' own top-2 margin is under 0.1 (bfloat16 rounding may swap
    those), and at least 8 tokens are compared."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is"
    llm = make_llm(tiny_model_dir, dtype="bfloat16")
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda()
    ids = torch.tensor([llm.get_tokenizer()(prompt).input_ids], device="cuda")
    out = model.generate(ids, max_new_tokens=24, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    want = out.sequences[0, ids.shape[1]:].tolist()
    margins = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in out.scores]
    n = next((i for i, m in enumerate(margins) if m < 0.1), len(margins))
    assert n >= 8, margins
    assert got[:n] == want[:n]


def test_async_scheduling_gives_the_synchronous_ids_on_the_gpu(make_llm, tiny_model_dir):
    """Greedy and seeded: the next step launched before the last one's draws are read gives
    the synchronous loop's tokens on the GPU too."""
    prompts = ["Hello, my name is", "The capital of France is", "1 2 3 4 5 6 7"]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    ids = {}
    for on in (False, True):
        llm = make_llm(tiny_model_dir, async_scheduling=on, num_scheduler_steps=1)
        ids[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                use_tqdm=False)]
    assert llm.llm_engine.async_scheduling.num_overlapped_steps > 0
    assert ids[True] == ids[False]


def test_the_pool_is_sized_from_the_gpu_memory(make_llm, tiny_model_dir):
    """No budget given: `gpu_memory_utilization` (0.5 here) of the GPU's memory, less the
    weights and the largest step's activations, goes to the pool."""
    from jaxpaged.worker import memory

    limit, _ = memory.device_memory()
    llm = make_llm(tiny_model_dir, num_kv_blocks=None, gpu_memory_utilization=0.5)
    engine = llm.llm_engine
    per_block = engine.runner.kv_cache.spec.bytes_per_token * engine.cache_config.block_size
    pool = engine.block_manager.num_blocks * per_block
    assert 0.3 * limit < pool <= 0.5 * limit
    assert len(llm.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids) > 0
