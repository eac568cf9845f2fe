"""The OpenAI-compatible server, over real HTTP: uvicorn on 127.0.0.1, the official `openai`
client and httpx. Outputs must equal `LLM.generate` / `LLM.chat` for the same inputs (greedy)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_utils import ServerThread

from jaxpaged import LLM, SamplingParams

MODEL = "tiny"
PROMPTS = ["Hello, my name is", "The capital of France is", "In a hole in the ground",
           "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """The tiny model served with room for 2000-token completions; leak-checked at the end."""
    llm = LLM(tiny_model_dir, precompile=False,
              max_model_len=2100, num_kv_blocks=512, max_num_seqs=32)
    with ServerThread(llm, MODEL) as server:
        yield server
        _wait_idle(server)


@pytest.fixture(autouse=True)
def no_leaks_after(request):
    yield
    if "server" in request.fixturenames:
        _wait_idle(request.getfixturevalue("server"))


def _wait_idle(server: ServerThread, timeout: float = 5.0) -> dict:
    """The engine stats once nothing runs or waits and every block is free; fails otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        s = server.stats()
        idle = (s["num_requests_running"] == s["num_requests_waiting"] == 0
                and s["num_kv_blocks_free"] == s["num_kv_blocks_total"])
        if idle:
            return s
        assert time.monotonic() < deadline, f"engine not idle after {timeout} s: {s}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _reference(llm: LLM, prompts, **params):
    outputs = llm.generate(prompts, SamplingParams(temperature=0, **params), use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Joined text deltas and the finish reason per choice index, and the raw chunks."""
    texts, finish, chunks = {}, {}, []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            delta = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (delta or "")
            if choice.finish_reason is not None:
                assert choice.index not in finish, "two finish reasons for one choice"
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


# -- 1. outputs equal LLM.generate, streamed or not ------------------------------------------

def test_completions_equal_llm_generate(client, tiny_llm):
    ref = _reference(tiny_llm, PROMPTS, max_tokens=12)
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in out.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in out.choices] == [r.text for r in ref]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 12 * len(PROMPTS)
    tokenizer = tiny_llm.get_tokenizer()
    assert out.usage.prompt_tokens == sum(len(tokenizer(p).input_ids) for p in PROMPTS)


def test_token_id_prompts_equal_text_prompts(client, tiny_llm):
    ids = tiny_llm.get_tokenizer()(PROMPTS[1]).input_ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8,
                                        temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


@pytest.mark.parametrize("use_stop", [False, True])
def test_streamed_deltas_join_to_the_full_text(client, tiny_llm, use_stop):
    [ref] = _reference(tiny_llm, PROMPTS[2], max_tokens=24)
    stop = [ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]] if use_stop else None
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop)
    full = client.completions.create(**kwargs)
    texts, finish, chunks = _stream_text(client.completions.create(stream=True, **kwargs))
    assert texts[0] == full.choices[0].text
    assert finish[0] == full.choices[0].finish_reason == ("stop" if use_stop else "length")
    if use_stop:
        assert full.choices[0].text == ref.text[:ref.text.index(stop[0])]
    else:
        assert full.choices[0].text == ref.text
    assert len(chunks) > 2


def test_chat_stream_equals_chat(client, tiny_llm):
    messages = [{"role": "user", "content": "Name three colors."}]
    [ref] = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16),
                          use_tqdm=False)
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_completion_tokens=16)
    assert full.choices[0].message.content == ref.outputs[0].text
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    texts, finish, chunks = _stream_text(client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=16, stream=True))
    assert texts[0] == ref.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finish == {0: full.choices[0].finish_reason}


def test_n_completions_stream_per_choice(client, tiny_llm):
    kwargs = dict(model=MODEL, prompt=PROMPTS[:2], n=3, max_tokens=10, temperature=1.0, seed=7)
    full = client.completions.create(**kwargs)
    texts, finish, _ = _stream_text(client.completions.create(stream=True, **kwargs))
    assert sorted(c.index for c in full.choices) == list(range(6))
    assert texts == {c.index: c.text for c in full.choices}
    assert set(finish) == set(range(6))
    ref = tiny_llm.generate(PROMPTS[:2], SamplingParams(n=3, max_tokens=10, seed=7),
                            use_tqdm=False)
    assert [c.text for c in full.choices] == [c.text for r in ref for c in r.outputs]


def test_echo_and_logprobs(client, tiny_llm):
    [ref] = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5,
                                                         logprobs=2), use_tqdm=False)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5,
                                    temperature=0, logprobs=2, echo=True)
    choice, c = out.choices[0], ref.outputs[0]
    assert choice.text == PROMPTS[0] + c.text
    num_prompt = len(ref.prompt_token_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == num_prompt + 5
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[num_prompt:] == pytest.approx(
        [c.logprobs[t][tok].logprob for t, tok in enumerate(c.token_ids)], abs=1e-5)
    assert all(len(top) >= 2 for top in lp.top_logprobs[num_prompt:])
    assert lp.text_offset[0] == 0


def test_chat_logprobs(client, tiny_llm):
    messages = [{"role": "user", "content": "Hi"}]
    [ref] = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                          use_tqdm=False)
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_tokens=4, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    c = ref.outputs[0]
    assert [e.logprob for e in content] == pytest.approx(
        [c.logprobs[t][tok].logprob for t, tok in enumerate(c.token_ids)], abs=1e-5)
    assert all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in content)


# -- 2. concurrency --------------------------------------------------------------------------

def test_32_concurrent_requests(server, tiny_llm):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    lengths = [4 + (7 * i) % 29 for i in range(32)]
    ref = [r.outputs[0].text for r in tiny_llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths],
        use_tqdm=False)]
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                 timeout=300)

    async def one(i):
        kwargs = dict(model=MODEL, prompt=prompts[i], max_tokens=lengths[i], temperature=0)
        if i % 2:
            stream = await aclient.completions.create(stream=True, **kwargs)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        return (await aclient.completions.create(**kwargs)).choices[0].text

    async def all_of_them():
        try:
            return await asyncio.gather(*[one(i) for i in range(32)])
        finally:
            await aclient.close()

    assert asyncio.run(all_of_them()) == ref


# -- 3. a client that disconnects is aborted -------------------------------------------------

@pytest.mark.timing
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_request(server, stream):
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 2000, "ignore_eos": True,
            "stream": stream}
    with httpx.Client(timeout=120) as http:
        # Warm-up: the abort lands after the current step, and a step that compiles a new shape
        # takes over a second on this CPU. So first compile the shapes of the request's first
        # 300 tokens (about 20 ms a step: the disconnects below come well before that).
        warm = http.post(f"{server.url}/v1/completions",
                         json={**body, "stream": False, "max_tokens": 300})
        assert warm.json()["usage"]["completion_tokens"] == 300
    before = server.stats()["generation_tokens"]
    with httpx.Client(timeout=60) as http:
        if stream:
            with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                first = next(response.iter_lines())
                assert first.startswith("data: {")
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    closed = time.monotonic()
    stats = _wait_idle(server, timeout=1.0)
    assert time.monotonic() - closed < 1.0
    # It was aborted, not finished: far fewer than 2000 tokens were generated.
    assert stats["generation_tokens"] - before < 1500


# -- 4. bad input ----------------------------------------------------------------------------

BAD_REQUESTS = [
    ("temperature", {"temperature": -0.5}),
    ("n", {"n": 0}),
    ("max_tokens", {"max_tokens": -1}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("prompt", {"prompt": ""}),
    ("prompt", {"prompt": []}),
    ("max_tokens", {"max_tokens": 2100}),  # prompt + max_tokens > max_model_len
    ("prompt", {"prompt": [1, 2, 49152]}),  # out of vocabulary
    ("logit_bias", {"logit_bias": {"49152": 1.0}}),
    ("logit_bias", {"logit_bias": {"not-an-id": 1.0}}),
    ("frequency_penalty", {"frequency_penalty": 3}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 2}),
    ("return_routed_experts", {"return_routed_experts": True}),  # no experts; never streamed
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("param,fields", BAD_REQUESTS, ids=[f"{p}={v}" for p, v in BAD_REQUESTS])
def test_bad_input_is_a_400(server, param, fields, stream):
    body = {"model": MODEL, "prompt": "Hello", "stream": stream, **fields}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert param in error["message"] or error["param"] == param, error
    _assert_healthy(server)


def _assert_healthy(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_bad_chat_input_is_a_400(server):
    url = f"{server.url}/v1/chat/completions"
    cases = [
        {"messages": []},
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
         "continue_final_message": True},
        {"messages": "not a list"},
    ]
    for body in cases:
        r = httpx.post(url, json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    _assert_healthy(server)


def test_unknown_model_and_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    for method, path in [("GET", "/v1/nothing"), ("POST", "/v2/completions")]:
        r = httpx.request(method, f"{server.url}{path}")
        assert r.status_code == 404 and r.json()["error"]["message"]
    _assert_healthy(server)


def test_api_key(tiny_model_dir):
    llm = LLM(tiny_model_dir, precompile=False, max_model_len=128, num_kv_blocks=32, max_num_seqs=4)
    with ServerThread(llm, MODEL, api_key="sesame") as server:
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}]:
            r = httpx.get(f"{server.url}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health").status_code == 200  # only /v1/* is guarded
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
        assert client.models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope",
                          max_retries=0).models.list()


# -- 5. usage and [DONE] ---------------------------------------------------------------------

def test_include_usage_equals_usage_and_done_ends_streams(server):
    for path, body in [
        ("/v1/completions", {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 7}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 9}),
    ]:
        body = {"model": MODEL, "temperature": 0, **body}
        usage = httpx.post(f"{server.url}{path}", json=body, timeout=60).json()["usage"]
        events = _sse_events(server, path, {**body, "stream": True,
                                            "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"] == [] and last["usage"] == usage
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        plain = _sse_events(server, path, {**body, "stream": True})
        assert plain[-1] == "[DONE]"
        assert all(json.loads(e).get("usage") is None for e in plain[:-1])


def _sse_events(server, path, body) -> list[str]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line.removeprefix("data: ") for line in lines]


# -- the other routes ------------------------------------------------------------------------

def test_models_version_health_metrics(server, client):
    [card] = client.models.list().data
    assert card.id == MODEL and card.max_model_len == 2100
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket"]:
        assert f"jaxpaged:{name}" in text, name
    from prometheus_client.parser import text_string_to_metric_families

    values = {f.name: f.samples[0].value for f in text_string_to_metric_families(text)}
    # the tiny model's float32 parameters: embedding and LM head V * D, per layer q/k/v, o,
    # gate/up, down and two norms, the final norm; its pool's bytes per token L * 2 * K * H * 4
    V, D, F, N, K, H, L = 49152, 64, 128, 4, 2, 16, 2
    per_layer = D * (N + 2 * K) * H + N * H * D + D * 2 * F + F * D + 2 * D
    assert values["jaxpaged:weight_bytes"] == 4 * (2 * V * D + L * per_layer + D)
    assert values["jaxpaged:kv_cache_bytes_per_token"] == L * 2 * K * H * 4
    assert server.stats()["generation_tokens"] >= 3


def test_tokenize_detokenize(server, tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": PROMPTS[3]}).json()
    assert r["tokens"] == tokenizer(PROMPTS[3]).input_ids
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2100
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == PROMPTS[3]
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    [ref] = tiny_llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert chat["tokens"] == ref.prompt_token_ids
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [49152]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
