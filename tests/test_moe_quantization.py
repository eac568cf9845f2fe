"""int8 Mixture-of-Experts experts (`models.quantization.quantize_experts_int8`,
`SparseMoeBlock.set_int8_experts`): every expert path with int8 experts against the dense path
with the dequantized float experts (one device, the TP column layout, and on 2 CPU devices
expert and tensor parallelism in a fresh process); `quantize_model` on a block (the router and
the shared expert's gate stay float, the experts int8 at about a quarter of their bytes); and a
tiny Mixtral engine quantized by every scheme against the float engine's greedy ids."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.pallas_kernels.plan import KernelPlan
from jaxpaged import SamplingParams
from jaxpaged.models import moe
from jaxpaged.models.layers import ACTIVATIONS
from jaxpaged.models.quantization import (QUANTIZATION_METHODS, QuantizedLinear,
                                          quantize_experts_int8, quantize_model, weight_bytes)
from test_quantization import PROMPTS, _confident_prefix

E, D, F, K = 6, 32, 24, 2


def random_experts(seed: int = 0):
    """Random float experts: gate_up f32[E, D, 2F], down f32[E, F, D]."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((E, D, 2 * F)), jnp.float32),
            jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32))


def dequantized(q: jax.Array, scale: jax.Array) -> jax.Array:
    return q.astype(jnp.float32) * scale[:, None, :]


def routed_tokens(num_tokens: int, seed: int = 1):
    """(x f32[T, D], weights f32[T, k], ids i32[T, k]) with distinct experts per token."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, D)), jnp.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(num_tokens)])
    weights = jnp.asarray(rng.uniform(0.1, 1, (num_tokens, K)), jnp.float32)
    return x, weights, jnp.asarray(ids, jnp.int32)


def test_quantize_experts_int8_is_per_expert_and_output_channel():
    gate_up, _ = random_experts()
    gate_up = gate_up * jnp.arange(1, E + 1)[:, None, None]  # experts of different ranges
    q, scale = quantize_experts_int8(gate_up)
    assert q.dtype == jnp.int8 and q.shape == (E, D, 2 * F)
    assert scale.dtype == jnp.float32 and scale.shape == (E, 2 * F)
    np.testing.assert_allclose(scale, jnp.max(jnp.abs(gate_up), axis=1) / 127, rtol=1e-6)
    assert bool(jnp.all(jnp.max(jnp.abs(q.astype(jnp.int32)), axis=1) == 127))
    err = jnp.abs(dequantized(q, scale) - gate_up)
    assert bool(jnp.all(err <= scale[:, None, :] / 2 + 1e-6))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 5, 70])
def test_every_path_with_int8_experts_equals_dense_on_the_dequantized(num_tokens, tp):
    """5 tokens take the gathered path by default, 70 the grouped; each is forced here. tp=2:
    gate_up's columns laid out shard by shard (`_split_gate_up`), the scales with them."""
    (q_gu, s_gu), (q_d, s_d) = map(quantize_experts_int8, random_experts())
    x, weights, ids = routed_tokens(num_tokens)
    act = ACTIVATIONS["silu"]
    ref = moe.experts_dense(x, weights, ids, dequantized(q_gu, s_gu), dequantized(q_d, s_d),
                            act, tp)
    atol = 1e-5 * float(jnp.max(jnp.abs(ref)))
    for path in (None, *moe.JNP_PATHS):
        out = moe.experts_forward(x, weights, ids, q_gu, q_d, act, path, tp,
                                  scales=(s_gu, s_d))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=atol, err_msg=str(path))


def test_grouped_int8_experts_in_small_tiles_equal_dense():
    (q_gu, s_gu), (q_d, s_d) = map(quantize_experts_int8, random_experts(2))
    x, weights, ids = routed_tokens(45, seed=3)
    act = ACTIVATIONS["silu"]
    ref = moe.experts_dense(x, weights, ids, dequantized(q_gu, s_gu), dequantized(q_d, s_d),
                            act)
    for tile in (1, 4):
        out = moe.experts_grouped(x, weights, ids, q_gu, q_d, act, scales=(s_gu, s_d),
                                  tile=tile)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(jnp.max(ref)))


