"""`LLM`: offline batched generation, shaped as vLLM's `vllm.LLM`."""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Sequence as SequenceABC

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jaxpaged.lora import LoRARequest
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.errors import InvalidRequestError, RequestFailedError
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.models import dense_forward
from jaxpaged.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from jaxpaged.distributed.parallel import init_distributed
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, generation_defaults

PromptType = str | dict


def _token_rows(rows, field: str, repeat: int | None = None) -> list:
    """A list of token-id rows from a list of lists (or a 2-D array); one row (a list of ints, a
    1-D array) is one row, or with `repeat` that row `repeat` times."""
    if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__len__"):
        raise InvalidRequestError(field, f"{field} must be a list of token-id lists, got "
                                  f"{type(rows).__name__}: {rows!r:.80}")
    if len(rows) and np.ndim(rows[0]) == 0:  # one row of ids
        return [rows] * (1 if repeat is None else repeat)
    return list(rows)


class LLM:
    """A model and its engine, for generating from Python.

    Args:
      model: None or "HuggingFaceTB/SmolLM2-135M-Instruct" for the embedded default model, the
        path of a local Hugging Face folder of a supported architecture, or a GGUF file.
      **kwargs: the engine options: the fields of `jaxpaged.engine.arg_utils.EngineArgs`, which
        gives each one's type, default, allowed values and meaning (`inspect.signature(LLM)`
        lists them with their defaults). Among them `max_model_len`, `max_num_seqs`,
        `max_num_batched_tokens`, `block_size`, `num_kv_blocks`, `kv_cache_memory_bytes`
        (bytes), `enable_prefix_caching`, `kv_cache_dtype`, `quantization`,
        `attention_backend`, `tensor_parallel_size`, `batch_invariant` (see
        `jaxpaged.platforms.cpu`), `precompile`, `compilation_cache_dir`,
        `speculative_config` (`jaxpaged.spec_decode`), `generation_config` (the
        defaults `get_default_sampling_params` returns) and `reasoning_parser`.
        `coordinator_address`, `num_processes` and `process_id` run one engine on several
        processes (`jaxpaged.distributed.multihost`).

    Raises:
      TypeError: a keyword that is no engine option, named.
      ValueError: an unknown model or an out-of-range setting, naming it.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs):
        self._init(EngineArgs.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: str = "offline") -> LLM:
        """The `LLM` of `engine_args` (as `LLM(**dataclasses.asdict(engine_args))`), with the
        defaults of `usage_context` ("offline", or "serve" for `jaxpaged serve`:
        `EngineArgs.create_engine_config`)."""
        llm = cls.__new__(cls)
        llm._init(engine_args, usage_context)
        return llm

    def _init(self, engine_args: EngineArgs, usage_context: str = "offline") -> None:
        self.engine_args = engine_args  # as given, for a manifest (`jaxpaged.entrypoints.batch`)
        if engine_args.coordinator_address is not None:
            init_distributed(engine_args.coordinator_address, engine_args.num_processes,
                             engine_args.process_id)
        config = engine_args.create_engine_config(usage_context)
        self.llm_engine = LLMEngine(config)
        self._dense_forward = None  # jitted on first use
        generation_config = config.model.generation_config
        if generation_config in (None, "vllm"):
            self.generation_defaults = {}
        else:
            self.generation_defaults = generation_defaults(
                config.model.model_dir if generation_config == "auto" else generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """`SamplingParams` with the model's generation-config defaults (`generation_config`);
        what `generate` and `chat` use when given none."""
        return SamplingParams(**self.generation_defaults)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | SequenceABC[PromptType],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: SequenceABC[int] | None = None,
                 lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generates completions for all prompts, batched, and returns them in input order.

        Args:
          prompts: a str, a `{"prompt_token_ids": [...]}` dict, or a list of either.
          sampling_params: one `SamplingParams` for all prompts, one per prompt, or None for the
            defaults.
          use_tqdm: show a progress bar.
          priority: one int per prompt (lower first) under `scheduling_policy="priority"`.
          lora_request: the adapter (`LoRARequest`) all prompts run under, or one per prompt
            (None: the base model); needs `enable_lora=True`.

        Returns:
          One finished `RequestOutput` per prompt. A request that a fault in an engine step was
          traced to comes back with `error` set and its completions' finish_reason "error"
          (the others complete; see `jaxpaged.errors`).

        Raises:
          ValueError: a prompt or parameter is invalid (an `InvalidRequestError` naming it);
            raised before anything runs.
          EngineDeadError: a fatal fault stopped the engine.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, got {p!r:.80}")
        # Tokenize and validate every prompt before queueing any.
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        tokenized = [self.llm_engine.tokenize_prompt(p) for p in prompts]
        return self._run([{"prompt": text, "prompt_token_ids": ids} for text, ids in tokenized],
                         params, use_tqdm, priority or [0] * len(prompts), loras)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, via the model's chat template.

        Args:
          messages: `[{"role": ..., "content": ...}, ...]` or a list of such conversations.
          add_generation_prompt: end the prompt with the template's assistant header.
          continue_final_message: leave the last message open, so the reply continues it
            (exclusive with `add_generation_prompt`).
          tools: OpenAI-style tool definitions, passed to the chat template (the output is
            not parsed; constrain it with `StructuredOutputsParams` to get calls).
          chat_template_kwargs: extra template variables (`{"enable_thinking": False}` for
            Qwen3), as vLLM's `LLM.chat`.
          lora_request: the adapter the replies come from (see `generate`).

        Raises:
          ValueError: an empty conversation, or one the chat template rejects.
        """
        if not messages:
            raise ValueError("messages is empty: give a conversation or a list of them")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            text, ids = self.llm_engine.chat_prompt(conversation, add_generation_prompt,
                                                    continue_final_message, tools,
                                                    chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _run(self, prompts, params, use_tqdm, priorities, loras) -> list[RequestOutput]:
        engine = self.llm_engine
        request_ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, sp, priority, lora in zip(prompts, params, priorities, loras):
                # Only the final output is kept: the engine need not build the others.
                sp = copy.copy(sp)
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                request_ids.append(engine.add_request(prompt, sp, priority=priority,
                                                      lora_request=lora))
            with tqdm(total=len(request_ids), desc="Processed prompts",
                      disable=not use_tqdm) as bar:
                while len(finished) < len(request_ids):
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
        finally:  # an interrupted run must not leave requests holding blocks
            for request_id in request_ids:
                if request_id not in finished:
                    engine.abort_request(request_id)
        return [finished[r] for r in request_ids]

    def beam_search(self, prompts: PromptType | SequenceABC[PromptType],
                    params: BeamSearchParams, lora_request: LoRARequest | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (matches HF `generate(num_beams=..., do_sample=False)`).

        All prompts' beams run batched in the same steps; beams share their common prefix's KV
        blocks through prefix caching. Returns one `BeamSearchOutput` per prompt, its
        `sequences` best first. `lora_request`: the adapter the beams run under.

        Raises:
          ValueError: a bad prompt or parameter, or a KV pool too small for all the beams.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {params!r:.80}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        if params.beam_width > engine.scheduler_config.max_num_seqs:
            raise InvalidRequestError(
                "beam_width", f"beam_width={params.beam_width} beams cannot run at once: this "
                f"engine runs at most max_num_seqs={engine.scheduler_config.max_num_seqs}")
        tokenized = [engine.tokenize_prompt(p) for p in prompts]
        S = engine.cache_config.block_size
        for _, ids in tokenized:
            need = params.beam_width * -(-(len(ids) + params.max_tokens) // S)
            if need > engine.block_manager.num_blocks:
                raise ValueError(f"beam_width={params.beam_width} over {len(ids)} prompt + "
                                 f"{params.max_tokens} new tokens needs up to {need} KV blocks; "
                                 f"the pool has {engine.block_manager.num_blocks}")
        if engine.has_unfinished_requests():
            raise RuntimeError("beam_search needs an idle engine")
        return beam_search(engine, [ids for _, ids in tokenized], params,
                           lora_request=lora_request)

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (for timing cold starts); False while requests run."""
        return self.llm_engine.reset_prefix_cache()

    # -- LoRA adapters (`enable_lora=True`) ------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads the PEFT folder `lora_request.lora_path` as adapter `lora_request.lora_name`
        (a new version if the name is held: requests running on the old one finish on it).

        Raises:
          ValueError: LoRA not enabled, or a bad folder, config or tensor (named).
        """
        self._loras().add(lora_request)
        return True

    def remove_lora(self, lora_name: str) -> bool:
        """Forgets an adapter (requests using it finish on it); False if none had the name."""
        return self._loras().remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters held on the host, least recently used first."""
        return self._loras().list()

    def update_lora(self, lora_name: str, tensors: dict, config: dict | None = None) -> None:
        """Adapter `lora_name` from arrays in memory, for training loops. `tensors`: PEFT-named
        (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: f[r, in]`,
        `...lora_B.weight: f[out, r]`), or a qwix `nnx.LoRAParam` tree of a tunix model
        (`layers.0.attn.q_proj.w_lora_a: f[D, r]`, `w_lora_b: f[r, N, H]`; qwix's scale
        alpha / rank is PEFT's, so give `lora_alpha` in `config`), whose layout is converted
        (`integrations.tunix_params`). `config`: a PEFT config dict (default: the held
        version's, or `lora_alpha = r`). New requests use it from the next step. NumPy
        arrays compile nothing; `jax.Array`s are laid out on their device by functions
        compiled at the first update of each layout, and move nothing through the host.
        Atomic: on an error the held version keeps serving.

        Raises:
          ValueError: a name, shape or config field the adapter cannot have (named).
        """
        from jaxpaged.integrations.tunix_params import is_qwix_tree, qwix_lora_tensors
        if is_qwix_tree(tensors):
            tensors = qwix_lora_tensors(tensors)
        self._loras().update(lora_name, tensors, config)

    def _loras(self):
        if self.llm_engine.lora is None:
            raise ValueError("this LLM serves no adapters: build it with enable_lora=True")
        return self.llm_engine.lora

    # -- the research API: log-probabilities out, weights in, memory back ----------------

    def completion_logprobs(self, prompt_token_ids, completion_token_ids,
                            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                            use_tqdm: bool = False, lora_request: LoRARequest | None = None
                            ) -> list[np.ndarray]:
        """The log-probability of each completion token given everything before it, teacher
        forced through the paged engine (tunix's `get_per_token_logps`).

        The distribution is the one sampling with these parameters draws from (`sampler`):
        logits divided by `temperature`, then top-k and top-p applied and renormalized; -inf
        for a token they remove. At temperature 0 (greedy) it is the model's log-softmax, as
        `generate` reports a greedy sample's processed logprobs. With the defaults it is
        the model's log-softmax, which `generate` reports as `logprobs` ("raw"); with others it
        equals `generate`'s logprobs under `logprobs_mode="processed"` (no min-p, penalties or
        bias here). Pairs are batched as prompts are, chunked, and a prompt shared by several
        completions is computed once when prefix caching is on: the first completion of each
        distinct prompt runs first, the others then find its blocks in the prefix cache.

        Args:
          prompt_token_ids: one prompt per completion (list of lists of ints), or one list of
            ints shared by all completions.
          completion_token_ids: a list of lists of ints (one completion: a list of ints).
          temperature, top_k, top_p: as in `SamplingParams` (same ranges).
          use_tqdm: show a progress bar.
          lora_request: the adapter whose log-probabilities these are (None: the base model).

        Returns:
          One f32[len(completion)] NumPy array per completion, in order.

        Raises:
          ValueError: counts that differ, an empty prompt, ids outside the vocabulary, a pair
            longer than `max_model_len` - 1, or a parameter out of range (named); raised before
            anything runs.
          RuntimeError: the engine is asleep, or busy with other requests.
          RequestFailedError: a fault in an engine step was traced to a pair (see
            `jaxpaged.errors`); the others were scored.
        """
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        completions = _token_rows(completion_token_ids, "completion_token_ids")
        prompts = _token_rows(prompt_token_ids, "prompt_token_ids", len(completions))
        if len(prompts) != len(completions):
            raise InvalidRequestError("prompt_token_ids", f"got {len(prompts)} prompts for "
                                      f"{len(completions)} completions")
        engine = self.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("completion_logprobs needs an idle engine")
        # Validate all, then queue them: the first of each distinct prompt runs first.
        first, rest, seen = [], [], set()
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            ids, start = engine.scoring_prompt(prompt, completion)
            key = tuple(ids[:start])
            (rest if key in seen else first).append((i, ids, start))
            seen.add(key)
        waves = [first, rest] if engine.cache_config.enable_prefix_caching else [first + rest]
        seqs: dict[int, object] = {}
        failed: dict[str, str] = {}
        try:
            with tqdm(total=len(completions), desc="Scored completions",
                      disable=not use_tqdm) as bar:
                for wave in waves:
                    for i, ids, start in wave:
                        seqs[i] = engine.add_scoring_request(ids, start, params,
                                                             lora_request)
                    while engine.has_unfinished_requests():
                        for output in engine.step():
                            bar.update(int(output.finished))
                            if output.error is not None:
                                failed[output.request_id] = output.error
        finally:  # an interrupted run must not leave requests holding blocks
            for seq in seqs.values():
                engine.abort_request(seq.request_id)
        for i, seq in sorted(seqs.items()):
            if seq.request_id in failed:
                raise RequestFailedError(f"scoring completion {i} failed: "
                                         f"{failed[seq.request_id]}")
        return [seqs[i].scoring.logprobs for i in range(len(completions))]

    # -- the research API: weights in, memory back ---------------------------------------

    def get_params(self) -> nnx.State:
        """The parameter tree the engine serves: an `nnx.State` (a pytree; `nnx.to_pure_dict`
        gives nested dicts) of `jax.Array`s on the engine's devices with its shardings, laid out
        as the family's module holds them (q/k/v and gate/up stacked, kernels `f[in, out]`; see
        `jaxpaged.models.llama`). The tree `dense_forward` and `update_params` take. The
        arrays are the ones served, not copies: donating them to a jitted function (or calling
        `.delete()`) deletes the engine's weights, and it then fails until `update_params`.

        Raises:
          RuntimeError: the weights were released by `sleep(level=2)`.
        """
        return self.llm_engine.get_params()

    def dense_forward(self, params: nnx.State, input_ids, attention_mask=None) -> jax.Array:
        """The served model as a plain causal forward (no KV pool, no engine), jitted and
        differentiable in `params`: for a training step on the weights the engine serves.
        Its logits equal the engine's for the same tokens (`jaxpaged.models.dense_forward`).

        Args:
          params: `get_params()`, or a tree of its structure (an `nnx.State`; `jax.grad` of a
            loss of this function gives one).
          input_ids: i32[B, T] token ids.
          attention_mask: [B, T], 1 at real tokens, 0 at padding (left or right); None: none.

        Returns:
          f32[B, T, V] logits at every position.
        """
        if self._dense_forward is None:
            self._dense_forward = jax.jit(functools.partial(dense_forward,
                                                            self.llm_engine.runner.graphdef))
        return self._dense_forward(params, jnp.asarray(input_ids, jnp.int32),
                                   None if attention_mask is None else jnp.asarray(attention_mask))

    def embed(self, prompts: PromptType | SequenceABC[PromptType], pooling: str = "last",
              normalize: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeddings of prompts (vLLM's `LLM.embed` on a causal model): the final hidden
        states, after the final norm, pooled over each prompt: its last token ("last", vLLM's
        default for decoder models) or the mean of its tokens ("mean"); L2-normalized unless
        `normalize=False`. No KV write and no KV block used (`LLMEngine.embed`).

        Args:
          prompts: a str, a `{"prompt_token_ids": [...]}` dict, or a list of either.

        Returns:
          One `EmbeddingRequestOutput` per prompt, in order; `outputs.embedding` has
          `hidden_size` floats.

        Raises:
          ValueError: a bad prompt or pooling (named).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        ids = [self.llm_engine.tokenize_prompt(p)[1] for p in prompts]
        vectors = self.llm_engine.embed(ids, pooling, normalize)
        return [EmbeddingRequestOutput(str(i), row_ids, EmbeddingOutput(v.tolist()))
                for i, (row_ids, v) in enumerate(zip(ids, vectors))]

    def update_params(self, params) -> None:
        """Serves with new weights from the next step: no disk, no recompilation. The prefix
        cache is dropped (its K/V came from the old weights).

        Args:
          params: a tree of `get_params`'s structure (an `nnx.State` or its pure nested dict),
            leaves `jax.Array`s (sharded or not, on any device: each is copied with the
            engine's sharding, so the caller may donate or change its own afterwards) or NumPy
            arrays, of each parameter's shape and dtype.

        Raises:
          ValueError: a missing or unknown parameter, or one of another shape or dtype, named;
            checked before anything changes, so the old weights keep serving.
        """
        self.llm_engine.update_params(params)

    def load_weights(self, weights) -> None:
        """Replaces the parameters named by Hugging Face checkpoint names (vLLM's
        `load_weights`): `weights` is an iterable of `(hf_name, array)` pairs, arrays in the
        checkpoint's orientation (`nn.Linear.weight` is `[out, in]`) and any float dtype (cast
        to the engine's). q/k/v and gate/up are written into their stacked parameters as the
        loader does; any subset may be given. Then as `update_params`.

        Raises:
          ValueError: a name that is no parameter of the model, or a wrong shape, named.
        """
        self.llm_engine.load_weights(weights)

    def sleep(self, level: int = 1) -> None:
        """Hands memory back while the engine is idle (vLLM's sleep mode). Level 1 releases the
        KV pool (the prefix cache with it) and keeps the weights; level 2 also drops the
        engine's references to the weights (their memory is freed unless the caller holds
        them). `wake_up` restores; `update_params` may give new weights while asleep.
        Generating while asleep raises RuntimeError.

        Raises:
          ValueError: a level other than 1 or 2. RuntimeError: requests are running.
        """
        self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        """Undoes `sleep`: an empty KV pool, and after level 2 the weights, read again from the
        model folder unless `update_params` gave them meanwhile. The model step compiles
        nothing; reading the weights again runs the loader's layout function (compiled once
        per process)."""
        self.llm_engine.wake_up()

    def stats(self) -> dict[str, int]:
        """num_total_blocks, num_free_blocks, num_running, num_waiting, num_preemptions."""
        return self.llm_engine.stats()


LLM.__init__.__signature__ = EngineArgs.signature(
    inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD))
