"""The command line: `jaxpaged generate` and `jaxpaged chat` print what `LLM` returns."""

import subprocess
import sys

from jaxpaged import SamplingParams


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxpaged.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_generate_and_chat_print_the_greedy_completion(tiny_llm, tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = tiny_llm.generate("Hello world", params, use_tqdm=False)[0].outputs[0].text
    res = run_cli("generate", "Hello world", "--model", str(tiny_model_dir), "--max-tokens", "6",
                  "--temperature", "0", "--max-model-len", "256")
    assert res.returncode == 0, res.stderr
    # The tiny model never emits EOS in 6 tokens here, so ignore_eos does not change the text.
    assert res.stdout == want + "\n"

    chat_want = tiny_llm.chat([{"role": "user", "content": "Hi"}], params,
                              use_tqdm=False)[0].outputs[0].text
    res = run_cli("chat", "Hi", "--model", str(tiny_model_dir), "--max-tokens", "6",
                  "--temperature", "0", "--max-model-len", "256")
    assert res.returncode == 0, res.stderr
    assert res.stdout == chat_want + "\n"


def test_bad_argument_exits_with_a_clear_error(tiny_model_dir):
    res = run_cli("generate", "Hello", "--model", str(tiny_model_dir), "--temperature", "-1")
    assert res.returncode == 2
    assert "temperature" in res.stderr and "-1" in res.stderr
