"""Mixture-of-Experts routing and expert paths (`models.moe`) against the Hugging Face blocks
they follow: for each family's router (Mixtral, Qwen2-MoE / Qwen3-MoE with and without
`norm_topk_prob`, OLMoE, Granite MoE) the same experts picked for every token and the routed
experts' output within 1e-5 (float32) on the dense, gathered and grouped paths and the C++
kernel, at step sizes on both sides of `GATHER_MAX_PAIRS` and with experts no token picks; the
kernel on int8 experts and its rows independent of the rest of the step; and a tiny Mixtral
engine's greedy ids through an orbax checkpoint, speculative decoding and batch-invariant
mode. (The families against transformers: tests/test_families.py; TP and expert parallelism:
tests/test_tensor_parallel.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxpaged.pallas_kernels.plan import KernelPlan
from jaxpaged import SamplingParams
from jaxpaged.models import moe
from jaxpaged.models.layers import ACTIVATIONS

BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, hidden_act="silu")
FAMILIES = {  # name -> (config class, block attribute path, config overrides, our Routing)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "block_sparse_moe",
                dict(num_local_experts=8, num_experts_per_tok=2), moe.Routing(2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "mlp",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=40, norm_topk_prob=False),
                  moe.Routing(2, renormalize=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "mlp",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                       norm_topk_prob=True), moe.Routing(2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "mlp",
              dict(num_experts=8, num_experts_per_tok=2), moe.Routing(2, renormalize=False)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", "block_sparse_moe",
                   dict(num_local_experts=8, num_experts_per_tok=2),
                   moe.Routing(2, softmax_first=False)),
}


# Jitted: one compilation per shape (and path, tile), where run eagerly each operation compiles
# for each shape.
route = jax.jit(moe.route, static_argnums=1)
experts_forward = jax.jit(moe.experts_forward, static_argnums=5, static_argnames="path")
experts_dense = jax.jit(moe.experts_dense, static_argnums=5)
experts_grouped = jax.jit(moe.experts_grouped, static_argnums=5, static_argnames="tile")


def hf_block(name: str):
    """(HF's MoE block of a random one-layer model of the family, our Routing)."""
    import torch
    import transformers

    config_cls, model_cls, attr, overrides, routing = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(
        **{**BASE, **overrides}))
    layer = model.model.layers[0]
    block = getattr(layer, attr, None) or layer.mlp  # transformers 5 names Mixtral's "mlp"
    with torch.no_grad():  # spread the router's logits: distinct top-k choices
        router = block.router if hasattr(block, "router") else block.gate
        router.weight.normal_(0, 0.5)
    return block, routing


def hf_routed(block, x):
    """(expert ids i64[T, k], routed experts' output f32[T, D]) of HF's block on x [T, D]."""
    import torch

    router = block.router if hasattr(block, "router") else block.gate
    with torch.no_grad():
        xt = torch.from_numpy(x)
        _, weights, ids = router(xt)
        return ids.numpy(), block.experts(xt, ids, weights).numpy()


def ours(block, x, routing, path):
    """(expert ids, output) of `moe.route` and `moe.experts_forward` on HF's weights."""
    router = block.router if hasattr(block, "router") else block.gate
    w = router.weight.detach().numpy()  # [E, D]
    gate_up = np.swapaxes(block.experts.gate_up_proj.detach().numpy(), 1, 2)  # [E, D, 2F]
    down = np.swapaxes(block.experts.down_proj.detach().numpy(), 1, 2)  # [E, F, D]
    weights, ids = route(jnp.asarray(x) @ jnp.asarray(w).T, routing)
    out = experts_forward(jnp.asarray(x), weights, ids, jnp.asarray(gate_up),
                          jnp.asarray(down), ACTIVATIONS["silu"], path=path)
    return np.asarray(ids), np.asarray(out)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("num_tokens", [1, 5, 70])
def test_routing_and_every_path_equal_the_hf_block(name, num_tokens):
    block, routing = hf_block(name)
    x = np.random.default_rng(num_tokens).standard_normal((num_tokens, 64)).astype(np.float32)
    ref_ids, ref = hf_routed(block, x)
    for path in moe.PATHS:
        ids, out = ours(block, x, routing, path)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, err_msg=path)


