"""Engine configuration: one frozen dataclass per concern, validated when built."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV block pool."""

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # blocks in the pool; overrides kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 2 << 30  # pool budget in bytes when num_kv_blocks is None
    enable_prefix_caching: bool = True  # share cached K/V of common prompt prefixes

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be an int >= 1, got {self.num_kv_blocks!r}")
        if not isinstance(self.kv_cache_memory_bytes, int) or self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be an int >= 1, got {self.kv_cache_memory_bytes!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, "
                             f"got {self.enable_prefix_caching!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_model_len: int  # tokens per sequence, prompt and output together
    max_num_seqs: int = 256  # sequences in one step
    # Tokens computed in one step (decodes plus prompt chunks); default max(max_model_len, 2048).
    max_num_batched_tokens: int | None = None

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", max(self.max_model_len, 2048))
        # Longer prompts are computed in chunks over several steps (chunked prefill).
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an int >= 1, "
                             f"got {self.max_num_batched_tokens!r}")
