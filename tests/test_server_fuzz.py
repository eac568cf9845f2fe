"""No request can kill or stall the server, fuzzed: request bodies of any field valid, absent
or any JSON value get a 200 or an OpenAI-shaped 4xx, never a 5xx or a hang; and a half-minute
soak of 64 clients. The review's findings, one reproducer each, are
tests/test_server_reliability.py's.

The server is uvicorn on 127.0.0.1 in a thread (`server_utils.ServerThread`), the tiny model."""

from __future__ import annotations

import asyncio
import functools
import random
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from server_utils import BIG_PROMPT, wait_idle
from server_utils import RELIABILITY_MODEL as MODEL
from server_utils import idle_after, server  # noqa: F401 (fixtures)

JSON = {"Content-Type": "application/json"}


# -- 8. a fuzzed API --------------------------------------------------------------------------

# No subnormal floats: XLA's CPU runtime sets flush-to-zero in this process.
floats = functools.partial(st.floats, allow_subnormal=False)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=6)
    | floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6)
TOKEN = st.integers(0, 49151)
SAMPLING = {
    "max_tokens": st.integers(1, 6), "temperature": floats(0, 2), "top_p": floats(0.01, 1),
    "n": st.integers(1, 3), "seed": st.integers(0, 2**64 - 1), "top_k": st.integers(-1, 60),
    "min_p": floats(0, 1), "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2), "repetition_penalty": floats(0.5, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3) | st.text(min_size=1),
    "stop_token_ids": st.lists(TOKEN, max_size=3), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "stream": st.booleans(),
    "logit_bias": st.dictionaries(TOKEN.map(str), floats(-100, 100), max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
COMPLETIONS = {**SAMPLING, "prompt": st.text(min_size=1, max_size=30)
               | st.lists(TOKEN, min_size=1, max_size=8)
               | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2),
               "echo": st.booleans(), "logprobs": st.integers(0, 5), "best_of": st.integers(1, 3),
               "max_tokens": st.integers(0, 6)}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                 "content": st.text(max_size=20)})
CHAT = {**SAMPLING, "messages": st.lists(MESSAGE, min_size=1, max_size=3),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
        "max_completion_tokens": st.integers(1, 6)}


def _bodies(schema: dict, required: str):
    """Request bodies: each field absent, valid, or any JSON value; unknown fields too."""
    fields = {name: strategy | ANY_JSON for name, strategy in schema.items()}
    return st.fixed_dictionaries({required: fields.pop(required)}, optional={
        **fields, "unknown_field": ANY_JSON})


def _check_any_answer(server, path: str, body: dict) -> None:
    """200 (a stream ending in [DONE] with no error event) or a 4xx in OpenAI's shape, with
    `param` set for a 400; never a 5xx or a hang."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        r.read()
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
            assert "server_error" not in r.text, r.text[-300:]
        return
    assert 400 <= r.status_code < 500, (body, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if r.status_code == 400:
        assert error["param"] is not None, (body, error)


FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=_bodies(COMPLETIONS, "prompt"))
# Defects found before (the review's, and the fuzzer's on the code before this file):
@example(body={"prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 0})
@example(body={"prompt": "Hi", "max_tokens": 4, "n": 300})
@example(body={"prompt": "Hi", "max_tokens": 0, "echo": True, "logprobs": 1})
@example(body={"prompt": "Hi", "logit_bias": {"49152": 1.0}})
@example(body={"prompt": "Hi", "max_tokens": "4", "stream": "yes"})
def test_fuzzed_completions_never_fail_the_server(server, body):
    _check_any_answer(server, "/v1/completions", body)
    assert httpx.get(f"{server.url}/health").status_code == 200


@FUZZ
@given(body=_bodies(CHAT, "messages"))
@example(body={"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
               "max_tokens": 2})
@example(body={"messages": [{"role": "user", "content": "Hi"}], "best_of": 300, "n": 300})
def test_fuzzed_chat_completions_never_fail_the_server(server, body):
    _check_any_answer(server, "/v1/chat/completions", body)
    assert httpx.get(f"{server.url}/health").status_code == 200


# -- 9. soak ----------------------------------------------------------------------------------

SOAK_SECONDS = 30
FINDINGS = [  # (path, body, expected status): one of each finding of the review
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 0},
     200),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 2, "logprobs": True}, 200),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "n": 300}, 400),
    ("/v1/completions", {"prompt": BIG_PROMPT, "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": "Hi", "stop": ["s" * 200 + str(i) for i in range(10_000)]},
     400),
    ("/v1/completions", {"prompt": "Hi", "temperature": 2.5}, 400),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0, "echo": True, "logprobs": 1}, 200),
]


@pytest.mark.timing
def test_soak_64_clients(server):
    """64 clients for half a minute: completions and chat, streamed and not, some leaving
    early, a few malformed bodies, and each finding of the review once
    (test_server_reliability.py). No 5xx, and afterwards nothing running or waiting and every
    block free."""
    statuses: list[tuple[int, str]] = []

    async def disconnect_mid_body():
        host, port = server.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 500\r\n\r\n{\"messages\"")
        await writer.drain()
        writer.close()

    async def client(i: int, http: httpx.AsyncClient, deadline: float):
        rng = random.Random(i)
        if i < len(FINDINGS):
            path, body, expected = FINDINGS[i]
            r = await http.post(path, json={"model": MODEL, **body})
            assert r.status_code == expected, (body, r.text[:300])
        if i == len(FINDINGS):
            await disconnect_mid_body()
        while time.monotonic() < deadline:
            chat = rng.random() < 0.5
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body = {"model": MODEL, "max_tokens": rng.randint(1, 24),
                    "temperature": rng.choice([0, 0.7, 1.0])}
            if chat:
                body["messages"] = [{"role": "user", "content": f"Say {rng.randint(0, 99)}"}]
            else:
                body["prompt"] = f"Count to {rng.randint(0, 99)}:"
            kind = rng.random()
            if kind < 0.05:  # malformed
                r = await http.post(path, content=b'{"prompt": ', headers=JSON)
                statuses.append((r.status_code, "malformed"))
                continue
            if kind < 0.5:
                r = await http.post(path, json=body)
                statuses.append((r.status_code, r.text[:200]))
                continue
            leave_after = rng.randint(1, 3) if kind < 0.65 else None
            async with http.stream("POST", path, json={**body, "stream": True}) as r:
                statuses.append((r.status_code, "stream"))
                n = 0
                async for line in r.aiter_lines():
                    assert "server_error" not in line, line
                    n += bool(line)
                    if leave_after is not None and n >= leave_after:
                        break  # leaving the block closes the connection: a disconnect

    async def run():
        deadline = time.monotonic() + SOAK_SECONDS
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*[client(i, http, deadline) for i in range(64)])

    asyncio.run(run())
    assert len(statuses) > 100
    assert not [s for s in statuses if s[0] >= 500], [s for s in statuses if s[0] >= 500][:5]
    assert {s for s, _ in statuses} <= {200, 400}
    wait_idle(server)
    stats = server.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