def test_grouped_path_with_unused_experts_and_one_expert_for_all():
    """Pairs all on one expert (tiles of that expert only; the rest empty), and on every expert
    but one: the grouped path equals the dense one."""
    rng = np.random.default_rng(0)
    E, D, F, T, k = 6, 16, 24, 45, 2
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * F)), jnp.float32)
    down = jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (T, k)), jnp.float32)
    act = ACTIVATIONS["silu"]
    for ids in (np.full((T, k), 3), rng.integers(0, E - 1, (T, k))):
        ids = jnp.asarray(ids, jnp.int32)
        ref = experts_dense(x, weights, ids, gate_up, down, act)
        for tile in (1, 4, 32, 128):
            out = experts_grouped(x, weights, ids, gate_up, down, act, tile=tile)
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


def test_the_path_is_chosen_by_step_size_and_a_bad_one_is_named():
    assert moe.choose_path(1, 2, 32) == "gathered"
    assert moe.choose_path(moe.GATHER_MAX_PAIRS // 2 + 1, 2, 32) == "dense"
    assert moe.choose_path(moe.DENSE_MAX_ROWS // 32 + 1, 2, 32) == "grouped"
    x = jnp.zeros((2, 4))
    with pytest.raises(ValueError, match="MoE path 'sparse'"):
        moe.experts_forward(x, jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32),
                            jnp.zeros((3, 4, 8)), jnp.zeros((3, 4, 4)), jax.nn.silu, "sparse")


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_the_kernel_equals_the_dense_path_on_float_and_int8_experts(num_tokens):
    """`pallas_kernels.moe_experts` (pairs counting-sorted by expert, reductions in chunks of
    256, rows in tiles of 6): experts no token picks and one expert holding most pairs; int8
    experts against the dense path on their dequantized matrices; each token's row bit-equal
    to the same token computed alone (the kernel's order does not depend on the step)."""
    from jaxpaged.models.quantization import quantize_experts_int8
    from jaxpaged.pallas_kernels import moe_experts

    rng = np.random.default_rng(num_tokens)
    E, D, F, k = 8, 320, 128, 2  # D past one reduction chunk
    x = jnp.asarray(rng.standard_normal((num_tokens, D)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * F)) * 0.05, jnp.float32)
    down = jnp.asarray(rng.standard_normal((E, F, D)) * 0.05, jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (num_tokens, k)), jnp.float32)
    ids = rng.integers(0, E - 2, (num_tokens, k))  # experts 6 and 7 unused
    ids[: num_tokens // 2 + 1, 0] = 5
    ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % (E - 2), ids[:, 1])
    ids = jnp.asarray(ids, jnp.int32)
    act = ACTIVATIONS["silu"]
    assert moe_experts.fits(x, gate_up, down, "silu", tp=1)
    assert not moe_experts.fits(x, gate_up[:, :, :96], down[:, :48], "silu", tp=1)
    assert not moe_experts.fits(x, gate_up, down, "gelu_pytorch_tanh", tp=1)
    (q_gu, s_gu), (q_d, s_d) = quantize_experts_int8(gate_up), quantize_experts_int8(down)
    for experts, scales, dense in (
            ((gate_up, down), None, (gate_up, down)),
            ((q_gu, q_d), (s_gu, s_d), (q_gu * s_gu[:, None], q_d * s_d[:, None]))):
        kernel = jax.jit(lambda x, w, i: moe.experts_forward(x, w, i, *experts, act, "kernel",
                                                             scales=scales))
        out = kernel(x, weights, ids)
        ref = experts_dense(x, weights, ids, *dense, act)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(jnp.max(abs(ref))))
        for t in {0, num_tokens // 2, num_tokens - 1}:
            alone = kernel(x[t:t + 1], weights[t:t + 1], ids[t:t + 1])
            np.testing.assert_array_equal(alone[0], out[t])


@pytest.mark.parametrize("num_tokens", [3, 40])
def test_the_block_with_its_shared_expert_equals_qwen2_moe(num_tokens):
    """`SparseMoeBlock` with HF's weights: routed experts plus the sigmoid-gated shared expert
    (`Qwen2MoeSparseMoeBlock.forward`)."""
    import types

    import torch
    from flax import nnx

    block, routing = hf_block("qwen2_moe")
    config = types.SimpleNamespace(hidden_size=64, intermediate_size=64, hidden_act="silu",
                                   tensor_parallel_size=1,  # what the block reads of a config
                                   kernels=KernelPlan())
    with nnx.use_eager_sharding(False):  # as the models build (`LlamaForCausalLM`)
        ours_block = moe.SparseMoeBlock(config, dtype=jnp.float32, rngs=nnx.Rngs(0),
                                        routing=routing, num_experts=8, intermediate_size=64,
                                        shared_intermediate_size=40)
    t = lambda w: jnp.asarray(w.detach().numpy())
    shared = block.shared_expert
    ours_block.router.kernel[...] = t(block.gate.weight).T
    ours_block.experts_gate_up[...] = jnp.swapaxes(t(block.experts.gate_up_proj), 1, 2)
    ours_block.experts_down[...] = jnp.swapaxes(t(block.experts.down_proj), 1, 2)
    ours_block.shared_expert.gate_up_proj.kernel[...] = jnp.concatenate(
        [t(shared.gate_proj.weight).T, t(shared.up_proj.weight).T], axis=1)
    ours_block.shared_expert.down_proj.kernel[...] = t(shared.down_proj.weight).T
    ours_block.shared_expert_gate.kernel[...] = t(block.shared_expert_gate.weight).T
    x = np.random.default_rng(1).standard_normal((num_tokens, 64)).astype(np.float32)
    with torch.no_grad():
        ref = block(torch.from_numpy(x)[None]).numpy()[0]
    np.testing.assert_allclose(np.asarray(ours_block(jnp.asarray(x))), ref, rtol=1e-5,
                               atol=1e-5)


def test_mixtral_keeps_its_greedy_ids_through_orbax_speculation_and_batch_invariance(
        make_llm, tiny_mixtral, tmp_path):
    """The experts stacked from an orbax checkpoint (`jaxpaged convert`), an n-gram proposer
    verified by an MoE target, and batch-invariant mode: the greedy ids of the plain engine."""
    from jaxpaged.models.registry import convert_to_orbax

    prompts = ["Hello there my friend, hello there", "1 2 3 4 5 6 7 8 9 10 1 2 3"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    generate = lambda llm: [o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)]
    ref = generate(make_llm(tiny_mixtral))
    convert_to_orbax(tiny_mixtral, tmp_path / "orbax")
    assert generate(make_llm(tmp_path / "orbax")) == ref
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert generate(make_llm(tiny_mixtral, speculative_config=ngram)) == ref
    assert generate(make_llm(tiny_mixtral, batch_invariant=True)) == ref


def test_olmoe_refuses_tensor_parallelism_past_its_kv_heads():
    """OLMoE's k_norm spans every KV head: tp above them (which would repeat the heads per
    device) is refused with the numbers named; up to them, the config splits."""
    from jaxpaged.models.olmoe import OlmoeConfig

    config = OlmoeConfig.from_hf_dict({**BASE, "architectures": ["OlmoeForCausalLM"],
                                       "num_experts": 8, "num_experts_per_tok": 2,
                                       "vocab_size": 64, "max_position_embeddings": 64})
    assert config.for_tensor_parallel(2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=4 exceeds OLMoE's "
                                         "num_key_value_heads=2"):
        config.for_tensor_parallel(4)


def test_load_weights_takes_a_transformers_state_dict_and_the_hubs_per_expert_names(
        make_llm, tiny_mixtral, tmp_path):
    """The research API on an MoE model: `load_weights` of another model's `state_dict()`
    (transformers 5's names: `mlp.gate`, the experts stacked with gate and up fused), then of
    checkpoint tensors with each expert apart (the hub's names, stacked as the loader stacks
    them): each time the greedy ids of the model whose weights went in; `get_params` /
    `update_params` keep them."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    from conftest import TINY_CONFIG

    torch.manual_seed(1)
    other = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **TINY_CONFIG, num_local_experts=8, num_experts_per_tok=2)).eval()
    other.save_pretrained(tmp_path)
    llm = make_llm(tiny_mixtral)
    prompt = "Hello there my friend"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = lambda: llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    before = ids()
    tokens = torch.tensor([llm.get_tokenizer()(prompt).input_ids])
    with torch.no_grad():
        want = other.generate(tokens, max_new_tokens=8, do_sample=False,
                              attention_mask=torch.ones_like(tokens))[0, tokens.shape[1]:]
    assert before != want.tolist()
    llm.load_weights(other.state_dict())
    assert ids() == want.tolist()
    hub = load_file(tiny_mixtral / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.7.w1.weight" in hub
    llm.load_weights(hub)
    assert ids() == before
    llm.load_weights(load_file(tmp_path / "model.safetensors"))
    assert ids() == want.tolist()
    llm.update_params(llm.get_params())
    assert ids() == want.tolist()