def qwen2_moe_block(shared: int = 64) -> moe.SparseMoeBlock:
    """A random SparseMoeBlock with a shared expert, as a model builds it (one device)."""
    config = types.SimpleNamespace(hidden_size=D, intermediate_size=F, hidden_act="silu",
                                   tensor_parallel_size=1, kernels=KernelPlan())
    with nnx.use_eager_sharding(False):
        return moe.SparseMoeBlock(config, dtype=jnp.float32, rngs=nnx.Rngs(0),
                                  routing=moe.Routing(K), num_experts=E, intermediate_size=F,
                                  shared_intermediate_size=shared)


@pytest.mark.parametrize("method", list(QUANTIZATION_METHODS))
def test_quantize_model_makes_the_experts_int8_and_keeps_the_gates_float(method):
    block = qwen2_moe_block()
    float_block = qwen2_moe_block()
    experts = lambda b: [p[...] for p in (b.experts_gate_up, b.experts_down,
                                          b.experts_gate_up_scale, b.experts_down_scale)
                         if p is not None]
    float_bytes = weight_bytes(experts(float_block))
    router_kernel = block.router.kernel[...]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((9, D)), jnp.float32)
    quantize_model(block, method)
    assert type(block.router) is type(float_block.router)  # the float `Linear`
    assert type(block.shared_expert_gate) is type(float_block.shared_expert_gate)
    assert block.router.kernel[...].dtype == jnp.float32
    assert block.shared_expert_gate.kernel[...].dtype == jnp.float32
    np.testing.assert_array_equal(block.router.kernel[...], router_kernel)
    assert isinstance(block.shared_expert.gate_up_proj, QuantizedLinear)
    assert isinstance(block.shared_expert.down_proj, QuantizedLinear)
    assert block.experts_gate_up[...].dtype == block.experts_down[...].dtype == jnp.int8
    assert block.experts_gate_up_scale[...].shape == (E, 2 * F)
    assert block.experts_down_scale[...].shape == (E, D)
    # int8 codes and a float32 scale per expert and output channel: about a quarter
    int8_bytes = weight_bytes(experts(block))
    assert int8_bytes == (E * D * 3 * F) + 4 * E * (2 * F + D)
    assert int8_bytes < 0.3 * float_bytes
    # the quantized block stays close to the float one, and equals it on dequantized experts
    ref = float_block(x)
    np.testing.assert_allclose(block(x), ref, rtol=0.05, atol=0.05 * float(jnp.max(ref)))
    if method == "int8":  # the shared expert's weight-only product, as the experts'
        float_block.experts_gate_up[...] = dequantized(block.experts_gate_up[...],
                                                       block.experts_gate_up_scale[...])
        float_block.experts_down[...] = dequantized(block.experts_down[...],
                                                    block.experts_down_scale[...])
        float_block.shared_expert = block.shared_expert
        np.testing.assert_allclose(block(x), float_block(x), rtol=1e-5,
                                   atol=1e-5 * float(jnp.max(ref)))


def test_set_int8_experts_names_a_wrong_shape():
    block = qwen2_moe_block(shared=0)
    q = jnp.zeros((E, D, 2 * F), jnp.int8)
    with pytest.raises(ValueError, match=r"down must be int8\[6, 24, 32\]"):
        block.set_int8_experts(q, jnp.ones((E, 2 * F)), q, jnp.ones((E, D)))


