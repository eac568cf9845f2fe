"""The whole model step on the Pallas backend lowers for CUDA on this CPU machine: the default
model's shapes in bfloat16, a mixed packed step (ragged kernel) and a decode-only one (decode
kernel), exported with `jax.export` for platform "cuda" without a GPU."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.models import ModelInput, forward, load_config
from jaxpaged.models.registry import model_class
from jaxpaged.pallas_kernels import StepLimits, make_attention_backend

TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("decode_only", [False, True])
def test_whole_model_step_lowers_for_cuda(default_model_dir, decode_only):
    from jax import export

    config = load_config(default_model_dir)
    cls = model_class(json.loads((default_model_dir / "config.json").read_text()))
    backend = make_attention_backend("pallas", jnp.bfloat16)
    abstract = nnx.eval_shape(lambda: cls(config, dtype=jnp.bfloat16, attention_backend=backend,
                                          rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    S, P = 16, 1024
    limits = StepLimits(block_size=S, num_blocks=P, max_seq_slots=256,
                        max_blocks_per_seq=2048 // S)
    kv_cache = jax.ShapeDtypeStruct((config.num_hidden_layers, 2, config.num_key_value_heads,
                                     P, S, config.head_dim), jnp.bfloat16)
    rng = np.random.default_rng(0)
    # 31 decodes of 300 cached tokens, then (mixed step) a 161-token prompt chunk.
    seqs = [(list(rng.permutation(P)[:20]), 300, 1) for _ in range(31)]
    if not decode_only:
        seqs.append((list(rng.permutation(P)[:20]), 0, 161))
    T = 32 if decode_only else 192
    md = backend.build(limits, T, seqs)
    assert md.decode_only == decode_only
    batch = ModelInput(np.zeros((T,), np.int32), np.zeros((T,), np.int32), md)

    exported = export.export(
        jax.jit(functools.partial(forward, graphdef), donate_argnums=1), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(params, kv_cache, batch)
    mlir = exported.mlir_module()
    kernel = "paged_decode" if decode_only else "ragged_paged"
    assert TRITON in mlir and f"jaxpaged_{kernel}_attention" in mlir
    logits = exported.out_avals[0]
    assert logits.shape == (limits.num_seqs_bucket(T), config.vocab_size)
    assert logits.dtype == jnp.float32
