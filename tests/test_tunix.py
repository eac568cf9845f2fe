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
    assert isinstance(rollout.model(), nnx.Module)


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