PARALLEL = """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from jaxpaged.distributed.parallel import make_mesh
    from jaxpaged.models import moe
    from jaxpaged.models.layers import ACTIVATIONS
    from jaxpaged.models.quantization import _quantized, quantize_experts_int8
    from jaxpaged.pallas_kernels.backends import MODEL_AXIS
    from test_moe_quantization import dequantized, random_experts, routed_tokens

    mesh = make_mesh(2)  # as the engine's
    gate_up, down = random_experts()
    act = ACTIVATIONS["silu"]
    M = MODEL_AXIS
    for ep, specs in ((True, ((M, None, None), (M, None, None))),
                      (False, ((None, None, M), (None, M, None)))):
        tp = 1 if ep else 2
        (q_gu, s_gu), (q_d, s_d) = [
            _quantized(quantize_experts_int8, w, s, mesh, scale_spec=s[:1] + s[2:])
            for w, s in zip((gate_up, down), specs)]
        assert q_gu.sharding.spec == P(*specs[0]) and s_gu.sharding.spec == P(*specs[0][::2])
        assert q_d.sharding.spec == P(*specs[1]) and s_d.sharding.spec == P(*specs[1][::2])
        for num_tokens in (1, 5, 70):
            x, weights, ids = routed_tokens(num_tokens)
            one = lambda a: jnp.asarray(np.asarray(a))  # on one device
            ref = moe.experts_dense(x, weights, ids, dequantized(one(q_gu), one(s_gu)),
                                    dequantized(one(q_d), one(s_d)), act, tp)
            for path in moe.JNP_PATHS:
                if ep:
                    fn = lambda *a: moe.experts_parallel(mesh, *a[:5], act, path,
                                                     scales=a[-2:])
                else:
                    fn = lambda *a: moe.experts_forward(*a[:5], act, path, tp, scales=a[-2:])
                out = jax.jit(fn)(x, weights, ids, q_gu, q_d, s_gu, s_d)
                np.testing.assert_allclose(out, ref, rtol=1e-5,
                                           atol=1e-5 * float(jnp.max(jnp.abs(ref))))
    print("PARALLEL OK")
"""


def test_int8_experts_under_expert_and_tensor_parallelism_on_two_devices():
    """The experts quantized onto 2 CPU devices keep their float layout (EP: whole experts per
    device; TP: gate_up's columns and down's rows split, the scales as their output axis), and
    `experts_parallel` / the partitioned `experts_forward` equal the dense path."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(PARALLEL)], env=env,
                         cwd=os.path.dirname(__file__), capture_output=True, text=True,
                         timeout=600)
    assert "PARALLEL OK" in res.stdout, res.stdout[-3000:] + res.stderr[-5000:]


# -- engines -----------------------------------------------------------------------------------

# test_quantization's prompts and three more on which the random Mixtral's greedy choices have
# wider margins (the comparison needs some).
MIXTRAL_PROMPTS = PROMPTS + ["Hello there my friend, hello there", "import numpy as np",
                             "a b c d e f g"]

@pytest.fixture(scope="module")
def mixtral_float_outputs(tiny_mixtral):
    from jaxpaged import LLM

    llm = LLM(tiny_mixtral, max_model_len=256, num_kv_blocks=64, precompile=False,
              compilation_cache_dir=None)
    out = llm.generate(MIXTRAL_PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                       logprobs=2), use_tqdm=False)
    experts = llm.llm_engine.runner.params["layers"][0]["mlp"]
    return [o.outputs[0] for o in out], weight_bytes(
        [experts["experts_gate_up"], experts["experts_down"]])


@pytest.mark.parametrize("method", list(QUANTIZATION_METHODS))
def test_quantized_mixtral_greedy_ids_match_float_where_margins_are_large(
        make_llm, tiny_mixtral, mixtral_float_outputs, method):
    """The tolerance of `test_quantization`'s dense engines: the float engine's greedy ids
    wherever its top-2 margin is at least 0.1; the experts' bytes about a quarter."""
    float_outputs, float_bytes = mixtral_float_outputs
    llm = make_llm(tiny_mixtral, max_num_seqs=4, compilation_cache_dir=None,
                   quantization=method)
    params = SamplingParams(temperature=0, max_tokens=12)
    ids = [o.outputs[0].token_ids
           for o in llm.generate(MIXTRAL_PROMPTS, params, use_tqdm=False)]
    checked = 0
    for ref, out in zip(float_outputs, ids):
        n = _confident_prefix(ref, margin=0.1)
        assert list(out[:n]) == list(ref.token_ids[:n]), (method, out, ref.token_ids)
        checked += n
    assert checked >= 6, "the float model's margins left too few tokens to compare"
    mlp = llm.llm_engine.runner.params["layers"][0]["mlp"]
    assert mlp["experts_gate_up"].dtype == mlp["experts_down"].dtype == jnp.int8
    assert mlp["router"]["kernel"].dtype == jnp.float32
    assert weight_bytes([mlp[k] for k in ("experts_gate_up", "experts_down",
                                          "experts_gate_up_scale", "experts_down_scale")]) \
        < 0.3 * float_bytes
