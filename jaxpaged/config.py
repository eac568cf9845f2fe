"""Engine configuration: one frozen dataclass per concern, validated when built."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxpaged.core.request_queue import REQUEST_QUEUES

if TYPE_CHECKING:
    from jaxpaged.pallas_kernels.plan import KernelPlan

# Prompt tokens a sequence computes at most in a step that also decodes. A step's time grows
# with the tokens it computes, so this keeps a mixed step within a small multiple of a decode
# step at the batch sizes served (docs/scheduling.md, "Latency under load", has the measurements).
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 128


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV block pool."""

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # blocks in the pool; overrides kv_cache_memory_bytes
    # The pool's budget in bytes when num_kv_blocks is None; None: sized from the devices'
    # memory where they report it (GPU: `gpu_memory_utilization`), else 2 GiB (`worker.memory`).
    kv_cache_memory_bytes: int | None = None
    # The fraction of the devices' memory the engine may use, weights and activations first,
    # the rest to the pool, when neither num_kv_blocks nor kv_cache_memory_bytes is given;
    # None: 0.9 (vLLM's meaning and default).
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True  # share cached K/V of common prompt prefixes
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES; "auto": the model's dtype

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be an int >= 1, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory_bytes is not None and (
                not isinstance(self.kv_cache_memory_bytes, int)
                or self.kv_cache_memory_bytes < 1):
            raise ValueError(
                f"kv_cache_memory_bytes must be an int >= 1, got {self.kv_cache_memory_bytes!r}")
        u = self.gpu_memory_utilization
        if u is not None and (not isinstance(u, (int, float)) or isinstance(u, bool)
                              or not 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, "
                             f"got {self.enable_prefix_caching!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of "
                             f"{KV_CACHE_DTYPES}")


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
    # Decode steps run in a row, with their draws made on the device, when every running
    # sequence decodes greedily and nothing waits (`core.scheduler`, multi-step decoding).
    num_scheduler_steps: int = 1
    # Step i + 1 prepared and launched while the device runs step i, its decode inputs read from
    # step i's draws on the device (`engine.async_scheduling`); multi-step calls run as before.
    async_scheduling: bool = False

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_partial_prefills",
                     "num_scheduler_steps"):
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
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")


# -- the rest of the engine's configuration (`EngineArgs.create_engine_config` builds it) --------

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")


@dataclasses.dataclass(frozen=True)
class ModelLoadConfig:
    """Which model, in which dtype, with which sampling defaults and seeds."""

    model: str | None = None  # as given: a model name, a folder or a GGUF file; None the default
    model_dir: Path | None = None  # the folder it resolved to (`model_store.resolve_model`)
    dtype: str = "auto"  # one of DTYPES; "auto": float32 on CPU, bfloat16 on accelerators
    seed: int = 0  # seeds the per-request seeds of requests that give none
    # Default sampling values: "auto" (the model folder's generation_config.json), "vllm" or
    # None (none), or another folder holding one.
    generation_config: str | None = "auto"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh and the processes that share it."""

    tensor_parallel_size: int = 1  # devices the model is split over
    # A Mixture-of-Experts model's experts whole on each device, E / tp each (vLLM's
    # `enable_expert_parallel`); else each expert's hidden units split as a dense MLP's.
    enable_expert_parallel: bool = False
    coordinator_address: str | None = None  # "host:port" of process 0; None: one process
    num_processes: int = 1
    process_id: int = 0  # this process's index, from 0

    def __post_init__(self):
        if self.coordinator_address is None and self.num_processes != 1:
            raise ValueError(f"num_processes={self.num_processes} needs a coordinator_address")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={self.num_processes}), "
                             f"got {self.process_id!r}")


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Weight quantization."""

    method: str | None = None  # None (weights in the model's dtype) or "int8" (weight-only)


@dataclasses.dataclass(frozen=True)
class ReasoningConfig:
    """The reasoning parser the engine's structured-output gate and the server both follow."""

    parser: str | None = None  # None, "deepseek_r1" or "qwen3"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's names): off unless `enable_lora`."""

    enable_lora: bool = False
    max_loras: int = 1  # adapters on the device at once (one step mixes at most this many)
    max_lora_rank: int = 16  # the largest rank an adapter may have
    max_cpu_loras: int | None = None  # adapters held on the host; None: max_loras

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an int >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")


