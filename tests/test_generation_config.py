"""The model folder's generation config as sampling defaults (vLLM's `--generation-config`),
`GET /v1/models/{id}` and `--chat-template`, through the official `openai` client."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from server_utils import ServerThread

from jaxpaged import LLM, SamplingParams
from jaxpaged.sampling_params import generation_defaults

MODEL = "tiny"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def configured_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with a generation config that asks for greedy decoding of 5 tokens."""
    path = tmp_path_factory.mktemp("tiny-genconfig")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, path / f.name)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.0, top_p=0.9, max_new_tokens=5, do_sample=False)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def _llm(model_dir, **kw):
    return LLM(model_dir, max_model_len=256, num_kv_blocks=64, precompile=False, **kw)


def test_generation_defaults_read_and_named(tmp_path, configured_model_dir):
    assert generation_defaults(configured_model_dir) == {"temperature": 0.0, "top_p": 0.9,
                                                         "max_tokens": 5}
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="temperature must be a number, got 'hot'"):
        generation_defaults(tmp_path)


def test_defaults_apply_and_requests_override_them(configured_model_dir):
    llm = _llm(configured_model_dir)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_p, default.max_tokens) == (0.0, 0.9, 5)
    [greedy] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)
    [by_default] = llm.generate([PROMPT], use_tqdm=False)
    assert by_default.outputs[0].token_ids == greedy.outputs[0].token_ids
    [sampled] = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=7, max_tokens=8),
                             use_tqdm=False)
    with ServerThread(llm, MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        # the config's greedy decoding (a completion's max_tokens defaults to 16, OpenAI's)
        r = client.completions.create(model=MODEL, prompt=PROMPT)
        assert r.choices[0].text.startswith(greedy.outputs[0].text)
        assert r.usage.completion_tokens == 16
        r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, top_p=1.0,
                                      seed=7, max_tokens=8)  # the request's own values
        assert r.choices[0].text == sampled.outputs[0].text
        # a chat without max_tokens: the config's max_new_tokens
        chat = client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": PROMPT}])
        assert chat.usage.completion_tokens == 5


def test_generation_config_vllm_ignores_the_file(configured_model_dir):
    llm = _llm(configured_model_dir, generation_config="vllm")
    assert llm.generation_defaults == {} and llm.get_default_sampling_params().temperature == 1.0
    [sampled] = llm.generate([PROMPT], SamplingParams(seed=3, max_tokens=6), use_tqdm=False)
    with ServerThread(llm, MODEL) as server:
        r = httpx.post(f"{server.url}/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "seed": 3, "max_tokens": 6}).json()
        assert r["choices"][0]["text"] == sampled.outputs[0].text


def test_model_card_by_id_and_chat_template(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    with ServerThread(llm, MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        card = client.models.retrieve(MODEL)
        assert card.id == MODEL and card.max_model_len == 256
        r = httpx.get(f"{server.url}/v1/models/nope")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        # --chat-template: the server's tokenizer renders chats with the given template
        llm.get_tokenizer().chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
        r = httpx.post(f"{server.url}/tokenize", json={
            "messages": [{"role": "user", "content": "Hi"}]}).json()
        assert r["tokens"] == llm.get_tokenizer()("[Hi]", add_special_tokens=False).input_ids


def test_chat_template_option(tmp_path):
    from jaxpaged.entrypoints.cli import _chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert _chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert _chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="'nofile.jinja' is neither a file"):
        _chat_template("nofile.jinja")
