"""The tunix adapter (`jaxpaged.integrations.tunix`) driven through `BaseRollout`'s methods, on
the tiny random Llama. tunix lives in its own virtualenv: `make test-tunix` runs this file there
(in the main suite's environment it is skipped: tunix is not installed)."""

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY_CONFIG, copy_tokenizer

base_rollout = pytest.importorskip("tunix.rl.rollout.base_rollout",
                                   reason="tunix is tested in its own venv: make test-tunix")

from jaxpaged import LLM  # noqa: E402
from jaxpaged.integrations.tunix import JaxpagedRollout  # noqa: E402

PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time, " * 8]


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=128, precompile=False)
    return JaxpagedRollout(llm)


def config(**kw):
    return base_rollout.RolloutConfig(**{**dict(max_tokens_to_generate=12, temperature=1.0,
                                                top_p=1.0, top_k=None, max_prompt_length=16,
                                                seed=np.int32(3), return_logprobs=True), **kw})


def test_is_a_base_rollout(rollout):
    assert isinstance(rollout, base_rollout.BaseRollout)
    assert isinstance(rollout.pad_id(), int) and rollout.eos_id() == 2
    # None, as tunix's vLLM rollout: GRPOLearner's weight-sharing check then passes
    assert rollout.model() is None
    assert JaxpagedRollout(rollout.llm, pad_id=7).pad_id() == 7


def test_generate_and_per_token_logps_agree(rollout):
    out = rollout.generate(PROMPTS, config())
    assert len(out.text) == len(out.tokens) == len(out.logprobs) == 3
    padded = out.left_padded_prompt_tokens
    assert padded.shape == (3, 16) and padded.dtype == np.int32
    tokenizer = rollout.tokenizer
    for row, prompt in zip(padded, PROMPTS):
        ids = tokenizer(prompt).input_ids[-16:]
        assert row[16 - len(ids):].tolist() == ids
        assert (row[:16 - len(ids)] == rollout.pad_id()).all()
    # the same seed, the same rollouts
    again = rollout.generate(PROMPTS, config())
    assert [t.tolist() for t in again.tokens] == [t.tolist() for t in out.tokens]
    # completions right-padded with the pad id, scored: at temperature 1 with no truncation
    # the processed logprobs of generate are the model's, which get_per_token_logps reports
    C = max(len(t) for t in out.tokens) + 3
    completions = np.full((3, C), rollout.pad_id(), np.int32)
    for row, t in zip(completions, out.tokens):
        row[:len(t)] = t
    logps = rollout.get_per_token_logps(jax.numpy.asarray(padded), jax.numpy.asarray(completions))
    assert logps.shape == (3, C)
    for row, t, lp in zip(np.asarray(logps), out.tokens, out.logprobs):
        np.testing.assert_allclose(row[:len(t)], lp, atol=1e-5)
        # a completion ends at its first EOS, included (tunix's `make_completion_mask`): where
        # the pad id is the EOS id, the first pad of a completion that did not stop is scored
        end = len(t) + (rollout.pad_id() == rollout.eos_id() and rollout.eos_id() not in t)
        assert np.isfinite(row[len(t):end]).all() and (row[len(t):end] < 0).all()
        assert (row[end:] == 0).all()


def test_update_params_changes_the_rollouts(rollout, tiny_model_dir, tmp_path):
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(tmp_path)
    copy_tokenizer(tiny_model_dir, tmp_path)
    other = LLM(tmp_path, max_model_len=256, num_kv_blocks=64, precompile=False)
    greedy = config(temperature=0.0, return_logprobs=False)
    ids = lambda r: [t.tolist() for t in r.generate(PROMPTS, greedy).tokens]
    original, before = rollout.llm.get_params(), ids(rollout)
    want = ids(JaxpagedRollout(other))
    assert want != before
    rollout.update_params(other.get_params())
    assert ids(rollout) == want
    # a module of the family gives its parameters
    rollout.update_params(nnx.merge(rollout.llm.llm_engine.runner.graphdef, original))
    assert ids(rollout) == before


# -- tunix's own models, named as tunix names them ---------------------------------------------

MESH_AXES = ("fsdp", "tp")
HF_TINY = dict(TINY_CONFIG, pad_token_id=0)


