"""Tensor parallelism on 8 CPU devices (`--xla_force_host_platform_device_count=8`, in a fresh
process: jax reads it once): greedy ids under TP 2, 4 and 8 equal TP 1 on tiny models with 1, 2
and 8 KV heads (1 and 2 repeated to one per device) and on Qwen2 (biases on q/k/v); the
compiled step's collectives are those the partitioning implies; `jaxpaged serve` with TP 4; an
orbax checkpoint restored into its shards; new weights (`update_params`, `load_weights`) placed
shard by shard. Several processes: two with 2 CPU devices each,
joined through `jax.distributed` on 127.0.0.1 (gloo), run TP 4 across them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.entrypoints import cli
from jaxpaged.models import load_config
from jaxpaged.distributed.parallel import make_mesh
from server_utils import free_port, healthy

WORKER = Path(__file__).parent / "tp_worker.py"
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, max_position_embeddings=512, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1,
            eos_token_id=2)
MODELS = {  # name -> (transformers class names, config overrides)
    "llama-kv1": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1)),
    "llama-kv2": ("LlamaConfig", "LlamaForCausalLM",
                  dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-kv8": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=8)),
    "qwen2-kv2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    # 8 experts, top-2: each expert's hidden units split (TP), or whole experts (EP)
    "mixtral-kv2": ("MixtralConfig", "MixtralForCausalLM",
                    dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)),
}
# The tensor-parallel sizes each model runs at (and at 1, the reference): each split once. One
# KV head repeated to every device (kv1, 8); 2 heads split (kv2, 2) and repeated twice (kv2,
# 4; the same with q/k/v biases: qwen2, 2 and 4); 8 heads four and one per device (kv8, 2 and
# 8); the experts' hidden units in halves (mixtral, 2; all 8 devices hold experts under expert
# parallelism below).
TP_SIZES = {"llama-kv1": (8,), "llama-kv2": (2, 4), "llama-kv8": (2, 8),
            "qwen2-kv2": (2, 4), "mixtral-kv2": (2,)}
EXPERT_PARALLEL_SIZES = (2, 8)  # four experts a device, and one


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    import torch
    import transformers

    root = tmp_path_factory.mktemp("tp-models")
    dirs = {}
    for name, (config_cls, model_cls, overrides) in MODELS.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**{**BASE, **overrides})
        getattr(transformers, model_cls)(config).save_pretrained(root / name)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_model_dir / f, root / name / f)
        dirs[name] = root / name
    return dirs


def run_worker(args: dict, timeout: float = 900, cache_dir: Path | None = None) -> dict:
    """Runs tp_worker.py; with `cache_dir`, on that compilation cache folder."""
    env = dict(os.environ, **({} if cache_dir is None else
                              {"JAXPAGED_COMPILATION_CACHE_DIR": str(cache_dir)}))
    res = subprocess.run([sys.executable, str(WORKER), json.dumps(args)], capture_output=True,
                         text=True, timeout=timeout, env=env)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def orbax_model(tp_models, tmp_path_factory) -> Path:
    """llama-kv2 converted by `jaxpaged convert`."""
    out = tmp_path_factory.mktemp("orbax") / "llama-kv2-orbax"
    assert cli.main(["convert", str(tp_models["llama-kv2"]), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def tp_results(tp_models, orbax_model, tmp_path_factory) -> dict:
    # On an empty compilation cache: the orbax run loads the executables the TP 4 run of the
    # same model wrote, each onto its mesh's 4 devices of the 8.
    runs = [[str(tp_models[name]), tp] for name, sizes in TP_SIZES.items()
            for tp in (1, *sizes)]
    runs += [[str(tp_models["llama-kv2"]), tp, kv] for kv in ("int8", "fp8") for tp in (1, 4)]
    updates = [[str(tp_models["llama-kv2"]), 4], [str(tp_models["qwen2-kv2"]), 2]]
    multi_step = [[str(tp_models["llama-kv2"]), 4], [str(tp_models["qwen2-kv2"]), 2]]
    expert_parallel = [[str(tp_models["mixtral-kv2"]), tp] for tp in EXPERT_PARALLEL_SIZES]
    return run_worker({"runs": runs + [[str(orbax_model), 4]],
                       "hlo": str(tp_models["llama-kv2"]), "shards": str(orbax_model),
                       "updates": updates, "multi_step": multi_step,
                       "expert_parallel": expert_parallel,
                       "async": [[str(tp_models["llama-kv2"]), 4]]},
                      cache_dir=tmp_path_factory.mktemp("tp-compile-cache"))


@pytest.mark.parametrize("model, tp", [(name, tp) for name, sizes in TP_SIZES.items()
                                       for tp in sizes])
def test_greedy_ids_equal_one_device(tp_results, model, tp):
    ids = tp_results["ids"]
    assert ids[f"{model}/{tp}"] == ids[f"{model}/1"]
    assert all(len(x) == 8 for x in ids[f"{model}/1"])


@pytest.mark.parametrize("tp", EXPERT_PARALLEL_SIZES)
def test_expert_parallel_equals_one_device(tp_results, tp):
    """`enable_expert_parallel`: each device holds 8 / tp whole experts (layer 0's shards
    [8 / tp, D, 2F]), runs its experts' pairs, and one all-reduce sums them: the greedy ids of
    one device."""
    assert tp_results["expert_shards"][f"mixtral-kv2/{tp}"] == [[8 // tp, 64, 256]] * tp
    assert tp_results["ids"][f"mixtral-kv2/{tp}/ep"] == tp_results["ids"]["mixtral-kv2/1"]


@pytest.mark.parametrize("model, tp", [("llama-kv2", 4), ("qwen2-kv2", 2)])
def test_multi_step_decoding_equals_one_device(tp_results, model, tp):
    """Four decode steps a call (`num_scheduler_steps=4`), the greedy draws fed back on the
    sharded devices: the ids of single steps on one device."""
    assert tp_results["multi_step_ran"][f"{model}/{tp}"]
    assert tp_results["ids"][f"{model}/{tp}/steps4"] == tp_results["ids"][f"{model}/1"]


def test_async_scheduling_equals_one_device(tp_results):
    """Async scheduling on 4 devices (a step's inputs read from the last step's replicated
    draws): the ids of synchronous steps on one device."""
    assert tp_results["overlapped"]["llama-kv2/4"] > 0
    assert tp_results["ids"]["llama-kv2/4/async"] == tp_results["ids"]["llama-kv2/1"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_an_8bit_pool_is_sharded_by_kv_head(tp_results, kv_cache_dtype):
    """An 8-bit pool's codes and scales both split on their KV-head axis (2 heads repeated to
    4, one per device), and TP 4 gives the one-device engine's greedy ids."""
    ids, pools = tp_results["ids"], tp_results["pools"]
    assert ids[f"llama-kv2/4/{kv_cache_dtype}"] == ids[f"llama-kv2/1/{kv_cache_dtype}"]
    L, P, S, H = 2, 64, 16, 8
    assert pools[f"llama-kv2/4/{kv_cache_dtype}"] == [
        ["P(None, None, 'model')", [L, 2, 1, P, S, H]],  # codes
        ["P(None, None, 'model')", [L, 2, 1, P, S]]]  # scales
    assert pools["llama-kv2/4"] == [["P(None, None, 'model')", [L, 2, 1, P, S, H]]]


