"""A real uvicorn server on a free port of 127.0.0.1, run in a thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from jaxpaged import LLM
from jaxpaged.engine.async_llm_engine import AsyncLLMEngine
from jaxpaged.server import build_app


class ServerThread:
    """Serves `llm` as `model_name`; `url` is its root, `engine` its `AsyncLLMEngine`."""

    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None,
                 tool_call_parser: str | None = None, allow_runtime_lora_updating: bool = False):
        self.engine = AsyncLLMEngine(llm.llm_engine)
        self.model_name = model_name
        app = build_app(self.engine, model_name, api_key=api_key,
                        tool_call_parser=tool_call_parser,
                        generation_defaults=llm.generation_defaults,
                        allow_runtime_lora_updating=allow_runtime_lora_updating)
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def stats(self) -> dict[str, float]:
        """The engine gauges of `GET /metrics`, by name without the `jaxpaged:` prefix."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics").text
        return {family.name.removeprefix("jaxpaged:"): family.samples[0].value
                for family in text_string_to_metric_families(text)
                if family.type in ("gauge", "counter") and family.samples}


def free_port() -> int:
    """A port of 127.0.0.1 free now (for a server started in another process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    """Whether a server on `port` of 127.0.0.1 answers `GET /health` with 200."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# -- the server of the reliability tests (test_server_reliability.py, test_server_fuzz.py) -----

RELIABILITY_MODEL = "tiny"  # its served model name
BIG_PROMPT = "hello world, " * 160_000  # 2 MB, about 480,000 tokens


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """The tiny model served as `RELIABILITY_MODEL` (max_num_seqs 8), with the limits of
    conftest's `tiny_llm`: the two engines share their compiled executables."""
    llm = LLM(tiny_model_dir, precompile=False,
              max_model_len=256, num_kv_blocks=256, max_num_seqs=8)
    with ServerThread(llm, RELIABILITY_MODEL) as server:
        yield server


@pytest.fixture(autouse=True)
def idle_after(request):
    """After each test that used `server`: nothing running or waiting, every block free,
    /health 200."""
    yield
    if "server" in request.fixturenames:
        server = request.getfixturevalue("server")
        wait_idle(server)
        assert httpx.get(f"{server.url}/health").status_code == 200


def wait_idle(server: ServerThread, timeout: float = 10.0) -> None:
    """Waits until `server`'s engine has nothing running or waiting and every block free;
    fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        s = server.stats()
        if (s["num_requests_running"] == s["num_requests_waiting"] == 0
                and s["num_kv_blocks_free"] == s["num_kv_blocks_total"]):
            return
        assert time.monotonic() < deadline, f"engine not idle after {timeout} s: {s}"
        time.sleep(0.02)
