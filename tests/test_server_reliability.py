"""No request can kill or stall the server: each finding of the abusive-client review as a
reproducer over both routes, streamed and not. The fuzzed API and the soak are
tests/test_server_fuzz.py's.

The server is uvicorn on 127.0.0.1 in a thread (`server_utils.ServerThread`), the tiny model."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from server_utils import BIG_PROMPT, ServerThread
from server_utils import RELIABILITY_MODEL as MODEL
from server_utils import idle_after, server  # noqa: F401 (fixtures)

from jaxpaged import LLM, SamplingParams
from jaxpaged.server import run_server

JSON = {"Content-Type": "application/json"}


def _post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120,
                      **kwargs)


def _sse(server, path: str, body: dict) -> list[dict | str]:
    """A stream's events, decoded; "[DONE]" last."""
    with httpx.stream("POST", f"{server.url}{path}", json={"model": MODEL, **body},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def _assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@contextlib.contextmanager
def _captured_logs():
    """Log records of jaxpaged (INFO and up) and uvicorn, as a list."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(logging.INFO)
    loggers = [logging.getLogger(name) for name in ("", "uvicorn")]  # uvicorn's don't propagate
    jaxpaged_logger = logging.getLogger("jaxpaged")
    level = jaxpaged_logger.level
    jaxpaged_logger.setLevel(logging.INFO)
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        jaxpaged_logger.setLevel(level)


# -- 1. logprobs 0, and chat logprobs without top_logprobs ------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_zero_on_completions(server, tiny_llm, stream):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 0}
    [ref] = tiny_llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2, logprobs=0),
                              use_tqdm=False)
    c = ref.outputs[0]
    if stream:
        events = _sse(server, "/v1/completions", {**body, "stream": True})
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        lps = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"]]
        token_logprobs = [x for lp in lps for x in lp["token_logprobs"]]
        top = [x for lp in lps for x in lp["top_logprobs"]]
    else:
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        token_logprobs, top = lp["token_logprobs"], lp["top_logprobs"]
    assert token_logprobs == pytest.approx(
        [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)], abs=1e-5)
    # OpenAI's completions format: at most logprobs + 1 entries, the sampled token always.
    assert [len(t) for t in top] == [1, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_without_top_logprobs(server, stream):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "temperature": 0, "logprobs": True}
    if stream:
        events = _sse(server, "/v1/chat/completions", {**body, "stream": True})
        content = [x for e in events[:-1] for ch in e["choices"]
                   if ch.get("logprobs") for x in ch["logprobs"]["content"]]
    else:
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(e["logprob"] <= 0 and e["top_logprobs"] == [] for e in content)


# -- 2. more completions than max_num_seqs: a 400, and nothing waits behind it ----------------

@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"prompt": "Hi", "n": 300}, "n"),
    ("/v1/completions", {"prompt": "Hi", "n": 1_000_000}, "n"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 300}, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 300}, "n"),
])
def test_seats_over_max_num_seqs_are_a_400(server, path, fields, param):
    error = _assert_openai_error(_post(server, path, {"max_tokens": 4, **fields}), 400, param)
    assert "max_num_seqs=8" in error["message"]
    r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}, )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


# -- 3. large inputs cost only their own client's time ----------------------------------------

@pytest.mark.timing
def test_large_inputs_do_not_stall_a_stream(server):
    """A stream's chunks keep coming while 2 MB prompts are tokenized and refused and
    `/tokenize` counts 2 MB texts: on the engine's thread each took about a second."""
    arrivals, started = [], threading.Event()

    def read_stream():
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 250,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    arrivals.append(time.monotonic())
                    started.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert started.wait(60)
    window = [time.monotonic()]
    for i in range(3):
        r = _post(server, "/v1/completions", {"prompt": BIG_PROMPT, "max_tokens": 4})
        _assert_openai_error(r, 400, "prompt")
        r = _post(server, "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": BIG_PROMPT}], "max_tokens": 4})
        _assert_openai_error(r, 400, "messages")
        r = httpx.post(f"{server.url}/tokenize", json={"prompt": BIG_PROMPT}, timeout=120)
        assert r.status_code == 200  # the body (480,000 ids) is left unparsed, on purpose
    window.append(time.monotonic())
    reader.join()
    during = [t for t in arrivals if window[0] <= t <= window[1]]
    gaps = [b - a for a, b in zip(during, during[1:])]
    before = [t for t in arrivals if t < window[0]]
    usual = sorted(b - a for a, b in zip(before, before[1:]))
    assert window[1] - window[0] > 1.0, "the big inputs took too little time to test anything"
    # A big input on the engine's thread stalled the stream for about a second. The bound is
    # half a second, or four times the slowest gap seen before the big inputs where this
    # machine's own steps are slower than that.
    bound = max(0.5, 4 * usual[-1]) if usual else 0.5
    assert len(during) > 10 and max(gaps) < bound, (len(during), max(gaps, default=None), bound)


