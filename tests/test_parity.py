"""Parity with Hugging Face transformers (float32, CPU): greedy ids and next-token logits."""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxpaged import SamplingParams
from jaxpaged.models import ModelInput, forward, load_config, load_model
from jaxpaged.pallas_kernels import StepLimits, make_attention_backend

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


def hf_teacher_forced(model_dir, prompt_ids, completions):
    """transformers' greedy choices after each prefix of `prompt_ids[b] + completions[b]` (one
    forward pass per prompt, no padding) and its next-token logits after each prompt.

    With our completion appended, the argmax after each prefix must be our next token: that is
    what `generate(do_sample=False)` would have drawn step by step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy, last = [], []
    with torch.no_grad():
        for ids, ours in zip(prompt_ids, completions):
            logits = model(torch.tensor([ids + ours[:-1]]), use_cache=False).logits[0]
            greedy.append(logits[len(ids) - 1:].argmax(-1).tolist())
            last.append(logits[len(ids) - 1].numpy())
    eos = model.generation_config.eos_token_id
    return greedy, last, set(eos if isinstance(eos, list) else [eos])


def prefill_logits(model_dir, prompt_ids, block_size=16):
    """Next-token logits of all prompts packed in one prefill, through the pure step function."""
    config = load_config(model_dir)
    backend = make_attention_backend("xla")
    graphdef, params = nnx.split(load_model(model_dir, config, jnp.float32, backend))
    B, Q = len(prompt_ids), max(len(p) for p in prompt_ids)
    blocks_per_row = -(-Q // block_size)
    kv_cache = jnp.zeros((config.num_hidden_layers, 2, config.num_key_value_heads,
                          B * blocks_per_row, block_size, config.head_dim), jnp.float32)
    limits = StepLimits(block_size=block_size, num_blocks=B * blocks_per_row, max_seq_slots=B,
                        max_blocks_per_seq=blocks_per_row)
    tables = [list(range(b * blocks_per_row, (b + 1) * blocks_per_row)) for b in range(B)]
    md = backend.build(limits, sum(map(len, prompt_ids)),
                       [(table, 0, len(ids)) for table, ids in zip(tables, prompt_ids)])
    lens = np.concatenate([np.full(len(p), len(p)) for p in prompt_ids]).astype(np.int32)
    batch = ModelInput(np.concatenate(prompt_ids).astype(np.int32),
                       np.concatenate([np.arange(len(p)) for p in prompt_ids]).astype(np.int32),
                       md, rope_seq_lens=lens if config.rope_switch_length else None)
    step = jax.jit(functools.partial(forward, graphdef), donate_argnums=1)
    logits, _ = step(params, kv_cache, batch)
    return np.asarray(logits)


def check_parity(make_llm, model_dir, attention_backend="auto"):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    assert len({len(p) for p in prompt_ids}) == len(PROMPTS)  # all lengths differ

    llm = make_llm(model_dir, max_model_len=256, attention_backend=attention_backend)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS),
                           use_tqdm=False)
    completions = [out.outputs[0].token_ids for out in outputs]
    hf_ids, hf_last, eos = hf_teacher_forced(model_dir, prompt_ids, completions)
    for out, want, ids in zip(outputs, hf_ids, prompt_ids):
        assert out.prompt_token_ids == ids
        ours = out.outputs[0].token_ids
        assert ours == want, out.prompt
        # shorter only by ending at an EOS, where generate would stop too
        assert len(ours) == MAX_NEW_TOKENS or ours[-1] in eos, out.prompt

    ours = prefill_logits(model_dir, prompt_ids)
    for b, ref in enumerate(hf_last):
        rel = np.abs(ours[b] - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, (PROMPTS[b], rel)


@pytest.mark.parametrize("backend", ["auto", "xla", "pallas-interpret"])
def test_tiny_random_llama_matches_transformers(make_llm, tiny_model_dir, backend):
    check_parity(make_llm, tiny_model_dir, backend)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory, tiny_model_dir):
    """A random 2-layer Qwen3 (q/k norms; head_dim 32, not hidden_size / heads = 16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import TINY_CONFIG, copy_tokenizer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_CONFIG, head_dim=32))
    with torch.no_grad():  # random norm weights, so that a missing q/k norm shows
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    copy_tokenizer(tiny_model_dir, path)
    return path


def test_tiny_random_qwen3_matches_transformers(make_llm, tiny_qwen3_dir):
    check_parity(make_llm, tiny_qwen3_dir)


def test_qwen3_with_a_sliding_window_is_refused(tiny_qwen3_dir, tmp_path):
    shutil.copytree(tiny_qwen3_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=64)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="use_sliding_window"):
        load_config(tmp_path / "m")


@pytest.mark.slow
def test_default_model_matches_transformers(make_llm, default_model_dir):
    check_parity(make_llm, default_model_dir)
