"""The multi-process engine client (`jaxpaged.distributed.multihost.LeaderEngine`): on two
processes (one CPU device each, TP 2 across them, joined through `jax.distributed` on
127.0.0.1), every engine operation either gives the one-process result or is refused by name,
and none hangs (each case runs under a timeout in tests/multihost_worker.py); completions after
them still work. One process pair runs every case, in order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.distributed.multihost import (FORWARDED, HOST_READS, REFUSED,
                                            MultiProcessUnsupportedError)
from server_utils import ServerThread, free_port

WORKER = Path(__file__).parent / "multihost_worker.py"
CASE_TIMEOUT_S = 60
PROMPT = list(range(100, 140))  # 2 full blocks: prefix-cached
EMBED_IDS = [[5, 17, 300, 4000, 48000, 12], [9, 8, 7]]
GENERATIONS = ("generate", "generate_after_embed", "generate_after_reset",
               "generate_after_wake_up", "sleep2_wake_up_generate")


@pytest.fixture(scope="module")
def pair(tiny_model_dir) -> list[dict]:
    """Each process's RESULT: process 0's cases, then each process's engine stats."""
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps({
            "model": str(tiny_model_dir), "distributed": [address, 2, i],
            "timeout_s": CASE_TIMEOUT_S, "prompt": PROMPT, "embed": EMBED_IDS})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    try:
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    results = []
    for p, output in zip(procs, outputs):
        lines = [x for x in output.splitlines() if x.startswith("RESULT ")]
        assert lines, output[-5000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    hung = [name for name, got in results[0].items() if "timeout" in got]
    assert not hung, f"{hung} did not return within {CASE_TIMEOUT_S} s"
    assert all(p.returncode == 0 for p in procs), outputs[1][-5000:]
    return results


@pytest.fixture(scope="module")
def one_process(tiny_model_dir) -> dict:
    """The same calls on one process and one device."""
    llm = LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=64, precompile=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [output] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    embeddings = llm.embed([{"prompt_token_ids": ids} for ids in EMBED_IDS])
    return {"ids": list(output.outputs[0].token_ids),
            "embed": [e.outputs.embedding for e in embeddings]}


def test_the_operation_lists_are_disjoint():
    assert not set(FORWARDED) & HOST_READS
    assert not set(REFUSED) & (set(FORWARDED) | HOST_READS)


def test_a_refusal_is_both_not_implemented_and_a_missing_attribute():
    error = MultiProcessUnsupportedError("load_weights")
    assert isinstance(error, NotImplementedError) and isinstance(error, AttributeError)
    assert str(error).startswith("load_weights is not supported when the engine runs on "
                                 "several processes: the checkpoint tensors would have to reach")


def test_the_server_answers_a_refusal_with_501(tiny_llm, monkeypatch):
    """A refused engine operation is an HTTP error naming it, not a hang or a bare 500."""
    def refuse(*args):
        raise MultiProcessUnsupportedError("get_params")

    monkeypatch.setattr(tiny_llm.llm_engine, "embed", refuse)
    with ServerThread(tiny_llm, "tiny") as server:
        r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "tiny", "input": [5, 17]},
                       timeout=60)
    assert r.status_code == 501
    assert r.json()["error"]["type"] == "not_implemented_error"
    assert r.json()["error"]["message"].startswith(
        "get_params is not supported when the engine runs on several processes")


@pytest.mark.parametrize("case", GENERATIONS)
def test_completions_equal_one_process(pair, one_process, case):
    """Before and after embeddings, a prefix-cache reset, sleep/wake-up at levels 1 and 2."""
    assert pair[0][case] == {"value": one_process["ids"]}


@pytest.mark.parametrize("case", ["embed", "embed_at_end"])
def test_embeddings_equal_one_process(pair, one_process, case):
    np.testing.assert_allclose(pair[0][case]["value"], one_process["embed"], atol=1e-5)


@pytest.mark.parametrize("case", ["update_params", "load_weights", "get_params"])
def test_new_weights_are_refused_by_name(pair, case):
    assert pair[0][case]["error"].startswith(
        f"MultiProcessUnsupportedError: {case} is not supported when the engine runs on several "
        "processes: ")


def test_other_engine_internals_are_refused_by_name(pair):
    assert pair[0]["scheduler"]["error"].startswith(
        "MultiProcessUnsupportedError: scheduler is not supported when the engine runs on "
        "several processes: LeaderEngine forwards only add_request, abort_request, step, ")


def test_prefix_cache_reset_and_sleep_give_one_process_results(pair):
    assert pair[0]["reset_prefix_cache"] == {"value": True}
    assert pair[0]["sleep_then_generate"] == {
        "error": "RuntimeError: the engine is asleep (sleep level 1): call wake_up() before "
                 "generating"}
    assert pair[0]["wake_up"] == {"value": None}


def test_the_follower_made_the_same_calls(pair):
    """Equal token counts, prefix-cache hits (the reset reached it) and free blocks."""
    leader, follower = pair[0]["stats"], pair[1]["stats"]
    assert leader == follower
    assert leader["num_prefix_cache_hits"] > 0 and leader["num_generation_tokens"] == 8 * 5
