"""The model side of an engine, put together from its resolved options: the model's folder,
config and dtype, the tensor-parallel mesh, the attention backend and kernel plan, the KV pool's
dtype and size, the loaded (and quantized) model, its runner with the step shapes compiled, and
the tokenizer. `LLMEngine` builds one and adds the scheduler and the request side."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path

import jax
from flax import nnx

from jaxpaged.config import EngineConfig
from jaxpaged.distributed.parallel import make_mesh
from jaxpaged.engine.setup import (build_runner, load_engine_model, make_backend,
                                   max_spec_step_tokens, resolve_kernel_plan, size_pool,
                                   size_pool_from_memory)
from jaxpaged.lora import check_lora_config
from jaxpaged.model_loader.model_store import resolve_model
from jaxpaged.model_loader.tokenizer import eos_token_ids, load_tokenizer
from jaxpaged.models import load_config
from jaxpaged.models.lora import lora_sites
from jaxpaged.models.quantization import check_quantization
from jaxpaged.platforms import current_platform
from jaxpaged.worker import compilation_cache
from jaxpaged.worker.kv_cache import resolve_kv_cache_dtype


class ServedModel:
    """One model, loaded and ready to step (see the module).

    Raises:
      ValueError: a config value is out of range (a quantization, an attention backend or LoRA
        options the platform cannot run), or the pool cannot hold one sequence of
        `max_model_len` tokens.
    """

    def __init__(self, config: EngineConfig):
        """`config`: the resolved options (`EngineArgs.create_engine_config`); the model is
        read from `config.model.model_dir` (when None, `config.model.model` resolved).
        `self.config` is `config` with its kernel plan and the cache config in force."""
        self.model_dir = Path(config.model.model_dir or resolve_model(config.model.model))
        tp = config.parallel.tensor_parallel_size
        self.cache_dir = compilation_cache.resolve_cache_dir(
            config.execution.compilation_cache_dir)
        # Tensor parallelism: the model and the pool split over a mesh (`distributed.parallel`).
        self.mesh = make_mesh(tp) if tp != 1 else None
        self.model_config = load_config(self.model_dir).for_tensor_parallel(
            tp, config.parallel.enable_expert_parallel)
        self.dtype = current_platform().resolve_dtype(config.model.dtype)
        config = resolve_kernel_plan(config, self.dtype)  # `config.modes.kernels`
        check_quantization(config.quantization.method)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        check_lora_config(config)
        self.backend, precompile = make_backend(config.execution, self.kv_cache_dtype,
                                                self.mesh)
        # The devices the model and the pool go on: the mesh's, or the default one.
        devices = (list(self.mesh.devices.flat) if self.mesh is not None
                   else jax.local_devices()[:1])
        cache_config, num_blocks = size_pool(
            config.cache, self.model_config, self.kv_cache_dtype, config.scheduler.max_model_len,
            devices, sized_by_memory=getattr(config.speculative, "model", None) is None)
        self.config = config = dataclasses.replace(config, cache=cache_config)
        # The tokenizer loads on a thread beside the weights and the executables: it is Python
        # imports (transformers, and torch where it is installed: seconds) and file reads, they
        # are mostly XLA and numpy, outside the GIL.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, self.model_dir)
            model = self.load_model(self.backend)
            self.model_cls, self.lora_sites = type(model), lora_sites(model)
            if num_blocks is None:  # from the devices' memory, the weights loaded
                num_blocks = size_pool_from_memory(model, cache_config, self.kv_cache_dtype,
                                                   config.scheduler, devices)
            self.num_blocks = num_blocks
            self.runner = build_runner(
                model, cache_config, num_blocks, self.kv_cache_dtype, config.scheduler,
                self.cache_dir, config.execution.batch_invariant, precompile,
                max_spec_step_tokens(config.speculative, config.scheduler))
            self.tokenizer = tokenizer.result()
        self.eos_token_ids = eos_token_ids(self.model_dir, self.model_config.eos_token_ids,
                                           self.tokenizer)
        # The tokens min_tokens masks besides each request's stop_token_ids.
        self.runner.input_batch.eos_token_ids = list(self.eos_token_ids)

    def load_model(self, backend) -> nnx.Module:
        """`setup.load_engine_model` with these options (`EngineWeights` reloads with it)."""
        config = self.config
        return load_engine_model(self.model_dir, self.model_config, self.dtype, backend,
                                 self.mesh, config.quantization.method,
                                 config.execution.batch_invariant, config.lora,
                                 kernels=config.modes.kernels)
