"""How `LLMEngine` is put together: the model loaded and quantized, the runner built, its step
shapes compiled, the limits a speculative step needs. Functions of the engine's resolved
options, kept apart from the engine core, which only schedules, steps and books."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxpaged.config import (CacheConfig, EngineConfig, ExecutionConfig, LoRAConfig,
                             SchedulerConfig, SpeculativeConfig)
from jaxpaged.model_loader.loader import load_model_from_dir
from jaxpaged.models import ModelConfig
from jaxpaged.models.lora import enable_lora
from jaxpaged.models.quantization import quantize_model
from jaxpaged.pallas_kernels import KernelPlan, make_attention_backend
from jaxpaged.platforms import current_platform
from jaxpaged.worker import memory
from jaxpaged.worker.kv_cache import code_dtype, kv_cache_bytes_per_token, num_kv_blocks
from jaxpaged.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def release_freed_memory() -> None:
    """Hands memory freed by loading (float weights replaced by quantized ones, GGUF blocks
    dequantized and dropped) back to the OS: glibc keeps freed heap pages resident until
    `malloc_trim`. A no-op where the C library is not glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_kernel_plan(config: EngineConfig, dtype) -> EngineConfig:
    """`config` with its kernel plan (`config.modes.kernels`): the platform's choice
    (`Platform.kernel_plan`) for the weights' `dtype`, the tensor-parallel split, batch
    invariance and the attention backend asked for. Called once, where the engine is built
    (the platform starts jax, which `create_engine_config` must not).

    Raises:
      ValueError: batch invariance or an attention backend the platform cannot run (named).
    """
    plan = current_platform().kernel_plan(
        dtype, config.parallel.tensor_parallel_size > 1, config.modes.batch_invariant.value,
        config.execution.attention_backend)
    return dataclasses.replace(config, modes=dataclasses.replace(config.modes, kernels=plan))


def load_engine_model(model_dir: Path, model_config: ModelConfig, dtype, backend, mesh,
                      quantization: str | None, batch_invariant: bool,
                      lora: LoRAConfig = LoRAConfig(), *, kernels: KernelPlan) -> nnx.Module:
    """The model with its weights (read from the GGUF file itself for a folder that serves
    one, `gguf_import.write_gguf_metadata`), built on the kernels of `kernels`
    (`ModelConfig.kernels`: the few-row, MoE and LoRA kernels), quantized as `quantization`
    says (`models.quantization`, on the C++ matmul where `kernels.quantized_matmul`), with
    adapter slots where `lora.enable_lora` (`models.lora`); `batch_invariant`: the quantized
    layers compute each row one way whatever the step (`models.quantization`)."""
    model_config = dataclasses.replace(model_config, kernels=kernels)
    model = load_model_from_dir(model_dir, model_config, dtype, backend, mesh)
    model = quantize_model(model, quantization, mesh=mesh, use_kernel=kernels.quantized_matmul,
                           batch_invariant=batch_invariant)
    if lora.enable_lora:
        enable_lora(model, max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank,
                    dtype=dtype, mesh=mesh)
    release_freed_memory()
    return model


def max_spec_step_tokens(speculative: SpeculativeConfig | None,
                         scheduler: SchedulerConfig) -> int:
    """The most tokens a step verifying proposals takes (0 without speculation): every
    sequence it may run for decoding, each with k proposals."""
    if speculative is None:
        return 0
    seqs = min(scheduler.max_num_seqs, speculative.disable_by_batch_size or scheduler.max_num_seqs)
    return min(scheduler.max_num_batched_tokens, seqs * (speculative.num_speculative_tokens + 1))


def build_runner(model: nnx.Module, cache_config: CacheConfig, num_blocks: int,
                 kv_cache_dtype: str, scheduler: SchedulerConfig, cache_dir,
                 batch_invariant: bool, precompile: bool | list[int] | tuple,
                 spec_tokens: int) -> ModelRunner:
    """The model's runner over a pool of `num_blocks` blocks, its step floor set for batch
    invariance (`Platform.batch_invariant_min_step_tokens`), and its step shapes compiled:
    every shape the limits allow (`precompile=True`, with a progress bar), those of the listed
    step sizes alone, quietly, or none."""
    platform = current_platform()
    runner = ModelRunner(model, cache_config, num_blocks, kv_cache_dtype,
                         max_num_seqs=scheduler.max_num_seqs,
                         max_model_len=scheduler.max_model_len,
                         compilation_cache_dir=cache_dir,
                         min_seq_slots=(platform.batch_invariant_min_seq_slots
                                        if batch_invariant else 1),
                         # Resolved with the config (`engine.modes`): 1 under batch
                         # invariance, speculation or longrope.
                         num_scheduler_steps=scheduler.num_scheduler_steps,
                         greedy_draws=not batch_invariant)
    if batch_invariant:
        runner.min_step_tokens = platform.batch_invariant_min_step_tokens(
            runner, runner.backend.name)
    shapes = runner.step_shapes(scheduler.max_num_batched_tokens)
    if isinstance(precompile, (list, tuple)):  # those step sizes alone, quietly
        wanted = {runner.step_tokens(n) for n in precompile}
        runner.precompile([(T, v) for T, v in shapes if T in wanted], progress=False,
                          sampler_variants=False)
    elif precompile:
        runner.precompile(shapes, spec_tokens=spec_tokens)
    return runner