@pytest.mark.parametrize("run", ["llama-kv2/4", "qwen2-kv2/2"])
def test_new_weights_reach_each_shard(tp_results, run):
    """`load_weights` with HF tensors, and `update_params` with NumPy (unsharded) arrays, give
    a TP engine the one-device engine's outputs (KV heads repeated on llama-kv2 at TP 4, q/k/v
    biases on qwen2)."""
    got = tp_results["updates"][run]
    assert got["before"] == tp_results["ids"][run]
    assert got["one_device_perturbed"] != got["before"]  # the new weights change the output
    assert got["update_params"] == got["one_device_perturbed"]
    assert got["load_weights_original"] == got["before"]
    assert got["load_weights_perturbed"] == got["one_device_perturbed"]


def test_the_step_communicates_what_the_partitioning_implies(tp_results):
    """Per layer two all-reduces (after the row-parallel o_proj and down_proj), one for the
    vocabulary-parallel embedding lookup, one of the step's greedy draws (each device's first
    index of the row maximum in its vocabulary slice), one all-gather of the logits, and
    nothing that gathers a weight matrix."""
    hlo = tp_results["hlo"]
    found, L = hlo["collectives"], hlo["num_layers"]
    assert len(found["all-reduce"]) == 2 * L + 2, found
    assert found["all-reduce"].count("s32[16]") == 1, found  # the greedy token ids [S]
    assert all(shape in ("f32[16,64]", "s32[16]") for shape in found["all-reduce"]), found
    assert found["all-gather"] == ["f32[16,49152]"], found  # the logits [S, V]
    assert not set(found["all-gather"]) & set(hlo["weights"])
    assert not found["reduce-scatter"] and not found["all-to-all"], found
    assert hlo["kv_cache"] == "P(None, None, 'model')"
    assert hlo["qkv"] == "P(None, 'model')"


