"""The tunix adapter (`jaxpaged.integrations.tunix`) driven through `BaseRollout`'s methods, on
the tiny random Llama. tunix lives in its own virtualenv: `make test-tunix` runs this file there
(in the main suite's environment it is skipped: tunix is not installed)."""

from pathlib import Path

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
        num_kv_heads=c["num_key_value_heads"], rope_theta=1_000_000,  # tunix's, whatever c says
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


def save_family(family, path, seed, default_model_dir, **more):
    """A random tiny model of `family` saved in `path` (rope_theta 1e6: tunix's Llama 3
    uses that whatever the config says); returns its config."""
    import transformers
    config_cls, model_cls, changes, _ = TUNIX_FAMILIES[family]
    config = {**HF_TINY, "rope_theta": 1e6, **changes, **more}
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


# -- tunix's GRPOLearner.train with jaxpaged as the rollout engine ---------------------------

GRPO_QUESTIONS = ["Name a fruit.", "Say hello.", "Count to three.", "What is red?",
                  "Name a tree.", "Spell cat."]
GRPO_STEPS = 3


class CheckedRollout(JaxpagedRollout):
    """A `JaxpagedRollout` that, after each of tunix's syncs, scores its last rollouts with
    itself and with tunix's actor (`tunix.rl.common.compute_per_token_logps`, what the trainer
    computes) and records the largest difference over the completions' tokens."""

    def __init__(self, *, rollout_actor=None, mesh=None, **kwargs):
        self.actor, self.actor_mesh, self.last = None, mesh, None
        self.gaps, self.stale = [], []  # after each sync; before it (the training's change)
        super().__init__(rollout_actor=rollout_actor, mesh=mesh, **kwargs)
        self.actor = rollout_actor  # tunix trains this module in place

    def generate(self, prompts, rollout_config, **kwargs):
        self.last = super().generate(prompts, rollout_config, **kwargs)
        return self.last

    def update_params(self, params, filter_types=None):
        checked = self.actor is not None and self.last is not None
        if checked:
            with jax.transfer_guard("allow"):  # the test's own check, not the sync
                self.stale.append(self._gap())
        super().update_params(params, filter_types)
        if checked:
            with jax.transfer_guard("allow"):
                self.gaps.append(self._gap())

    def _gap(self) -> float:
        from tunix.rl import common
        pad, eos = self.pad_id(), self.eos_id()
        prompts = jax.numpy.asarray(self.last.left_padded_prompt_tokens)
        completions = np.full((len(self.last.tokens), max(map(len, self.last.tokens))), pad,
                              np.int32)
        for row, t in zip(completions, self.last.tokens):
            row[:len(t)] = t
        ours = np.asarray(self.get_per_token_logps(prompts, jax.numpy.asarray(completions)))
        with jax.set_mesh(self.actor_mesh):
            theirs = np.asarray(common.compute_per_token_logps(
                *nnx.split(self.actor), prompts, jax.numpy.asarray(completions), pad, eos))
        return max(float(np.abs(ours[i, :len(t)] - theirs[i, :len(t)]).max())
                   for i, t in enumerate(self.last.tokens))


def run_grpo(model_dir, rollout_engine, lora: bool, steps: int = GRPO_STEPS,
             step_ends: list | None = None):
    """tunix 0.1.7's own loop, unchanged: `RLCluster` + `GRPOLearner.train` for `steps`
    steps on the tiny Llama of `model_dir` (tunix's Llama 3 loaded by tunix's loader; with
    `lora`, qwix adapters of rank 4 on every projection, B nonzero). Returns the cluster;
    `step_ends` (if given) gets `time.perf_counter()` at the end of each actor update
    (`bench/tunix_grpo.py`)."""
    import optax
    import qwix
    from transformers import AutoTokenizer
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
    import json
    config = json.loads((Path(model_dir) / "config.json").read_text())
    mesh = tunix_mesh()
    reference = _tunix_llama3(model_dir, config)
    actor = _tunix_llama3(model_dir, config)
    if lora:
        provider = qwix.LoraProvider(module_path=".*(q|k|v|o|gate|up|down)_proj", rank=4,
                                     alpha=8.0)
        with jax.set_mesh(mesh):
            actor = qwix.apply_lora_to_model(reference, provider, rngs=nnx.Rngs(0),
                                             **reference.get_model_input())
        key = jax.random.PRNGKey(1)
        for _, var in nnx.iter_graph(actor):
            if isinstance(var, nnx.LoRAParam) and var.value.shape[0] == 4:  # the B weights
                key, sub = jax.random.split(key)
                var.value = jax.device_put(0.05 * jax.random.normal(sub, var.value.shape),
                                           var.value.sharding)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cluster = rl.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer,
                           cluster_config=rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine=rollout_engine, offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(
            actor_optimizer=optax.adamw(1e-3),
            eval_every_n_steps=1_000_000, max_steps=steps, mini_batch_size=2,
            train_micro_batch_size=2, rollout_micro_batch_size=2,
            compute_logps_micro_batch_size=2, checkpoint_root_directory=None,
            metrics_logging_options=None),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=16, max_prompt_length=32, kv_cache_size=128,
            temperature=0.9, top_p=1.0, top_k=None)))
    learner = GRPOLearner(cluster, reward_fns=[lambda prompts, completions, **kw: [
        float(c.count("e")) for c in completions]], algo_config=GRPOConfig(
            num_generations=2, num_iterations=1, beta=0.04, epsilon=0.2))
    if step_ends is not None:
        import time
        update = cluster.update_actor

        def timed_update(*args, **kwargs):
            out = update(*args, **kwargs)
            step_ends.append(time.perf_counter())
            return out
        cluster.update_actor = timed_update
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in GRPO_QUESTIONS]
    chat = [chat[i % len(chat)] for i in range(2 * steps)]
    learner.train([{"prompts": np.array(chat[i:i + 2])} for i in range(0, 2 * steps, 2)])
    return cluster


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_learner_trains_with_jaxpaged_rollouts(lora, tmp_path, default_model_dir):
    """tunix's `GRPOLearner.train`, unchanged, with `JaxpagedRollout` as `RLCluster`'s rollout
    engine (given as a partial naming the model folder): every step syncs the actor into the
    engine (full weights, or only the qwix adapter as LoRA), under tunix's transfer guards,
    and after each sync the engine's log-probabilities of its last completions equal the
    trained actor's within 1e-4. The pad id is one no chat prompt holds (SmolLM2's own,
    `<|im_end|>`, ends every chat turn, and tunix masks pad ids out of prompts)."""
    import functools
    model_dir = tmp_path / "tiny"
    save_family("llama3", model_dir, 0, default_model_dir, tie_word_embeddings=True)  # SmolLM2's
    engine = functools.partial(CheckedRollout, model=str(model_dir), pad_id=0,
                               lora_alpha=8.0 if lora else None, num_kv_blocks=64,
                               precompile=False)
    cluster = run_grpo(model_dir, engine, lora)
    rollout = cluster.rollout
    assert cluster.actor_trainer.train_steps == GRPO_STEPS
    assert (rollout.lora_request is not None) == lora
    assert len(rollout.gaps) == GRPO_STEPS, rollout.gaps  # a sync after every step
    assert max(rollout.gaps) < 1e-4, rollout.gaps
    # the check can fail: before each sync, the engine lags the trained actor by far more
    assert min(rollout.stale) > 1e-3, rollout.stale
