"""The KV pool sized from the device's memory (`gpu_memory_utilization`, `jaxpaged.worker.memory`),
on CPU with a fake device memory: the weights in use and the largest step's activations come
first, the rest of the allowed fraction goes to the pool; `kv_cache_memory_bytes` and
`num_kv_blocks` override it; devices that report no memory, and engines with a draft model,
keep the 2 GiB default."""

from __future__ import annotations

import pytest

from jaxpaged.worker import memory
from jaxpaged.worker.kv_cache import kv_cache_bytes_per_token

GiB = 1 << 30


def test_budget_is_the_fraction_less_weights_and_activations():
    assert memory.kv_pool_budget(0.9, [(10 * GiB, 2 * GiB)], GiB) \
        == int(0.9 * 10 * GiB) - 3 * GiB
    # Over devices the pool splits evenly: the tightest device's rest, once per device.
    assert memory.kv_pool_budget(0.5, [(10 * GiB, 1 * GiB), (10 * GiB, 2 * GiB)], GiB) \
        == 2 * (5 * GiB - 3 * GiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2"):
        memory.kv_pool_budget(0.2, [(10 * GiB, 0), (10 * GiB, 2 * GiB)], GiB)


def test_cpu_devices_report_no_memory():
    import jax

    assert memory.device_memory(jax.local_devices()) is None


@pytest.fixture
def fake_memory(monkeypatch):
    """Every device reports `limit` bytes, `in_use` of them in use (set on the returned dict);
    the devices asked about are kept in "asked"."""
    state = {"limit": 4 * GiB, "in_use": 300 << 20, "asked": []}

    def device_stats(device):
        state["asked"].append(device)
        return {"bytes_limit": state["limit"], "bytes_in_use": state["in_use"]}

    monkeypatch.setattr(memory, "device_stats", device_stats)
    return state


def _pool(llm) -> tuple[int, int]:
    """(blocks, bytes per block) of an engine's pool."""
    engine = llm.llm_engine
    per_block = kv_cache_bytes_per_token(engine.model_config, engine.kv_cache_dtype) \
        * engine.cache_config.block_size
    return engine.block_manager.num_blocks, per_block


def test_pool_from_fake_device_memory(make_llm, tiny_model_dir, fake_memory, monkeypatch):
    activations = []
    real = memory.step_activation_bytes
    monkeypatch.setattr(memory, "step_activation_bytes",
                        lambda c: activations.append(real(c)) or activations[-1])
    llm = make_llm(tiny_model_dir, num_kv_blocks=None, gpu_memory_utilization=0.5,
                   max_num_seqs=8)
    blocks, per_block = _pool(llm)
    import jax

    assert set(fake_memory["asked"]) == {jax.local_devices()[0]}  # the device the model is on
    assert activations and activations[0] > 0  # the largest step's, from its compilation
    assert blocks == (int(0.5 * 4 * GiB) - fake_memory["in_use"] - activations[0]) // per_block
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
    # A larger step (256 sequences' logits) needs more activation memory: fewer blocks.
    bigger = make_llm(tiny_model_dir, num_kv_blocks=None, gpu_memory_utilization=0.5,
                      max_num_seqs=256)
    assert activations[1] > activations[0]
    assert _pool(bigger)[0] < blocks
    # The default fraction is 0.9.
    default = make_llm(tiny_model_dir, num_kv_blocks=None, max_num_seqs=8)
    assert _pool(default)[0] == (int(0.9 * 4 * GiB) - fake_memory["in_use"]
                                 - activations[2]) // per_block


def test_explicit_budgets_override_the_device_memory(make_llm, tiny_model_dir, fake_memory):
    llm = make_llm(tiny_model_dir, num_kv_blocks=None, kv_cache_memory_bytes=64 << 20,
                   gpu_memory_utilization=0.5)
    blocks, per_block = _pool(llm)
    assert blocks == (64 << 20) // per_block
    assert _pool(make_llm(tiny_model_dir, num_kv_blocks=40, gpu_memory_utilization=0.5))[0] == 40


def test_too_little_memory_is_named(make_llm, tiny_model_dir, fake_memory):
    fake_memory["in_use"] = int(3.9 * GiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5"):
        make_llm(tiny_model_dir, num_kv_blocks=None, gpu_memory_utilization=0.5)


def test_cpu_keeps_the_default(make_llm, tiny_model_dir, caplog):
    """On CPU the pool is 2 GiB, `gpu_memory_utilization` or not (a warning says it is not
    used); an out-of-range fraction is an error naming it."""
    llm = make_llm(tiny_model_dir, num_kv_blocks=None)
    blocks, per_block = _pool(llm)
    assert blocks == memory.DEFAULT_KV_CACHE_MEMORY_BYTES // per_block
    with caplog.at_level("WARNING"):
        llm = make_llm(tiny_model_dir, num_kv_blocks=None, gpu_memory_utilization=0.5)
    assert _pool(llm)[0] == blocks
    assert "gpu_memory_utilization=0.5 is not used: the devices report no memory" in caplog.text
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_llm(tiny_model_dir, gpu_memory_utilization=1.5)


def test_a_draft_model_keeps_the_byte_budget(make_llm, tiny_model_dir, fake_memory):
    """With a draft model (its weights and pool are not counted by the sizing) the pool takes
    `kv_cache_memory_bytes`' default, as before."""
    llm = make_llm(tiny_model_dir, num_kv_blocks=None, gpu_memory_utilization=0.5,
                   speculative_config={"model": str(tiny_model_dir),
                                       "num_speculative_tokens": 2})
    blocks, per_block = _pool(llm)
    assert blocks == memory.DEFAULT_KV_CACHE_MEMORY_BYTES // per_block
