"""`LLM`: offline batched generation, shaped as vLLM's `vllm.LLM`."""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Sequence as SequenceABC

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jaxpaged.config import CacheConfig
from jaxpaged.errors import InvalidRequestError, RequestFailedError
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.model_loader.model_store import resolve_model
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


def resolve_quantization(quantization: str | None, model) -> str | None:
    """`LLM`'s `quantization`: "auto" is "int8" for a GGUF file, else None."""
    if quantization != "auto":
        return quantization
    return "int8" if model is not None and str(model).endswith(".gguf") else None


class LLM:
    """A model and its engine, for generating from Python.

    Args:
      model: None or "HuggingFaceTB/SmolLM2-135M-Instruct" for the embedded default model, or
        the path of a local Hugging Face folder of a supported architecture (LlamaForCausalLM).
      dtype: "auto" (float32 on CPU, bfloat16 on GPU), "float32", "bfloat16" or "float16".
      max_model_len: tokens per sequence (prompt + output); default the model's
        `max_position_embeddings`.
      max_num_seqs: sequences per step.
      max_num_batched_tokens: tokens per step; default max(max_model_len, 2048).
      long_prefill_token_threshold: prompt tokens a sequence computes at most in a step that
        also decodes (0: no cap; default 128); bounds inter-token latency under load (see
        `jaxpaged.core.scheduler`).
      max_num_partial_prefills: prompts computed at most in a step that also decodes.
      scheduling_policy: "fcfs" (arrival order) or "priority": requests run by their
        `priority` (lower first, ties by arrival; `generate(..., priority=[...])`), and a
        waiting request that finds no room preempts running ones of lower priority (vLLM's).
      block_size: tokens per KV block.
      num_kv_blocks: blocks in the KV pool; default: as many as `kv_cache_memory_bytes` holds.
      kv_cache_memory_bytes: KV pool budget in bytes (default 2 GiB).
      enable_prefix_caching: reuse the K/V of full blocks of earlier prompts with the same
        prefix (automatic prefix caching); `RequestOutput.num_cached_tokens` reports the hits.
      attention_backend: "auto" (Pallas kernels on GPU; on CPU the C++ kernel, or XLA where
        no C++ compiler is found), "cpu", "pallas", "pallas-interpret" (the kernels under the
        Pallas interpreter, for tests) or "xla" (pure jnp).
      seed: seeds the per-request seeds of requests that set none.
      tensor_parallel_size: devices to split the model over (tensor parallelism on a
        `jax.sharding.Mesh` of the first that many of `jax.devices()`): query heads, the MLP's
        hidden units and the vocabulary are split evenly, the KV pool by KV head (repeated
        when there are fewer KV heads than devices). `kv_cache_memory_bytes` is then the
        pool's total over all devices.
      coordinator_address, num_processes, process_id: run on several processes (hosts) as one
        JAX runtime (`jax.distributed.initialize`; process 0 hosts the coordinator at
        "host:port"): the mesh then spans every process's devices. Run the same program, with
        the same calls, on every process (see `jaxpaged.distributed.multihost`).
      precompile: True compiles the model step for every shape the limits above allow, at
        startup (with a progress bar), so that serving compiles nothing new: one shape per
        token bucket of a packed step, about 25 under the default limits (twice that on the
        Pallas backends, which compile decode-only steps apart). None (the default) is True
        except on "pallas-interpret", whose interpreted kernels compile shapes as met. A list
        of step sizes in tokens (ints >= 1) compiles, or loads from the compilation cache, the
        steps of those sizes alone and runs each once, while the tokenizer loads: `[1]` for
        the decode step of one sequence, what a one-shot `jaxpaged generate` runs for every
        token after the first. Steps computing prompt logprobs take logits at every token and
        compile their shape when first met.
      compilation_cache_dir: where compiled steps are kept across processes
        (`jaxpaged.worker.compilation_cache`): "auto" (`$JAXPAGED_COMPILATION_CACHE_DIR`, else
        `$JAXPAGED_HOME/compile-cache`), a folder, or None (or "off") for none. With the
        cache warm, startup loads each shape (about 0.2 s on CPU) instead of compiling it
        (1-2 s).
      batch_invariant: results that do not depend on the batch: a request's token ids and
        log-probabilities are bitwise the same whatever other requests share its steps, however
        its prompt is chunked, whether its prefix comes from the prefix cache, and whether it
        was preempted and recomputed (greedy and seeded sampling). CPU only, on the "cpu"
        (the C++ kernel in its invariant order) or "xla" attention backend: every step is
        padded to at least 64 tokens, or 16 to 48 where the model's own step is found to give
        the same bits from there (checked at start), so that XLA:CPU's matmuls compute each
        row the same way whatever the other rows, and attention sums each query's keys in one
        order (see `jaxpaged.platforms.cpu`).
      quantization: None (weights in `dtype`) or "int8": weight-only int8, one scale per
        output channel, for every linear layer and the token embedding (a tied LM head
        included), made at load (`models.quantization`); on CPU the matmuls read the int8
        weights (`pallas_kernels.quantized_matmul`). "auto" (the default): "int8" for a GGUF
        file given as `model` (its quantized blocks converted once, at load, to int8 rows;
        no float copy on disk), None otherwise.
      kv_cache_dtype: the KV pool's dtype (vLLM's option): "auto" (the model's `dtype`),
        "float32", "bfloat16", "float16", or the 8-bit pools "int8" and "fp8"
        (float8_e4m3fn), one float32 scale per token and head: about a quarter of float32's
        bytes per token, so `kv_cache_memory_bytes` holds about 3.8x the tokens.
      generation_config: where the default sampling values come from (vLLM's option): "auto"
        the model folder's `generation_config.json` (its temperature, top_p, top_k, min_p,
        repetition_penalty and max_new_tokens), "vllm" or None none (`SamplingParams()`'s),
        or another folder holding one. `get_default_sampling_params()` returns them; they
        apply where no sampling params are given, and the server's requests override them
        field by field.
      speculative_config: speculative decoding (`jaxpaged.spec_decode`), vLLM's keys as a
        dict (or its JSON text): `{"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": n, "prompt_lookup_min": m}` or `{"model": PATH,
        "num_speculative_tokens": k}` (a draft model with the target's vocabulary), and
        `disable_by_batch_size`. Outputs are the target's own draws (greedy ids equal to
        decoding without it); acceptance is in each output's `metrics` and in `stats()`.
      reasoning_parser: "qwen3" or "deepseek_r1" for a model that thinks between `<think>`
        and `</think>` (each one token of its tokenizer): a request's `structured_outputs`
        then constrain only the answer after `</think>` (vLLM's behaviour), and `jaxpaged
        serve --reasoning-parser` returns the thinking as `reasoning_content`.

    Raises:
      ValueError: an unknown model or an out-of-range setting, naming it.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None,
                 long_prefill_token_threshold: int | None = None,
                 max_num_partial_prefills: int = 1, scheduling_policy: str = "fcfs",
                 block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory_bytes: int = 2 << 30,
                 enable_prefix_caching: bool = True, attention_backend: str = "auto",
                 seed: int = 0, precompile: bool | list[int] | None = None,
                 tensor_parallel_size: int = 1,
                 coordinator_address: str | None = None, num_processes: int = 1,
                 process_id: int = 0,
                 compilation_cache_dir: str | os.PathLike | None = "auto",
                 batch_invariant: bool = False, quantization: str | None = "auto",
                 kv_cache_dtype: str = "auto", speculative_config: dict | str | None = None,
                 generation_config: str | os.PathLike | None = "auto",
                 reasoning_parser: str | None = None):
        if coordinator_address is not None:
            init_distributed(coordinator_address, num_processes, process_id)
        elif num_processes != 1:
            raise ValueError(f"num_processes={num_processes} needs a coordinator_address")
        model_dir = resolve_model(model)
        cache_config = CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                                   kv_cache_memory_bytes=kv_cache_memory_bytes,
                                   enable_prefix_caching=enable_prefix_caching)
        self.llm_engine = LLMEngine(model_dir, dtype=dtype, max_model_len=max_model_len,
                                    max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    long_prefill_token_threshold=long_prefill_token_threshold,
                                    max_num_partial_prefills=max_num_partial_prefills,
                                    scheduling_policy=scheduling_policy,
                                    cache_config=cache_config,
                                    attention_backend=attention_backend, seed=seed,
                                    precompile=precompile,
                                    tensor_parallel_size=tensor_parallel_size,
                                    compilation_cache_dir=compilation_cache_dir,
                                    batch_invariant=batch_invariant,
                                    quantization=resolve_quantization(quantization, model),
                                    kv_cache_dtype=kv_cache_dtype,
                                    speculative_config=speculative_config,
                                    reasoning_parser=reasoning_parser)
        self._dense_forward = None  # jitted on first use
        if generation_config in (None, "vllm"):
            self.generation_defaults = {}
        else:
            self.generation_defaults = generation_defaults(
                model_dir if generation_config == "auto" else generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """`SamplingParams` with the model's generation-config defaults (`generation_config`);
        what `generate` and `chat` use when given none."""
        return SamplingParams(**self.generation_defaults)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | SequenceABC[PromptType],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: SequenceABC[int] | None = None
                 ) -> list[RequestOutput]:
        """Generates completions for all prompts, batched, and returns them in input order.

        Args:
          prompts: a str, a `{"prompt_token_ids": [...]}` dict, or a list of either.
          sampling_params: one `SamplingParams` for all prompts, one per prompt, or None for the
            defaults.
          use_tqdm: show a progress bar.
          priority: one int per prompt (lower first) under `scheduling_policy="priority"`.

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
        tokenized = [self.llm_engine.tokenize_prompt(p) for p in prompts]
        return self._run([{"prompt": text, "prompt_token_ids": ids} for text, ids in tokenized],
                         params, use_tqdm, priority or [0] * len(prompts))

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
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
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts, params, use_tqdm, priorities) -> list[RequestOutput]:
        engine = self.llm_engine
        request_ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, sp, priority in zip(prompts, params, priorities):
                # Only the final output is kept: the engine need not build the others.
                sp = copy.copy(sp)
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                request_ids.append(engine.add_request(prompt, sp, priority=priority))
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
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for each prompt (matches HF `generate(num_beams=..., do_sample=False)`).

        All prompts' beams run batched in the same steps; beams share their common prefix's KV
        blocks through prefix caching. Returns one `BeamSearchOutput` per prompt, its
        `sequences` best first.

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
        return beam_search(engine, [ids for _, ids in tokenized], params)

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (for timing cold starts); False while requests run."""
        return self.llm_engine.reset_prefix_cache()

    # -- the research API: log-probabilities out, weights in, memory back ----------------

    def completion_logprobs(self, prompt_token_ids, completion_token_ids,
                            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                            use_tqdm: bool = False) -> list[np.ndarray]:
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
                        seqs[i] = engine.add_scoring_request(ids, start, params)
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
