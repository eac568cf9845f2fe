"""The compilation cache (`jaxpaged.worker.compilation_cache`): a second engine in a fresh process
compiles nothing, and a changed model shape, dtype or damaged file never reuses a wrong entry.

XLA compiles are counted with JAX's own event `/jax/core/compile/backend_compile_duration`,
recorded with the function's name for every executable JAX compiles; an executable loaded by
jaxpaged's cache records none. The engine's programs are the model step (`model_step`), the
multi-step decoding call (`multi_step`) and the sampler (`sample`); the small helpers around
them (the weights' layout, the pool's zeros, row gathers: a few tenths of a second in all)
compile in every process (JAX's own persistent cache stays off: `jaxpaged/compilation_cache.py`
says why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Runs in a fresh process, for each of its engines in turn (model dir, dtype, cache folder,
# "precompile" or "lazy"; engines of different models or dtypes share no executable): builds
# the engine, generates greedily, prints one JSON line of how many of the engine's programs JAX
# obtained, what the cache loaded, compiled and found on disk, and the token ids.
SCRIPT = r"""
import json, sys
import jax
events = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, fun_name=None, **kw: events.append((event, fun_name)))
from jaxpaged import LLM, SamplingParams
for model_dir, dtype, cache_dir, precompile in json.loads(sys.argv[1]):
    events.clear()
    llm = LLM(model_dir, dtype=dtype, max_model_len=64, num_kv_blocks=32, max_num_seqs=4,
              max_num_batched_tokens=16, precompile=precompile == "precompile",
              compilation_cache_dir=cache_dir)
    outs = llm.generate(["Hello, my name is", "The capital of France is a city"],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    cache = llm.llm_engine.runner.executables
    obtained = [name for event, name in events
                if event == "/jax/core/compile/backend_compile_duration"]
    print("RESULT " + json.dumps(dict(
        loaded=cache.num_loaded, compiled=cache.num_compiled, on_disk=cache.num_on_disk,
        engine_programs=sum(n in ("jit(model_step)", "jit(sample)", "jit(multi_step)")
                            for n in obtained),
        ids=[o.outputs[0].token_ids for o in outs])), flush=True)
    del llm, outs
"""


def run_engines(*engines: tuple) -> list[dict]:
    """SCRIPT's engines, each (model dir, cache folder, dtype, precompile), one after another
    in one fresh process; with `precompile` False an engine compiles (or loads) only the
    shapes its requests run."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [[str(model_dir), dtype, str(cache_dir), "precompile" if precompile else "lazy"]
            for model_dir, cache_dir, dtype, precompile in engines]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(args)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert len(lines) == len(engines), proc.stdout[-3000:]
    return [json.loads(x[len("RESULT "):]) for x in lines]


def run(model_dir, cache_dir) -> dict:
    """The float32 engine of SCRIPT, precompiled, alone in a fresh process."""
    return run_engines((model_dir, cache_dir, "float32", True))[0]


@pytest.fixture(scope="module")
def warm(tiny_model_dir, tmp_path_factory):
    """A cache folder filled by one engine, and that engine's result."""
    cache_dir = tmp_path_factory.mktemp("compile-cache")
    first = run(tiny_model_dir, cache_dir)
    assert first["compiled"] > 0 and first["loaded"] == 0, first
    return cache_dir, first


@pytest.fixture(scope="module")
def others(tiny_model_dir, warm, tmp_path_factory) -> dict:
    """On the warm folder, in one fresh process, compiling only what their requests run: the
    tiny model in bfloat16 ("bf16"), and the same architecture with a narrower MLP
    ("narrower"); then the tiny model precompiled on a copy of the folder whose every entry
    was cut short ("damaged")."""
    import shutil

    cache_dir, _ = warm
    root = tmp_path_factory.mktemp("other-engines")
    save_tiny_llama(root / "narrower", tiny_model_dir, intermediate_size=96)
    damaged = root / "damaged"
    shutil.copytree(cache_dir, damaged)
    entries = sorted(damaged.rglob("executables/*.bin"))
    assert entries
    for path in entries:
        path.write_bytes(path.read_bytes()[:100])
    results = run_engines((tiny_model_dir, cache_dir, "bfloat16", False),
                          (root / "narrower", cache_dir, "float32", False),
                          (tiny_model_dir, damaged, "float32", True))
    return dict(zip(("bf16", "narrower", "damaged"), results))


def test_a_second_engine_in_a_fresh_process_compiles_nothing(tiny_model_dir, warm):
    cache_dir, first = warm
    second = run(tiny_model_dir, cache_dir)
    assert first["engine_programs"] > 0, first
    assert second["engine_programs"] == 0, second
    # `precompile` found every executable on disk, and loaded those the requests ran.
    assert second["compiled"] == 0 and second["on_disk"] == first["compiled"], second
    assert 0 < second["loaded"] < second["on_disk"], second
    assert second["ids"] == first["ids"]


def test_another_dtype_or_model_shape_compiles_its_own(others):
    # The folder holds every float32 executable of the tiny model: none is found for bfloat16,
    # nor for the same architecture with a narrower MLP (every step shape differs). The
    # engines compile only what their requests run: the shapes of the warm run's, loaded there.
    bf16 = others["bf16"]
    assert bf16["loaded"] == 0 and bf16["engine_programs"] > 0, bf16
    assert bf16["compiled"] == bf16["engine_programs"], bf16
    other = others["narrower"]
    assert other["loaded"] == 0 and other["engine_programs"] > 0, other
    assert other["compiled"] == other["engine_programs"], other


def save_tiny_llama(path, tokenizer_dir, **changes):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY_CONFIG, copy_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **changes})).save_pretrained(path)
    copy_tokenizer(tokenizer_dir, path)


def test_a_damaged_entry_is_compiled_again(warm, others):
    _, first = warm
    result = others["damaged"]
    # Each executable the requests ran was compiled again in place of its damaged file.
    assert result["loaded"] == 0 and result["compiled"] > 0, result
    assert result["ids"] == first["ids"]


def test_cache_dir_resolution(monkeypatch, tmp_path):
    import jax

    from jaxpaged.worker.compilation_cache import ENV_VAR, resolve_cache_dir

    monkeypatch.setenv("JAXPAGED_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    default = resolve_cache_dir("auto")
    assert default.parent == tmp_path / "home" / "compile-cache"
    assert jax.__version__ in default.name and jax.default_backend() in default.name
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "moved"))
    assert resolve_cache_dir("auto").parent == tmp_path / "moved"
    for off in ("off", "0", ""):
        monkeypatch.setenv(ENV_VAR, off)
        assert resolve_cache_dir("auto") is None
    assert resolve_cache_dir(None) is None
    assert resolve_cache_dir(tmp_path / "given").parent == tmp_path / "given"