def test_orbax_restores_each_shard_on_its_device(tp_results):
    """The orbax checkpoint restored for TP 4: the same greedy ids as one device from the
    safetensors, each parameter laid out by its spec, each device holding its own slice."""
    assert tp_results["ids"]["llama-kv2-orbax/4"] == tp_results["ids"]["llama-kv2/1"]
    shards = tp_results["shards"]
    qkv = shards["['layers'][0]['self_attn']['qkv_proj']['kernel'].value"]
    # 8 query heads, and 2 KV heads repeated to 4 for k and v, of 8 features, over 4 devices
    assert qkv["spec"] == "P(None, 'model')" and qkv["shape"] == [64, (8 + 2 * 4) * 8]
    assert sorted(d for d, _, _ in qkv["shards"]) == [0, 1, 2, 3]
    assert len({index for _, index, _ in qkv["shards"]}) == 4
    assert all(shape == [64, 32] for _, _, shape in qkv["shards"])
    embedding = shards["['embed_tokens']['embedding'].value"]
    assert embedding["spec"] == "P('model', None)"
    assert all(shape == [49152 // 4, 64] for _, _, shape in embedding["shards"])
    down = shards["['layers'][1]['mlp']['down_proj']['kernel'].value"]
    assert down["spec"] == "P('model', None)"
    assert all(shape == [128 // 4, 64] for _, _, shape in down["shards"])


def test_a_split_that_cannot_be_made_is_named(tiny_model_dir):
    config = load_config(tiny_model_dir)  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's "
                       "num_attention_heads=4"):
        config.for_tensor_parallel(3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        config.for_tensor_parallel(0)
    split = config.for_tensor_parallel(4)
    assert (split.num_key_value_heads, split.kv_head_replicas) == (4, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices; jax sees 1"):
        make_mesh(2)  # this process has one CPU device
    with pytest.raises(ValueError, match="needs 2 devices"):
        LLM(tiny_model_dir, tensor_parallel_size=2, precompile=False)


@pytest.fixture(scope="module")
def one_device_llm(tp_models) -> LLM:
    return LLM(tp_models["llama-kv2"], precompile=False, max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def served_text(one_device_llm) -> str:
    """One device's greedy completion of the served prompt."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return one_device_llm.generate("The capital of France is", params,
                                   use_tqdm=False)[0].outputs[0].text


def _complete(port: int, model: str, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=300)
    kw = dict(model=model, prompt="The capital of France is", temperature=0, max_tokens=12,
              extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kw))


def test_serve_with_tensor_parallel_4(tp_models, served_text):
    """`jaxpaged serve --tensor-parallel-size 4` on 8 CPU devices: completions, streamed and
    not, equal one device's greedy ids."""
    model = tp_models["llama-kv2"]
    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.entrypoints.cli", "serve", "--model", str(model), "--port",
         str(port), "--tensor-parallel-size", "4", "--no-precompile", "--max-model-len", "256",
         "--num-kv-blocks", "64"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not healthy(port):
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()
            time.sleep(0.5)
        assert _complete(port, str(model)) == served_text
        assert _complete(port, str(model), stream=True) == served_text
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)


def _start_processes(args: dict, num: int = 2) -> list[subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps({**args, "devices": 2,
                                                  "distributed": [address, num, i]})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(num)]


@pytest.fixture(scope="module")
def two_processes(tp_models) -> dict:
    """Two processes of 2 devices each, TP 4 across them on llama-kv2: each one's greedy ids
    ("ids"); then, both generating again, process 1 killed: process 0's output after that
    ("output"), its exit status ("returncode") and the seconds it took to exit ("exit_s")."""
    procs = _start_processes({"runs": [[str(tp_models["llama-kv2"]), 4]], "forever": True})
    try:
        ids = []
        for p in procs:  # both have generated once, and are generating
            for line in p.stdout:
                if line.startswith("RESULT "):
                    ids.append(json.loads(line[len("RESULT "):])["ids"]["llama-kv2/4"])
                if line.startswith("GENERATING"):
                    break
            else:
                pytest.fail("a worker did not start: " + p.stdout.read()[-3000:])
        time.sleep(2)
        procs[1].kill()
        killed = time.monotonic()
        output = procs[0].communicate(timeout=90)[0]
        return dict(ids=ids, output=output, returncode=procs[0].returncode,
                    exit_s=time.monotonic() - killed)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_two_processes_equal_one(two_processes, tp_results):
    assert len(two_processes["ids"]) == 2
    for ids in two_processes["ids"]:
        assert ids == tp_results["ids"]["llama-kv2/1"]


def test_a_dead_process_is_a_clear_error_on_the_other(two_processes):
    """Process 1 killed mid-generation: process 0 fails with EngineDeadError naming the cause
    and exits within 60 s (jax's coordination service then aborts the process). On a loaded
    machine the service's heartbeat check can abort process 0 first, with its own message
    naming the dead task: that is a clear error too."""
    output = two_processes["output"]
    assert two_processes["exit_s"] < 60
    assert two_processes["returncode"] != 0
    ours = ("EngineDeadError: a step across 2 processes failed (another process may have "
            "died)")
    # jax names the dead task on the line after this one.
    jax_first = "The following tasks are unhealthy (stopped sending heartbeats):"
    assert ours in output or jax_first in output, output[-5000:]


def test_serve_on_two_processes(tp_models, served_text, one_device_llm):
    """`jaxpaged serve` on two processes: process 0 serves HTTP, process 1 follows its engine
    calls (embeddings too: they run on both, within 60 s, and completions after them still
    work); both exit 0 when process 0 is interrupted."""
    model = str(tp_models["llama-kv2"])
    address, port = f"127.0.0.1:{free_port()}", free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.entrypoints.cli", "serve", "--model", model, "--port", str(port),
         "--tensor-parallel-size", "4", "--no-precompile", "--max-model-len", "256",
         "--num-kv-blocks", "64", "--coordinator-address",
         address, "--num-processes", "2", "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        while not healthy(port):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.5)
        assert _complete(port, model) == served_text
        assert _complete(port, model, stream=True) == served_text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=60,
                               max_retries=0)
        got = client.embeddings.create(model=model, input="The capital of France is")
        [want] = one_device_llm.embed("The capital of France is")
        np.testing.assert_allclose(got.data[0].embedding, want.outputs.embedding, atol=1e-5)
        assert _complete(port, model) == served_text
        procs[0].send_signal(signal.SIGINT)
        for p in procs:
            assert p.wait(timeout=60) == 0, p.stdout.read()[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()
