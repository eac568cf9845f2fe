"""The engine: requests in, one scheduled and executed step at a time, outputs out."""

from __future__ import annotations

import logging
import time

import numpy as np
from flax import nnx

from jaxpaged.config import EngineConfig
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.sequence import Scoring, Sequence
from jaxpaged.engine.async_scheduling import AsyncScheduling
from jaxpaged.engine.embedding import Embedder
from jaxpaged.engine.faults import FaultIsolatingExecutor, describe
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.processor import RequestProcessor
from jaxpaged.engine.request_book import RequestBook
from jaxpaged.engine.served_model import ServedModel
from jaxpaged.engine.stats import engine_stats
from jaxpaged.engine.weights import EngineWeights
from jaxpaged.errors import EngineDeadError, InvalidRequestError
from jaxpaged.lora import LoRAManager, LoRARequest, resolve_lora
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.spec_decode import ProposerContext, make_proposer, set_proposals

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
        served = self.served = ServedModel(config)
        self.config = config = served.config  # with the kernel plan and the cache in force
        self.runner, self.tokenizer = served.runner, served.tokenizer
        # What the entry points, the server and the tests read of the model side.
        self.model_dir = served.model_dir
        self.model_config = served.model_config
        self.model_cls = served.model_cls
        self.mesh = served.mesh
        self.dtype = served.dtype
        self.kv_cache_dtype = served.kv_cache_dtype
        self.eos_token_ids = served.eos_token_ids
        self.attention_backend = served.backend.name
        self.quantization = config.quantization.method
        self.batch_invariant = config.execution.batch_invariant
        self.cache_config = config.cache
        self.scheduler_config = config.scheduler
        self.speculative_config = config.speculative
        self.processor = RequestProcessor(self.tokenizer, self.model_config.vocab_size,
                                          self.scheduler_config, config.reasoning.parser,
                                          config.model.seed)
        self.input_processor = self.processor.input_processor  # tokenizing, chat templates
        self.think_token_ids = self.processor.think_token_ids  # (<think>, </think>) or None
        self.block_manager = BlockManager(served.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.lora = (LoRAManager(config.lora, self.runner, served.lora_sites, self.model_cls,
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
                self.model_config, self.dtype, served.backend, self.cache_config,
                served.num_blocks, self.scheduler_config, served.cache_dir, self.mesh)))
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish)
        self.book = RequestBook(self.output_processor, self.scheduler, self.proposer,
                                forks_unlisted=self.async_scheduling is not None)
        self.requests = self.book.requests  # by request id, until each has finished
        self.weights = EngineWeights(self.runner, self.block_manager,
                                     lambda: served.load_model(self.runner.backend),
                                     self.model_cls, self.model_config, self.dtype,
                                     self.quantization, self.lora and self.lora.restore_slots)
        self.embedder = Embedder(self.runner.graphdef, self.model_config.hidden_size)
        self.dead: EngineDeadError | None = None  # set by a fatal fault: no step runs after it

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
        self.check_alive()
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
        self.book.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_alive(self) -> None:
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
        self.check_alive()
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
        self.book.add_prompt_logprobs(out, prompt_lps, failed)
        return self.book.outputs(out, update, failed, now)

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
        self.check_alive()
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