def make_backend(execution: ExecutionConfig, kv_cache_dtype: str, mesh):
    """The attention backend (`pallas_kernels.make_attention_backend`) the platform picks for
    `execution.attention_backend` ("auto" resolved; batch-invariant mode's where it is on),
    and whether to precompile (`execution.precompile`; None: yes, except on interpreted
    kernels, which take minutes a shape).

    Raises:
      ValueError: a backend the platform cannot run, or batch invariance where it has none.
    """
    platform = current_platform()
    name = (platform.batch_invariant_backend(execution.attention_backend)
            if execution.batch_invariant
            else platform.attention_backend(execution.attention_backend))
    backend = make_attention_backend(name, code_dtype(kv_cache_dtype), mesh,
                                     batch_invariant=execution.batch_invariant)
    precompile = execution.precompile
    if precompile is None:
        precompile = not backend.name.endswith("-interpret")
    return backend, precompile


def size_pool(cache_config: CacheConfig, model_config: ModelConfig, kv_cache_dtype: str,
              max_model_len: int, devices: list, sized_by_memory: bool = True
              ) -> tuple[CacheConfig, int | None]:
    """The cache config in force (prefix caching off for a RoPE that switches with the
    length) and the pool's number of blocks (`kv_cache.num_kv_blocks`), or None where it is
    sized from the memory of `devices` (those the model and the pool are placed on) once the
    weights are loaded (`size_pool_from_memory`): neither `num_kv_blocks` nor
    `kv_cache_memory_bytes` given, the devices report their memory (`worker.memory`) and
    `sized_by_memory` (False with a draft model, whose weights and pool the sizing does not
    count). Elsewhere the budget is `kv_cache_memory_bytes`,
    `memory.DEFAULT_KV_CACHE_MEMORY_BYTES` unless given.

    Raises:
      ValueError: the pool cannot hold one sequence of `max_model_len` tokens.
    """
    if cache_config.enable_prefix_caching and model_config.rope_switch_length:
        # A block's K/V then depends on its sequence's length (longrope rotates with the
        # long factors once a sequence passes the original length), not on its tokens alone.
        logger.warning("prefix caching is off: this model's RoPE (longrope) makes cached "
                       "blocks depend on the length of the sequence that computed them")
        cache_config = dataclasses.replace(cache_config, enable_prefix_caching=False)
    if cache_config.num_kv_blocks is None and cache_config.kv_cache_memory_bytes is None:
        if sized_by_memory and memory.device_memory(devices) is not None:
            return cache_config, None
        if cache_config.gpu_memory_utilization is not None:
            logger.warning("gpu_memory_utilization=%s is not used: %s; the KV pool takes "
                           "kv_cache_memory_bytes=%d", cache_config.gpu_memory_utilization,
                           "the devices report no memory" if sized_by_memory else
                           "a draft model's pool is sized with the target's",
                           memory.DEFAULT_KV_CACHE_MEMORY_BYTES)
        cache_config = dataclasses.replace(
            cache_config, kv_cache_memory_bytes=memory.DEFAULT_KV_CACHE_MEMORY_BYTES)
    num_blocks = num_kv_blocks(model_config, cache_config, kv_cache_dtype)
    _check_pool_size(num_blocks, cache_config, max_model_len)
    return cache_config, num_blocks


def _check_pool_size(num_blocks: int, cache_config: CacheConfig, max_model_len: int) -> None:
    if num_blocks * cache_config.block_size < max_model_len:
        raise ValueError(
            f"the KV pool holds {num_blocks} blocks of {cache_config.block_size} tokens, "
            f"fewer than max_model_len={max_model_len}: raise num_kv_blocks / "
            "kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len")


def size_pool_from_memory(model: nnx.Module, cache_config: CacheConfig, kv_cache_dtype: str,
                          scheduler: SchedulerConfig, devices: list) -> int:
    """The pool's blocks from the memory of `devices` with the weights loaded
    (`worker.memory`): `gpu_memory_utilization` (default
    `memory.DEFAULT_GPU_MEMORY_UTILIZATION`) of each, less what is in use and the activations
    of the largest step, profiled by compiling that step over a pool of one sequence. Over
    several processes, the fewest blocks any process finds.

    Raises:
      ValueError: nothing is left to the pool, or too little for `max_model_len` tokens.
    """
    utilization = cache_config.gpu_memory_utilization or memory.DEFAULT_GPU_MEMORY_UTILIZATION
    in_use = memory.device_memory(devices)  # this process's devices
    S = cache_config.block_size
    probe = ModelRunner(model, cache_config, -(-scheduler.max_model_len // S), kv_cache_dtype,
                        max_num_seqs=scheduler.max_num_seqs,
                        max_model_len=scheduler.max_model_len)
    compiled = probe.lower_step(probe.step_tokens(scheduler.max_num_batched_tokens)).compile()
    activation = memory.step_activation_bytes(compiled)
    probe.release()
    del probe, compiled
    budget = memory.kv_pool_budget(utilization, in_use, activation) // len(in_use) * len(devices)
    num_blocks = budget // (kv_cache_bytes_per_token(model.config, kv_cache_dtype) * S)
    if jax.process_count() > 1:  # each process's pool is its part of one array: the same size
        from jax.experimental import multihost_utils

        num_blocks = int(np.min(multihost_utils.process_allgather(np.int64(num_blocks))))
    logger.info("KV pool from %.2f of each device's memory (limit, in use: %s), %d bytes for "
                "the largest step's activations: %d blocks", utilization, in_use, activation,
                num_blocks)
    _check_pool_size(num_blocks, cache_config, scheduler.max_model_len)
    return num_blocks
