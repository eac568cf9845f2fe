"""The command line: `jaxpaged generate` and `jaxpaged chat` print what `LLM` returns, and
`jaxpaged serve` serves it over HTTP."""

import signal
import subprocess
import sys
import time

import openai
import pytest

from jaxpaged import LLM, SamplingParams
from server_utils import free_port, healthy


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxpaged.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_generate_and_chat_print_the_greedy_completion(tiny_llm, tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = tiny_llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0].text
    res = run_cli("generate", "Hello world", "--model", str(tiny_model_dir), "--max-tokens", "6",
                  "--temperature", "0", "--max-model-len", "256", "--no-precompile")
    assert res.returncode == 0, res.stderr
    # The tiny model never emits EOS in 6 tokens here, so ignore_eos does not change the text.
    assert res.stdout == want + "\n"

    chat_want = tiny_llm.chat([{"role": "user", "content": "Hi"}], params,
                              use_tqdm=False)[0].outputs[0].text
    res = run_cli("chat", "Hi", "--model", str(tiny_model_dir), "--max-tokens", "6",
                  "--temperature", "0", "--max-model-len", "256", "--no-precompile")
    assert res.returncode == 0, res.stderr
    assert res.stdout == chat_want + "\n"


def test_bad_argument_exits_with_a_clear_error(tiny_model_dir):
    res = run_cli("generate", "Hello", "--model", str(tiny_model_dir), "--temperature", "-1")
    assert res.returncode == 2
    assert "temperature" in res.stderr and "-1" in res.stderr


@pytest.mark.slow
def test_serve_the_default_model_to_the_openai_client(default_model_dir):
    """`jaxpaged serve` on the real model: chat and completions equal `LLM.chat` / `generate`."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "jaxpaged.entrypoints.cli", "serve", "--port", str(port),
                               "--max-model-len", "512", "--num-kv-blocks", "128",
                               "--no-precompile"],  # precompiling is tested elsewhere
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        llm = LLM(default_model_dir, precompile=False, max_model_len=512, num_kv_blocks=128)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        params = SamplingParams(temperature=0, max_tokens=32)
        chat_want = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        completion_want = llm.generate("The capital of France is", params,
                                       use_tqdm=False)[0].outputs[0].text
        deadline = time.monotonic() + 300
        while not healthy(port):
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=300)
        [model] = client.models.list().data
        reply = client.chat.completions.create(model=model.id, messages=messages, temperature=0,
                                               max_tokens=32)
        assert reply.choices[0].message.content == chat_want
        assert "Paris" in chat_want
        completion = client.completions.create(model=model.id, prompt="The capital of France is",
                                               temperature=0, max_tokens=32)
        assert completion.choices[0].text == completion_want
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)




def test_serve_decodes_one_step_a_call_unless_told(tiny_model_dir):
    """`jaxpaged serve` takes num_scheduler_steps 1 (a request arriving during a multi-step
    call would wait for it); --num-scheduler-steps overrides; LLM's default (8) is LLM's. The
    flags leave it unset: the engine config resolves it by usage context (`EngineArgs`)."""
    from jaxpaged.entrypoints.cli import _engine_args, build_parser

    parse = build_parser().parse_args
    serve = _engine_args(parse(["serve", "--model", str(tiny_model_dir)]))
    assert serve.num_scheduler_steps is None
    assert serve.create_engine_config("serve").scheduler.num_scheduler_steps == 1
    assert serve.create_engine_config("offline").scheduler.num_scheduler_steps == 8
    told = _engine_args(parse(["serve", "--model", str(tiny_model_dir),
                               "--num-scheduler-steps", "4"]))
    assert told.create_engine_config("serve").scheduler.num_scheduler_steps == 4