def test_a_huge_stop_list_is_a_400(server):
    stop = ["s" * 200 + str(i) for i in range(10_000)]
    _assert_openai_error(_post(server, "/v1/completions", {"prompt": "Hi", "stop": stop}),
                         400, "stop")
    r = _post(server, "/v1/completions",
              {"prompt": "Hi", "stop": [f"never {i}" for i in range(64)], "max_tokens": 8})
    assert r.status_code == 200


# -- 4. a client that disconnects while sending its body --------------------------------------

def test_disconnect_while_sending_the_body_is_quiet(server):
    host, port = server.url.removeprefix("http://").split(":")
    with _captured_logs() as records:
        for _ in range(5):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_gone(records)) < 5:
            time.sleep(0.05)
        time.sleep(0.2)  # anything logged after the disconnect lines would come now
    assert [r for r in records if r.levelno >= logging.WARNING] == []
    assert len(_gone(records)) == 5 and all(r.exc_info is None for r in _gone(records))


def _gone(records) -> list:
    return [r for r in records if "disconnected while sending its body" in r.getMessage()]


# -- 5. validation as OpenAI's API ------------------------------------------------------------

BAD_BODIES = [  # (param, raw JSON of the extra fields)
    ("temperature", '"temperature": 2.5'),
    ("temperature", '"temperature": 1e309'),
    ("temperature", '"temperature": "inf"'),
    ("temperature", '"temperature": NaN'),
    ("repetition_penalty", '"repetition_penalty": 1e309'),
    ("max_tokens", '"max_tokens": "4"'),
    ("n", '"n": true'),
    ("stream", '"stream": "yes"'),
    ("logit_bias", '"logit_bias": {"49152": 1}'),
    ("stop_token_ids", '"stop_token_ids": [49152]'),
    ("max_tokens", '"max_tokens": 0'),  # 0 only with echo
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("param,raw", BAD_BODIES, ids=[raw for _, raw in BAD_BODIES])
def test_bad_values_are_a_400_naming_the_field(server, path, param, raw):
    if path.endswith("chat/completions"):
        if param == "max_tokens" and raw.endswith("0"):
            param, raw = "max_tokens", '"max_completion_tokens": -1'
            param = "max_completion_tokens"
        start = '{"messages": [{"role": "user", "content": "Hi"}], '
    else:
        start = '{"prompt": "Hi", '
    r = httpx.post(f"{server.url}{path}", content=start + raw + "}", headers=JSON, timeout=60)
    _assert_openai_error(r, 400, param)


def test_a_body_not_sent_as_json_is_refused(server):
    for headers in [{"Content-Type": "text/plain"}, {}]:
        r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "Hi"}',
                       headers=headers)
        _assert_openai_error(r, 415)


def test_unknown_fields_are_logged_once(server):
    with _captured_logs() as records:
        r = _post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi", "weight": 2}], "max_tokens": 2,
            "frobnicate": True, "stream_options": {"nope": 1}})
    assert r.status_code == 200
    [warning] = [r for r in records if r.levelno == logging.WARNING]
    assert "frobnicate" in warning.getMessage() and "messages.0.weight" in warning.getMessage()
    assert "stream_options.nope" in warning.getMessage()