def check_precompile(precompile) -> None:
    """Raises ValueError unless `precompile` is True, False, None or a list of step sizes."""
    if not (precompile is None or isinstance(precompile, bool) or (
            isinstance(precompile, (list, tuple)) and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in precompile))):
        raise ValueError(f"precompile must be True, False, None or a list of step sizes "
                         f"in tokens (ints >= 1), got {precompile!r}")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """How steps run: the attention backend, batch invariance and compilation."""

    attention_backend: str = "auto"  # "auto", "cpu", "pallas", "pallas-interpret" or "xla"
    batch_invariant: bool = False  # results that do not depend on the batch (CPU)
    # Step shapes compiled at startup: True all, False none, None the backend's default, or a
    # tuple of step sizes in tokens (those alone).
    precompile: bool | tuple[int, ...] | None = None
    compilation_cache_dir: str | None = "auto"  # "auto", a folder, or None / "off"

    def __post_init__(self):
        check_precompile(self.precompile)
        if isinstance(self.precompile, list):
            object.__setattr__(self, "precompile", tuple(self.precompile))


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys.

    method: "ngram" (prompt lookup), "draft_model" (implied by `model`), or another proposer
      registered in `jaxpaged.spec_decode.registry.PROPOSERS`.
    num_speculative_tokens: k, the tokens proposed per sequence and step.
    prompt_lookup_max / prompt_lookup_min: the longest and shortest n-gram matched ("ngram";
      vLLM's defaults: one given sets both, neither gives 5).
    model: the draft model ("draft_model"), as the target's `model` is given (a folder, a GGUF
      file or an embedded model's name), with the target's vocabulary.
    disable_by_batch_size: no proposals in a step in which more sequences decode than this
      (None: never off); the default, `DEFAULT_DISABLE_BY_BATCH_SIZE`, is where verification
      stopped paying on this project's CPU (`bench/speculative.py`;
      docs/speculative_decoding.md).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = 8  # DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"speculative_config: {name} must be an int >= 1, "
                                 f"got {value!r}")

        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            positive(name)
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        from jaxpaged.spec_decode.registry import PROPOSERS  # names only: nothing is loaded
        if self.method not in PROPOSERS:
            raise ValueError(f"speculative_config: method {self.method!r} is not one of "
                             f"{sorted(PROPOSERS)}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs a 'model'")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: 'model' is for method 'draft_model', "
                                 "not 'ngram'")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min {lo} is larger than "
                                 f"prompt_lookup_max {hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, config: dict | str | None) -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the server's `--speculative-config`); None stays None.

        Raises:
          ValueError: not a JSON object, an unknown key, or a bad value (named).
        """
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {config!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        config = dict(config)
        if config.get("model") is not None:
            config.setdefault("method", "draft_model")
        return cls(**config)


# Decoding sequences above which a step proposes nothing, by default (see SpeculativeConfig).
DEFAULT_DISABLE_BY_BATCH_SIZE = SpeculativeConfig.disable_by_batch_size


@dataclasses.dataclass(frozen=True)
class ResolvedMode:
    """What runs of one mode, beside what was asked for.

    value: the mode in force. requested: what the options gave (None: not given, the
    default applied). reason: why `value` differs from the request, or from the default
    (None: it does not).
    """

    value: Any
    requested: Any = None
    reason: str | None = None

    def to_dict(self) -> dict:
        return {"value": self.value, "requested": self.requested, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class EffectiveModes:
    """The modes an engine runs in, each resolved once from the options and the model
    (`jaxpaged.engine.modes.resolve_modes`); the engine, scheduler and runner read these.

    kernels: the platform's `KernelPlan` (the attention backend, matmul, MoE and LoRA
    kernels); None until the engine's setup resolves it (`engine.setup.resolve_kernel_plan`:
    it needs the platform, which starts jax).
    """

    num_scheduler_steps: ResolvedMode  # decode steps a call (multi-step decoding)
    async_scheduling: ResolvedMode  # step i + 1 launched while step i runs
    batch_invariant: ResolvedMode
    speculative: ResolvedMode  # the proposer's method, or None
    kernels: KernelPlan | None = None

    def to_dict(self) -> dict:
        """Each mode's value, request and reason, and the kernel plan's fields (JSON values)."""
        out = {f.name: getattr(self, f.name).to_dict() for f in dataclasses.fields(self)
               if f.name != "kernels"}
        out["kernels"] = None if self.kernels is None else dataclasses.asdict(self.kernels)
        return out

    @classmethod
    def as_given(cls, scheduler: SchedulerConfig, execution: ExecutionConfig,
                 speculative: SpeculativeConfig | None) -> EffectiveModes:
        """The modes of a config built by hand: each as its section gives it, no reasons."""
        method = None if speculative is None else speculative.method
        return cls(ResolvedMode(scheduler.num_scheduler_steps, scheduler.num_scheduler_steps),
                   ResolvedMode(scheduler.async_scheduling, scheduler.async_scheduling),
                   ResolvedMode(execution.batch_invariant, execution.batch_invariant),
                   ResolvedMode(method, method))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an `LLMEngine` is built from, resolved (`EngineArgs.create_engine_config`)."""

    model: ModelLoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    execution: ExecutionConfig
    quantization: QuantizationConfig
    reasoning: ReasoningConfig
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    lora: LoRAConfig = LoRAConfig()
    # What runs, resolved from the request (`EngineArgs.create_engine_config`); None: as the
    # sections give it (`EffectiveModes.as_given`). `scheduler.num_scheduler_steps` and
    # `scheduler.async_scheduling` hold the resolved values.
    modes: EffectiveModes | None = None

    def __post_init__(self):
        if self.modes is None:
            object.__setattr__(self, "modes", EffectiveModes.as_given(
                self.scheduler, self.execution, self.speculative))