def tunix_mesh(tp: int = 1):
    return jax.make_mesh((1, tp), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _tunix_llama3(d, c):
    from tunix.models.llama3 import model, params
    return params.create_model_from_safe_tensors(str(d), model.ModelConfig(
        num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"],
        embed_dim=c["hidden_size"], hidden_dim=c["intermediate_size"],
        num_heads=c["num_attention_heads"], head_dim=c["hidden_size"] // c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"], rope_theta=int(c["rope_theta"]),
        norm_eps=c["rms_norm_eps"], weight_tying=c["tie_word_embeddings"]), tunix_mesh(),
        dtype=jax.numpy.float32)


def _tunix_qwen(family):
    def build(d, c):
        module = __import__(f"tunix.models.{family}", fromlist=["model", "params"])
        return module.params.create_model_from_safe_tensors(str(d), module.model.ModelConfig(
            num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"],
            embed_dim=c["hidden_size"], hidden_dim=c["intermediate_size"],
            num_heads=c["num_attention_heads"], head_dim=c.get("head_dim", 16),
            num_kv_heads=c["num_key_value_heads"], rope_theta=int(c["rope_theta"]),
            norm_eps=c["rms_norm_eps"], use_tied_embedding=c["tie_word_embeddings"]),
            tunix_mesh(), dtype=jax.numpy.float32)
    return build


def _tunix_gemma3(d, c):
    from tunix.models.gemma3 import model, params_safetensors
    return params_safetensors.create_model_from_safe_tensors(str(d), model.ModelConfig(
        num_layers=c["num_hidden_layers"], num_embed=c["vocab_size"],
        embed_dim=c["hidden_size"], hidden_dim=c["intermediate_size"],
        num_heads=c["num_attention_heads"], head_dim=c["head_dim"],
        num_kv_heads=c["num_key_value_heads"], sliding_window_size=c["sliding_window"],
        param_dtype=jax.numpy.float32), tunix_mesh(), dtype=jax.numpy.float32)


# family -> (HF config and model classes, config changes, tunix builder)
TUNIX_FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {}, _tunix_llama3),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, _tunix_qwen("qwen2")),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16), _tunix_qwen("qwen3")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=16, query_pre_attn_scalar=16, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"]), _tunix_gemma3),
}


def save_family(family, path, seed, default_model_dir):
    import transformers
    config_cls, model_cls, changes, _ = TUNIX_FAMILIES[family]
    config = {**HF_TINY, "rope_theta": 1e6, **changes}
    torch.manual_seed(seed)
    getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)
                                     ).save_pretrained(path)
    copy_tokenizer(default_model_dir, path)
    return config


@pytest.mark.parametrize("family,tp", [(f, 1) for f in TUNIX_FAMILIES] + [("llama3", 4)])
def test_tunix_models_params_map_onto_the_engine(family, tp, tmp_path, default_model_dir):
    """A tunix model loaded by tunix's own loader from folder B, synced into an engine built
    from folder A under tunix's transfer guards, serves exactly the weights that an engine
    built from B reads itself; under tensor parallelism too (4 devices on 2 KV heads: each
    repeated, `make test-tunix` gives the process 4 CPU devices)."""
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    config = save_family(family, tmp_path / "a", 0, default_model_dir)
    save_family(family, tmp_path / "b", 1, default_model_dir)
    actor = TUNIX_FAMILIES[family][3](tmp_path / "b", config)
    engine = dict(max_model_len=64, num_kv_blocks=16, precompile=False, tensor_parallel_size=tp)
    want = nnx.to_pure_dict(LLM(tmp_path / "b", **engine).get_params())
    rollout = JaxpagedRollout(model=str(tmp_path / "a"), **engine)
    with guarded():
        rollout.update_params(nnx.state(actor, nnx.Param), (nnx.Param,))
    got = nnx.to_pure_dict(rollout.llm.get_params())
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 got, want)


def guarded():
    """tunix's `RLCluster.sync_weights` guards on CPU: no transfer between host and device."""
    import contextlib
    stack = contextlib.ExitStack()
    stack.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
    stack.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
    return stack


def test_an_unknown_tunix_parameter_is_named(rollout):
    state = {"layers": {0: {"attn": {"q_proj": {"w": jax.numpy.zeros((64, 4, 16))}}}},
             "mystery": {"w": jax.numpy.zeros((3,))}}
    with pytest.raises(ValueError, match="mystery.w"):
        rollout.update_params(state)
