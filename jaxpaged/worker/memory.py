"""The KV pool sized from the device's memory (vLLM's `gpu_memory_utilization`).

The engine may use `gpu_memory_utilization` of each device's memory (`Device.memory_stats()`'s
`bytes_limit`, what XLA's allocator may hand out). The weights come first (loaded before the
pool: `bytes_in_use` then), then the activations of the largest step, profiled from the
compiled step's memory analysis (its scratch and outputs that do not alias an input), and the
rest goes to the KV pool. As in vLLM, `kv_cache_memory_bytes` (or `num_kv_blocks`) given
overrides it. Platforms whose devices report no memory (CPU) size the pool from
`kv_cache_memory_bytes` alone, `DEFAULT_KV_CACHE_MEMORY_BYTES` unless given.
"""

from __future__ import annotations

import jax

DEFAULT_KV_CACHE_MEMORY_BYTES = 2 << 30  # where the device does not say what it holds (CPU)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


def device_memory(devices=None) -> tuple[int, int] | None:
    """(bytes_limit, bytes_in_use) summed over `devices` (default: the local ones), from
    `Device.memory_stats()`, or None where a device reports none (XLA:CPU)."""
    limit = in_use = 0
    for device in devices if devices is not None else jax.local_devices():
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        limit += stats["bytes_limit"]
        in_use += stats.get("bytes_in_use", 0)
    return limit, in_use


def step_activation_bytes(compiled) -> int:
    """A compiled step's memory beyond its inputs: scratch plus outputs not aliasing an input
    (the donated pool), from `Compiled.memory_analysis()` (0 where XLA gives none)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes
               - analysis.alias_size_in_bytes)


def kv_pool_budget(utilization: float, memory: tuple[int, int], activation_bytes: int) -> int:
    """Bytes left to the KV pool: `utilization` of the devices' `bytes_limit`, less what is in
    use (the weights) and the largest step's activations.

    Raises:
      ValueError: nothing is left (naming each part).
    """
    limit, in_use = memory
    budget = int(utilization * limit) - in_use - activation_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {int(utilization * limit)} of the "
            f"devices' {limit} bytes, and the weights ({in_use} bytes in use) and the largest "
            f"step's activations ({activation_bytes} bytes) leave none to the KV pool: raise "
            f"it, or lower max_num_batched_tokens")
    return budget