# -- 6. echo with max_tokens 0 scores the prompt ----------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs(server, tiny_llm,
                                                                        stream):
    prompt = "The capital of France is"
    [ref] = tiny_llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1),
                              use_tqdm=False)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    if stream:
        events = _sse(server, "/v1/completions",
                      {**body, "stream": True, "stream_options": {"include_usage": True}})
        choices = [ch for e in events[:-1] for ch in e["choices"]]
        text = "".join(ch["text"] for ch in choices)
        token_logprobs = [x for ch in choices for x in ch["logprobs"]["token_logprobs"]]
        usage, finish = events[-2]["usage"], choices[-1]["finish_reason"]
    else:
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        [choice] = r.json()["choices"]
        text, token_logprobs = choice["text"], choice["logprobs"]["token_logprobs"]
        usage, finish = r.json()["usage"], choice["finish_reason"]
    assert text == prompt and finish == "length"
    assert usage["completion_tokens"] == 0
    assert usage["prompt_tokens"] == len(ref.prompt_token_ids)
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(
        [entry[t].logprob for t, entry in zip(ref.prompt_token_ids[1:],
                                               ref.prompt_logprobs[1:])], abs=1e-4)


# -- 7. fault isolation -----------------------------------------------------------------------

def _fault_for_seed(seed):
    def hook(out):
        if any(s.params.seed == seed for s in out.seqs):
            raise RuntimeError(f"injected fault (seed {seed})")
    return hook


def test_a_step_fault_fails_only_its_request(server, tiny_llm):
    runner = server.engine.engine.runner
    prompt = "In a hole in the ground"
    [ref] = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40),
                              use_tqdm=False)
    good = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
    bad = {"prompt": "Hi", "max_tokens": 40, "seed": 666}
    results = {}

    def send(name, path, body):
        if body.get("stream"):
            results[name] = _sse(server, path, body)
        else:
            results[name] = _post(server, path, body)

    runner.fault_hook = _fault_for_seed(666)
    try:
        threads = [threading.Thread(target=send, args=args) for args in [
            ("good", "/v1/completions", good),
            ("good-stream", "/v1/completions", {**good, "stream": True}),
            ("bad", "/v1/completions", bad),
            ("bad-stream", "/v1/completions", {**bad, "stream": True}),
            ("bad-chat", "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "Hi"}], "seed": 666})]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        runner.fault_hook = None
    assert results["good"].json()["choices"][0]["text"] == ref.outputs[0].text
    events = results["good-stream"]
    assert "".join(ch["text"] for e in events[:-1] for ch in e["choices"]) == \
        ref.outputs[0].text
    for name in ("bad", "bad-chat"):
        error = _assert_openai_error(results[name], 500)
        assert error["type"] == "server_error"
        assert "injected fault (seed 666)" in error["message"]
    events = results["bad-stream"]
    assert events[-1] == "[DONE]" and "injected fault" in events[-2]["error"]["message"]


def _always(out):
    raise RuntimeError("injected fault in every step")


def test_a_request_that_always_fails_is_retried_without_stopping_the_server(server):
    """OpenAI's SDK retries a 500 twice: a request that always fails, alone on an idle server,
    fails each time, and the server goes on."""
    runner = server.engine.engine.runner
    runner.fault_hook = _fault_for_seed(666)
    try:
        for _ in range(3):
            r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "seed": 666})
            assert "injected fault" in _assert_openai_error(r, 500)["message"]
    finally:
        runner.fault_hook = None
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.stats()["num_requests_failed"] >= 3


def test_a_fatal_fault_gives_503_and_serve_exits_1(tiny_model_dir):
    llm = LLM(tiny_model_dir, precompile=False, max_model_len=64, num_kv_blocks=16, max_num_seqs=2)
    llm.llm_engine.runner.fault_hook = _always
    with ServerThread(llm, MODEL) as server:
        r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert "fatal fault" in _assert_openai_error(r, 500)["message"]
        error = _assert_openai_error(httpx.get(f"{server.url}/health"), 503)
        assert error["message"] == "the engine stopped on a fatal fault; restart the server"
        _assert_openai_error(_post(server, "/v1/completions", {"prompt": "Hi"}), 503)
    # The same through `run_server` (what `jaxpaged serve` runs): it exits with status 1.
    llm = LLM(tiny_model_dir, precompile=False, max_model_len=64, num_kv_blocks=16, max_num_seqs=2)
    llm.llm_engine.runner.fault_hook = _always
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status = []
    thread = threading.Thread(target=lambda: status.append(
        run_server(llm, MODEL, port=port, log_level="warning")), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    deadline = time.monotonic() + 60
    while not status and time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        time.sleep(0.05)
    thread.join(timeout=30)
    assert status == [1]
