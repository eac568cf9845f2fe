"""The KV pool sized from the devices' memory (vLLM's `gpu_memory_utilization`).

The engine may use `gpu_memory_utilization` of each of its devices' memory:
`Device.memory_stats()`'s `bytes_limit`, what XLA's allocator may hand out. (jax preallocates 75% of a GPU by default, so
`bytes_limit` is 75% of the card; `XLA_PYTHON_CLIENT_MEM_FRACTION` changes that, vLLM's fraction
being of the whole card.) On each device the weights come first (loaded before the pool:
`bytes_in_use` then), then the activations of the largest step, profiled from the compiled
step's memory analysis (one device's program: its scratch and outputs that do not alias an
input), and the rest goes to the KV pool, which splits evenly over the devices: the pool is the
tightest device's rest times the number of devices. As in vLLM, `kv_cache_memory_bytes` (or
`num_kv_blocks`) given overrides it. Where the devices report no memory (CPU) the pool is
`kv_cache_memory_bytes`, `DEFAULT_KV_CACHE_MEMORY_BYTES` unless given.

The reserve covers the model step of `max_num_batched_tokens` tokens that returns the logits of
its sequences' last tokens, not a step computing prompt logprobs (logits at every token).
"""

from __future__ import annotations

import jax

DEFAULT_KV_CACHE_MEMORY_BYTES = 2 << 30  # where the device does not say what it holds (CPU)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


def device_stats(device) -> dict | None:
    """`device.memory_stats()`, or None where it reports no `bytes_limit` (XLA:CPU)."""
    stats = device.memory_stats()
    return stats if stats and "bytes_limit" in stats else None


def device_memory(devices) -> list[tuple[int, int]] | None:
    """(bytes_limit, bytes_in_use) of each of `devices` this process holds (`device_stats`),
    or None where one reports none."""
    out = []
    for device in devices:
        if device.process_index != jax.process_index():
            continue
        stats = device_stats(device)
        if stats is None:
            return None
        out.append((stats["bytes_limit"], stats.get("bytes_in_use", 0)))
    return out


def step_activation_bytes(compiled) -> int:
    """A compiled step's memory on one device beyond its inputs: scratch plus outputs not
    aliasing an input (the donated pool), from `Compiled.memory_analysis()` (0 where XLA gives
    none)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes
               - analysis.alias_size_in_bytes)


def kv_pool_budget(utilization: float, memory: list[tuple[int, int]],
                   activation_bytes: int) -> int:
    """Bytes left to the KV pool over all the devices of `memory` ((bytes_limit, bytes_in_use)
    each): on each, `utilization` of its limit less what is in use (the weights) and the
    largest step's activations; the tightest device's rest, once per device.

    Raises:
      ValueError: nothing is left on some device (naming each part).
    """
    rests = [int(utilization * limit) - in_use - activation_bytes for limit, in_use in memory]
    i = min(range(len(rests)), key=rests.__getitem__)
    if rests[i] <= 0:
        limit, in_use = memory[i]
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {int(utilization * limit)} of a "
            f"device's {limit} bytes, and the weights ({in_use} bytes in use) and the largest "
            f"step's activations ({activation_bytes} bytes) leave none to the KV pool: raise "
            f"it, or lower max_num_batched_tokens")
    return rests[i] * len(rests)
