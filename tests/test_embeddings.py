"""Embeddings (`LLM.embed`, `/v1/embeddings` through the official `openai` client): the causal
model's final hidden states pooled (last token by default, mean as an option), L2-normalized
unless asked not to, equal to transformers' `last_hidden_state` pooled the same way within 1e-4
(float32), without touching the KV pool."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from server_utils import ServerThread

TEXTS = ["Hello, my name is", "The capital of France is Paris, and the capital of Italy is",
         "def fibonacci(n):"]


@pytest.fixture(scope="module")
def hf_pooled(tiny_model_dir):
    """transformers' pooled states of TEXTS: {(pooling, normalize): f32[3, D]}."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    out = {}
    for text in TEXTS:
        ids = torch.tensor([tokenizer(text).input_ids])
        with torch.no_grad():
            h = model.model(ids).last_hidden_state[0].numpy()
        for pooling, v in (("last", h[-1]), ("mean", h.mean(0))):
            out.setdefault((pooling, False), []).append(v)
            out.setdefault((pooling, True), []).append(v / np.linalg.norm(v))
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", True), ("last", False)])
def test_embed_equals_transformers(tiny_llm, hf_pooled, pooling, normalize):
    before = tiny_llm.stats()
    outs = tiny_llm.embed(TEXTS, pooling=pooling, normalize=normalize)
    got = np.array([o.outputs.embedding for o in outs])
    np.testing.assert_allclose(got, hf_pooled[pooling, normalize], atol=1e-4, rtol=1e-4)
    assert [o.prompt_token_ids for o in outs] == [
        tiny_llm.get_tokenizer()(t).input_ids for t in TEXTS]
    after = tiny_llm.stats()
    assert after["num_free_blocks"] == before["num_free_blocks"] == after["num_total_blocks"]
    assert after["num_prompt_tokens"] == before["num_prompt_tokens"]  # no engine step ran


def test_bad_pooling_is_named(tiny_llm):
    with pytest.raises(ValueError, match="pooling must be one of"):
        tiny_llm.embed("Hi", pooling="cls")


def test_embeddings_route_through_openai_client(tiny_model_dir, hf_pooled):
    from jaxpaged import LLM

    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=64, precompile=False)
    with ServerThread(llm, "tiny") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        r = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64
        got = np.array([d.embedding for d in r.data])
        np.testing.assert_allclose(got, hf_pooled["last", True], atol=1e-4, rtol=1e-4)
        ids = [llm.get_tokenizer()(t).input_ids for t in TEXTS]
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
        f = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
        np.testing.assert_allclose(f.data[0].embedding, hf_pooled["last", True][0], atol=1e-4)
        t = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float",
                                     extra_body={"pooling": "mean"})
        np.testing.assert_allclose(t.data[0].embedding, hf_pooled["mean", True][1], atol=1e-4)
        raw = httpx.post(f"{server.url}/v1/embeddings", json={
            "model": "tiny", "input": "Hi", "encoding_format": "base64"}).json()
        assert isinstance(raw["data"][0]["embedding"], str)
        for body, param in (({"input": "Hi", "dimensions": 8}, "dimensions"),
                            ({"input": []}, "input"), ({"input": [[10**9]]}, "input"),
                            ({"input": "Hi", "encoding_format": "int8"}, "encoding_format")):
            r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "tiny", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert server.stats()["num_kv_blocks_free"] == server.stats()["num_kv_blocks_total"]
        # the engine still generates
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
