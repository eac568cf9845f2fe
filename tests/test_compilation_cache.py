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

# Runs in a fresh process: builds an engine with precompile on, generates greedily, prints how
# many of the engine's programs JAX obtained, what the cache loaded, compiled and found on
# disk, and the token ids.
SCRIPT = r"""
import json, sys
import jax
events = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, fun_name=None, **kw: events.append((event, fun_name)))
from jaxpaged import LLM, SamplingParams
model_dir, dtype, cache_dir, precompile = sys.argv[1:5]
llm = LLM(model_dir, dtype=dtype, max_model_len=64, num_kv_blocks=32, max_num_seqs=4,
          max_num_batched_tokens=32, precompile=precompile == "precompile",
          compilation_cache_dir=cache_dir)
outs = llm.generate(["Hello, my name is", "The capital of France is a city"],
                    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
cache = llm.llm_engine.runner.executables
obtained = [name for event, name in events if event == "/jax/core/compile/backend_compile_duration"]
print(json.dumps(dict(loaded=cache.num_loaded,
                      engine_programs=sum(n in ("jit(model_step)", "jit(sample)", "jit(multi_step)")
                                          for n in obtained),
                      compiled=cache.num_compiled, on_disk=cache.num_on_disk,
                      ids=[o.outputs[0].token_ids for o in outs])))
"""


def run(model_dir, cache_dir, dtype="float32", precompile=True) -> dict:
    """The engine of SCRIPT in a fresh process; with `precompile` False it compiles (or loads)
    only the shapes its requests run."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), dtype, str(cache_dir),
                           "precompile" if precompile else "lazy"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def warm(tiny_model_dir, tmp_path_factory):
    """A cache folder filled by one engine, and that engine's result."""
    cache_dir = tmp_path_factory.mktemp("compile-cache")
    first = run(tiny_model_dir, cache_dir)
    assert first["compiled"] > 0 and first["loaded"] == 0, first
    return cache_dir, first


def test_a_second_engine_in_a_fresh_process_compiles_nothing(tiny_model_dir, warm):
    cache_dir, first = warm
    second = run(tiny_model_dir, cache_dir)
    assert first["engine_programs"] > 0, first
    assert second["engine_programs"] == 0, second
    # `precompile` found every executable on disk, and loaded those the requests ran.
    assert second["compiled"] == 0 and second["on_disk"] == first["compiled"], second
    assert 0 < second["loaded"] < second["on_disk"], second
    assert second["ids"] == first["ids"]


def test_another_dtype_or_model_shape_compiles_its_own(tiny_model_dir, warm, tmp_path):
    cache_dir, first = warm
    # The folder holds every float32 executable of the tiny model: none is found for bfloat16,
    # nor for the same architecture with a narrower MLP (every step shape differs). The
    # engines compile only what their requests run: the shapes of the warm run's, loaded there.
    bf16 = run(tiny_model_dir, cache_dir, "bfloat16", precompile=False)
    assert bf16["loaded"] == 0 and bf16["engine_programs"] > 0, bf16
    assert bf16["compiled"] == bf16["engine_programs"], bf16
    narrower = tmp_path / "narrower"
    save_tiny_llama(narrower, tiny_model_dir, intermediate_size=96)
    other = run(narrower, cache_dir, precompile=False)
    assert other["loaded"] == 0 and other["engine_programs"] > 0, other
    assert other["compiled"] == other["engine_programs"], other


def save_tiny_llama(path, tokenizer_dir, **changes):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY_CONFIG, copy_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **changes})).save_pretrained(path)
    copy_tokenizer(tokenizer_dir, path)


def test_a_damaged_entry_is_compiled_again(tiny_model_dir, warm, tmp_path):
    import shutil

    cache_dir, first = warm
    damaged = tmp_path / "damaged"
    shutil.copytree(cache_dir, damaged)
    entries = sorted(damaged.rglob("executables/*.bin"))
    assert entries
    for path in entries:
        path.write_bytes(path.read_bytes()[:100])
    result = run(tiny_model_dir, damaged)
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
