"""Parity with Hugging Face transformers (float32, CPU): greedy ids and next-token logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoTokenizer, LlamaForCausalLM as HFLlama

from jaxpaged import SamplingParams
from jaxpaged.models import LlamaConfig, ModelInput, forward, load_llama

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about paged attention and the memory it saves:",
    "Yapay zeka gelecekte yazılım geliştiricilerin yerini alabilir mi?",
    "List three prime numbers greater than one hundred and explain how you checked each of them.",
    "In 1969, the first humans walked on the Moon. Describe the mission in detail, including the "
    "crew, the spacecraft, the landing site and what they brought back to Earth for study.",
]
MAX_NEW_TOKENS = 24


def hf_greedy(model_dir, prompt_ids, max_new_tokens):
    model = HFLlama.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:  # one at a time: no padding in the reference
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)
            out.append(gen[0, len(ids):].tolist())
    return model, out


def prefill_logits(model_dir, prompt_ids, block_size=16):
    """Next-token logits of all prompts in one batched prefill, through the pure step function."""
    config = LlamaConfig.from_pretrained(model_dir)
    graphdef, params = nnx.split(load_llama(model_dir, config, jnp.float32))
    B, Q = len(prompt_ids), max(len(p) for p in prompt_ids)
    blocks_per_row = -(-Q // block_size)
    kv_cache = jnp.zeros((config.num_hidden_layers, 2, config.num_key_value_heads,
                          B * blocks_per_row, block_size, config.head_dim), jnp.float32)
    input_ids = np.zeros((B, Q), np.int32)
    slot_mapping = np.full((B, Q), -1, np.int32)
    for b, ids in enumerate(prompt_ids):
        input_ids[b, :len(ids)] = ids
        slot_mapping[b, :len(ids)] = b * blocks_per_row * block_size + np.arange(len(ids))
    batch = ModelInput(input_ids=input_ids, positions=np.tile(np.arange(Q, dtype=np.int32), (B, 1)),
                       slot_mapping=slot_mapping, block_tables=np.zeros((B, 0), np.int32),
                       num_computed_tokens=np.zeros(B, np.int32),
                       query_lens=np.array([len(p) for p in prompt_ids], np.int32))
    step = jax.jit(functools.partial(forward, graphdef), donate_argnums=1)
    logits, _ = step(params, kv_cache, batch)
    return np.asarray(logits)


def check_parity(make_llm, model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    assert len({len(p) for p in prompt_ids}) == len(PROMPTS)  # all lengths differ

    llm = make_llm(model_dir, max_model_len=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS),
                           use_tqdm=False)
    hf_model, hf_ids = hf_greedy(model_dir, prompt_ids, MAX_NEW_TOKENS)
    for out, want, ids in zip(outputs, hf_ids, prompt_ids):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want, out.prompt

    ours = prefill_logits(model_dir, prompt_ids)
    for b, ids in enumerate(prompt_ids):
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0, -1].numpy()
        rel = np.abs(ours[b] - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, (PROMPTS[b], rel)


def test_tiny_random_llama_matches_transformers(make_llm, tiny_model_dir):
    check_parity(make_llm, tiny_model_dir)


@pytest.mark.slow
def test_default_model_matches_transformers(make_llm, default_model_dir):
    check_parity(make_llm, default_model_dir)
