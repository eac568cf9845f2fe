"""The engine: requests in, one scheduled and executed step at a time, outputs out."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxpaged.worker import compilation_cache
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.config import EngineConfig
from jaxpaged.errors import EngineDeadError, InvalidRequestError
from jaxpaged.engine.async_scheduling import AsyncScheduling
from jaxpaged.engine.faults import FaultIsolatingExecutor, describe
from jaxpaged.engine.embedding import Embedder
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.processor import RequestProcessor
from jaxpaged.engine.setup import (build_runner, load_engine_model, make_backend,
                                   max_spec_step_tokens, resolve_kernel_plan, size_pool,
                                   size_pool_from_memory)
from jaxpaged.engine.stats import engine_stats
from jaxpaged.engine.weights import EngineWeights
from jaxpaged.lora import LoRAManager, LoRARequest, check_lora_config, resolve_lora
from jaxpaged.models.lora import lora_sites
from jaxpaged.worker.kv_cache import resolve_kv_cache_dtype
from jaxpaged.model_loader.model_store import resolve_model
from jaxpaged.models import load_config
from jaxpaged.models.quantization import check_quantization
from jaxpaged.model_loader.tokenizer import eos_token_ids, load_tokenizer
from jaxpaged.outputs import RequestOutput
from jaxpaged.distributed.parallel import make_mesh
from jaxpaged.engine.request import Request
from jaxpaged.platforms import current_platform
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.spec_decode import (ProposerContext, make_proposer,
                                  set_proposals)
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.sequence import Scoring, Sequence

logger = logging.getLogger(__name__)


class LLMEngine:
    """Holds the tokenizer, scheduler, block manager and model runner of one model.

    Raises:
      ValueError: a config value is out of range, or the pool cannot hold one sequence of
        `max_model_len` tokens.
    """

    def __init__(self, config: EngineConfig):
        """`config`: the resolved options (`EngineArgs.create_engine_config`); the model is
        read from `config.model.model_dir` (when None, `config.model.model` resolved)."""
        self.config = config
        self.model_dir = model_dir = Path(config.model.model_dir
                                          or resolve_model(config.model.model))
        tensor_parallel_size = config.parallel.tensor_parallel_size
        cache_dir = compilation_cache.resolve_cache_dir(config.execution.compilation_cache_dir)
        self.speculative_config = config.speculative
        self.scheduler_config = config.scheduler
        # Tensor parallelism: the model and the pool split over a mesh (`distributed.parallel`).
        self.mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size != 1 else None
        self.model_config = load_config(model_dir).for_tensor_parallel(
            tensor_parallel_size, config.parallel.enable_expert_parallel)
        self.dtype = current_platform().resolve_dtype(config.model.dtype)
        self.config = config = resolve_kernel_plan(config, self.dtype)  # `config.modes.kernels`
        self.quantization = config.quantization.method
        check_quantization(self.quantization)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.batch_invariant = config.execution.batch_invariant
        check_lora_config(config)
        backend, precompile = make_backend(config.execution, self.kv_cache_dtype, self.mesh)
        self.attention_backend = backend.name
        # The devices the model and the pool go on: the mesh's, or the default one.
        devices = (list(self.mesh.devices.flat) if self.mesh is not None
                   else jax.local_devices()[:1])
        cache_config, num_blocks = size_pool(
            config.cache, self.model_config, self.kv_cache_dtype,
            self.scheduler_config.max_model_len, devices,
            sized_by_memory=getattr(self.speculative_config, "model", None) is None)
        if cache_config is not config.cache:
            self.config = dataclasses.replace(config, cache=cache_config)
        self.cache_config = cache_config

        # The tokenizer loads on a thread beside the weights and the executables: it is Python
        # imports (transformers, and torch where it is installed: seconds) and file reads, they
        # are mostly XLA and numpy, outside the GIL.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, model_dir)
            model = self._load_model(backend)
            self.model_cls, sites = type(model), lora_sites(model)
            if num_blocks is None:  # from the devices' memory, the weights loaded
                num_blocks = size_pool_from_memory(model, cache_config, self.kv_cache_dtype,
                                                   self.scheduler_config, devices)
            self.runner = build_runner(
                model, cache_config, num_blocks, self.kv_cache_dtype, self.scheduler_config,
                cache_dir, self.batch_invariant, precompile,
                max_spec_step_tokens(self.speculative_config, self.scheduler_config))
            self.tokenizer = tokenizer.result()
        self.processor = RequestProcessor(self.tokenizer, self.model_config.vocab_size,
                                          self.scheduler_config, config.reasoning.parser,
                                          config.model.seed)
        self.input_processor = self.processor.input_processor  # tokenizing, chat templates
        self.think_token_ids = self.processor.think_token_ids  # (<think>, </think>) or None
        self.eos_token_ids = eos_token_ids(model_dir, self.model_config.eos_token_ids,
                                           self.tokenizer)
        # The tokens min_tokens masks besides each request's stop_token_ids.
        self.runner.input_batch.eos_token_ids = list(self.eos_token_ids)
        self.block_manager = BlockManager(num_blocks, cache_config.block_size,
                                          cache_config.enable_prefix_caching)
        self.lora = (LoRAManager(config.lora, self.runner, sites, self.model_cls,
                                 self.model_config) if config.lora.enable_lora else None)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager,
                                   padded_tokens=self.runner.step_tokens,
                                   eos_token_ids=self.eos_token_ids,
                                   recompute_at=self.model_config.rope_switch_length,
                                   admit=self.lora and self.lora.admit)
        self.executor = FaultIsolatingExecutor(self.runner)
        # Step i + 1 launched before step i's draws are read (`engine.async_scheduling`); one
        # process only, without a proposer.
        self.async_scheduling = None
        if config.modes.async_scheduling.value:  # resolved (`engine.modes`)
            self.async_scheduling = AsyncScheduling(self)
        self.proposer = (None if self.speculative_config is None else make_proposer(
            self.speculative_config, ProposerContext(
                self.model_config, self.dtype, backend, self.cache_config, num_blocks,
                self.scheduler_config, cache_dir, self.mesh)))
        self.requests: dict[str, Request] = {}
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish)
        self.weights = EngineWeights(self.runner, self.block_manager,
                                     lambda: self._load_model(self.runner.backend),
                                     self.model_cls, self.model_config, self.dtype,
                                     self.quantization, self.lora and self.lora.restore_slots)
        self.embedder = Embedder(self.runner.graphdef, self.model_config.hidden_size)
        self.dead: EngineDeadError | None = None  # set by a fatal fault: no step runs after it
        self.num_failed_requests = 0  # requests failed by a fault in a step
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputes included)

    def _load_model(self, backend) -> nnx.Module:
        """`setup.load_engine_model` with this engine's options."""
        return load_engine_model(self.model_dir, self.model_config, self.dtype, backend,
                                 self.mesh, self.quantization, self.batch_invariant,
                                 self.config.lora, kernels=self.config.modes.kernels)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: str | dict, params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        """Queues a prompt; returns its request id. Validates before queueing anything.
        `priority`: under `scheduling_policy="priority"`, lower runs first (ties by arrival).
        `lora_request`: the adapter it runs under (read from its folder if not held yet).

        Raises:
          InvalidRequestError (a ValueError), naming the field: a bad prompt (see
          `tokenize_prompt`); token ids past the vocabulary; more completions (`best_of` or `n`)
          than `max_num_seqs` runs at once; `prompt_logprobs` over a prompt longer than
          `max_num_batched_tokens` (it is computed in one step); a request id in use; an
          invalid `structured_outputs` schema, regex or grammar; a `priority` that is not an
          int, or not 0 under the "fcfs" policy; an adapter that cannot be read, or any
          `lora_request` without `enable_lora`; `return_routed_experts` on a model without
          Mixture-of-Experts layers.
          RuntimeError: the engine is asleep.
          EngineDeadError: a fatal fault stopped the engine.
        """
        self._check_alive()
        self.processor.check_priority(priority)
        self.weights.check_awake()
        lora = resolve_lora(self.lora, lora_request)
        if isinstance(params, SamplingParams) and params.return_routed_experts \
                and self.runner.routes is None:
            raise InvalidRequestError("return_routed_experts", f"return_routed_experts needs a "
                                      f"Mixture-of-Experts model; {self.model_cls.__name__} "
                                      f"has none")
        request = self.processor.make_request(prompt, params, request_id, priority,
                                              self.requests)
        request.seqs[0].lora = lora
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])
        return request.request_id

    def add_scoring_request(self, ids: list[int], start: int, params: SamplingParams,
                            lora_request: LoRARequest | None = None) -> Sequence:
        """Queues the scoring of `ids[start:]` given the tokens before each (`scoring_prompt`)
        under `params`' temperature, top-k and top-p; returns its sequence, whose
        `scoring.logprobs` are complete once its request has finished. It runs as a prompt
        (chunked and prefix-cached as any other, never from the cache past `start` - 1), then
        draws one token, which is dropped."""
        score = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                               output_kind=RequestOutputKind.FINAL_ONLY)
        request_id = self.add_request({"prompt_token_ids": ids}, score,
                                      lora_request=lora_request)
        seq = self.requests[request_id].seqs[0]  # not scheduled before the next step
        # A greedy sample's processed distribution is untruncated (the sampler's greedy rows
        # take the argmax, with no top-k / top-p), and so is a greedy scoring's.
        greedy = params.temperature == 0
        seq.scoring = Scoring(start, params.temperature, 0 if greedy else params.top_k,
                              1.0 if greedy else params.top_p,
                              np.full((len(ids) - start,), np.nan, np.float32))
        return seq

    def abort_request(self, request_id: str) -> None:
        """Drops a request and frees its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        for seq in self._all_seqs(request) if request else []:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def _all_seqs(self, request: Request) -> list[Sequence]:
        """`request.seqs`, and under async scheduling the completions a launched step forked
        from its prompt that no output has listed yet (`core.async_booking`)."""
        if self.async_scheduling is None:
            return request.seqs
        listed = {seq.seq_id for seq in request.seqs}
        return request.seqs + [
            seq for seq in (*self.scheduler.running, *self.scheduler.waiting)
            if seq.request_id == request.request_id and seq.seq_id not in listed]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _check_alive(self) -> None:
        """Raises `EngineDeadError` once a fatal fault has stopped the engine."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead)) from self.dead

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs of the requests it advanced, each
        as its `SamplingParams.output_kind` says (a FINAL_ONLY request only when it finishes).
        Under async scheduling (`async_scheduling`), the outputs are those of the step before,
        whose draws were read while this one runs.

        Finished requests are returned once with `finished=True` and then forgotten. A request
        that a fault in the step is traced to (see `FaultIsolatingExecutor`) is returned
        finished, with `error` set and its completions' finish_reason "error"; the others go on.

        Raises:
          EngineDeadError: a fatal fault (see `jaxpaged.errors`); the engine is unusable.
        """
        self._check_alive()
        if self.async_scheduling is not None:
            return self.async_scheduling.step()
        out = self.schedule()
        return [] if out is None else self.run_step(out)

    def schedule(self):
        """The scheduler's next step (`Scheduler.schedule`), None when it runs nothing; sets
        the first scheduled time of the requests in it.

        Raises:
          EngineDeadError: the scheduler failed (its state can no longer be trusted).
        """
        if self.proposer is not None:  # each decoding sequence's proposals for this step
            set_proposals(self.proposer, self.speculative_config, self.scheduler.running,
                          len(self.scheduler.waiting), self.scheduler_config.max_model_len)
        try:
            out = self.scheduler.schedule()
        except Exception as e:  # its state can no longer be trusted
            self.dead = EngineDeadError(f"the scheduler failed: {describe(e)}")
            raise self.dead from e
        if out is None or not out.seqs:
            return None
        now = time.time()
        for seq in out.seqs:
            m = self.requests[seq.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        return out

    def run_step(self, out) -> list[RequestOutput]:
        """Runs scheduled step `out` through the fault-isolating executor, books it and returns
        its outputs (`step`)."""
        try:
            sampled, prompt_lps, failed = self.executor.execute(out)
        except EngineDeadError as e:
            self.dead = e
            raise
        now = time.time()
        update = self.scheduler.update_from_output(out, sampled, set(failed))
        for row, lps in prompt_lps.items():
            request = self.requests[out.seqs[row].request_id]
            if request.request_id not in failed and request.prompt_logprobs is None:
                request.prompt_logprobs = self.output_processor.prompt_logprob_dicts(
                    request, lps)
        return self.outputs(out, update, failed, now)

    def outputs(self, out, update, failed: dict[str, str], now: float) -> list[RequestOutput]:
        """The host side of booked step `out` (`StepUpdate` `update`): each appended token's
        text, logprobs and stop strings, the requests of `failed` ({request id: reason})
        failed, and the outputs of the requests it advanced (`step`)."""
        self.num_prompt_tokens += update.num_prompt_tokens
        touched = {}
        for row, appended in update.appended:
            request = self.requests.get(out.seqs[row].request_id)
            if request is None:  # aborted while its step ran (async scheduling)
                continue
            try:
                self.output_processor.advance(request, appended, now)
                touched[request.request_id] = request
            except Exception as e:  # in detokenizing or stop checks: this request's own fault
                logger.exception("request %s failed after its step", request.request_id)
                failed[request.request_id] = describe(e)
        for request_id, reason in failed.items():
            if request_id in self.requests:
                touched[request_id] = self._fail(self.requests[request_id], reason)
                self.num_failed_requests += 1
        if self.proposer is not None:  # the draft's state of sequences that finished goes
            self.proposer.release(self.scheduler.running)
        outputs = []
        for request_id, request in touched.items():
            finished = request.finished
            if finished:
                request.metrics.finished_time = time.time()
            output = request.output()
            if output is not None:
                outputs.append(output)
            if finished:
                del self.requests[request_id]
        return outputs

    # -- faults -----------------------------------------------------------------------------

    def _fail(self, request: Request, reason: str) -> Request:
        """Ends every sequence of `request` with finish reason "error" and frees its blocks."""
        request.error = reason
        for seq in self._all_seqs(request):
            seq.num_forks = 0
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        return request

    # -- what other owners do, reached through the engine -------------------------------------

    @property
    def grammar_compiler(self):
        return self.processor.grammar_compiler  # built when first needed

    @property
    def reasoning_parser(self) -> str | None:
        return None if self.processor.reasoning is None else self.processor.reasoning.name

    def tokenize_prompt(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """`InputProcessor.tokenize_prompt`."""
        return self.input_processor.tokenize_prompt(prompt)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """`InputProcessor.chat_prompt`."""
        return self.input_processor.chat_prompt(
            messages, add_generation_prompt, continue_final_message, tools, template_kwargs)

    def scoring_prompt(self, prompt_token_ids, completion_token_ids) -> tuple[list[int], int]:
        """`RequestProcessor.scoring_prompt`."""
        return self.processor.scoring_prompt(prompt_token_ids, completion_token_ids)

    def embed(self, token_ids: list[list[int]], pooling: str = "last",
              normalize: bool = True) -> np.ndarray:
        """`Embedder.embed` on the served parameters: f32[len(token_ids), hidden_size].

        Raises:
          InvalidRequestError: an unknown `pooling`, or an empty prompt.
          RuntimeError: the weights were released by `sleep(level=2)`.
        """
        return self.embedder.embed(self.weights.get_params(), token_ids, pooling, normalize)

    def get_params(self) -> nnx.State:
        """`EngineWeights.get_params`."""
        return self.weights.get_params()

    def update_params(self, params) -> None:
        """`EngineWeights.update_params`."""
        self._check_alive()
        self.weights.update_params(params)

    def load_weights(self, weights) -> None:
        """`EngineWeights.load_weights`."""
        self.weights.load_weights(weights)

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (`BlockManager.reset_prefix_cache`); False while requests
        run (nothing is dropped then)."""
        return self.block_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """`EngineWeights.sleep`: the KV pool (level 1) and the weights (level 2) released."""
        self.weights.sleep(level, busy=self.has_unfinished_requests())

    def wake_up(self) -> None:
        """`EngineWeights.wake_up`."""
        self.weights.wake_up()

    @property
    def sleep_level(self) -> int:
        return self.weights.sleep_level

    def stats(self) -> dict[str, int]:
        """`engine.stats.engine_stats`."""
        return engine_stats(self)
