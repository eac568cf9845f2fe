"""Engine configuration: one frozen dataclass per concern, validated when built."""

from __future__ import annotations

import dataclasses

from jaxpaged.core.request_queue import REQUEST_QUEUES

# Prompt tokens a sequence computes at most in a step that also decodes. A step's time grows
# with the tokens it computes, so this keeps a mixed step within a small multiple of a decode
# step at the batch sizes served (README, "Latency under load", has the measurements).
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 128


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
    # The prefill cap of a step that also decodes, which bounds inter-token latency (vLLM's
    # names): in such a step a prompt computes at most `long_prefill_token_threshold` tokens
    # (0: no cap) and at most `max_num_partial_prefills` prompts compute. A step with no
    # decodes uses the whole `max_num_batched_tokens`.
    long_prefill_token_threshold: int | None = None  # None: the default above
    max_num_partial_prefills: int = 1
    # A key of `request_queue.REQUEST_QUEUES`: "fcfs" (arrival order) or "priority" (a
    # request's `priority`, lower first, then arrival; vLLM's semantics: a waiting request may
    # preempt running ones of lower priority), or a policy registered there.
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_partial_prefills"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.scheduling_policy not in REQUEST_QUEUES:
            raise ValueError(f"scheduling_policy must be one of {sorted(REQUEST_QUEUES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.long_prefill_token_threshold is None:
            object.__setattr__(self, "long_prefill_token_threshold",
                               DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD)
        value = self.long_prefill_token_threshold
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0 (0: no cap), "
                             f"got {value!r}")
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", max(self.max_model_len, 2048))
        # Longer prompts are computed in chunks over several steps (chunked prefill).
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an int >= 1, "
                             f"got {self.max_num_batched_tokens!r}")
