"""The engine: requests in, one scheduled and executed step at a time, outputs out."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import json
import logging
import os
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.worker import compilation_cache
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.config import KV_CACHE_DTYPES, EngineConfig
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.errors import EngineDeadError, InvalidRequestError
from jaxpaged.engine.faults import FaultIsolatingExecutor, describe
from jaxpaged.engine.input_processor import InputProcessor
from jaxpaged.worker.model_runner import ModelRunner, kv_cache_bytes_per_token, num_kv_blocks
from jaxpaged.model_loader import gguf_import
from jaxpaged.worker.buckets import next_power_of_2
from jaxpaged.models import load_config, load_model, pooled_hidden_states
from jaxpaged.models.layers import enable_few_row_kernel
from jaxpaged.models.quantization import QUANTIZATION_METHODS, quantize_model, weight_bytes
from jaxpaged.pallas_kernels.reference import KV_CODE_DTYPES
from jaxpaged.models.loader import flat_params, params_from_hf_weights
from jaxpaged.model_loader.model_store import resolve_model
from jaxpaged.outputs import Logprob, RequestMetrics, RequestOutput
from jaxpaged.distributed.parallel import make_mesh
from jaxpaged.engine.request import Request, new_stop_state
from jaxpaged.pallas_kernels import make_attention_backend
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.spec_decode.proposers import (DraftModelProposer, NgramProposer, SpeculativeConfig,
                                  num_proposals)
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.sequence import Scoring, Sequence
from jaxpaged.engine.stop_strings import StopStringState
from jaxpaged.sample.structured_outputs import GrammarCompiler, ReasoningGate, think_token_ids

logger = logging.getLogger(__name__)


def resolve_dtype(dtype: str) -> jnp.dtype:
    """"auto" is float32 on CPU and bfloat16 on accelerators; else a jnp dtype name."""
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto', 'float32', "
                         "'bfloat16' or 'float16'")
    return jnp.dtype(dtype)


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype) -> jnp.dtype | str:
    """The pool's dtype: "auto" is the model's `dtype`; "int8" and "fp8" (float8_e4m3fn) are
    8-bit pools with per-token scales (`pallas_kernels.reference.QuantizedKVCache`), returned
    as those names.

    Raises:
      ValueError: a value not in `KV_CACHE_DTYPES`.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
    if kv_cache_dtype == "auto":
        return jnp.dtype(dtype)
    if kv_cache_dtype in KV_CODE_DTYPES:
        return kv_cache_dtype
    return jnp.dtype(kv_cache_dtype)


# Tokenizer classes that are `tokenizers`' generic fast tokenizer under another name, and the
# model types for which AutoTokenizer keeps that class when `tokenizer_config.json` names it
# (transformers 5 forces its own class on those of its `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`,
# qwen2 and phi3 among them, and may give mistral `MistralCommonBackend`): these load without
# AutoTokenizer (see `_load_tokenizer`).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "gemma2", "gemma3", "gemma3_text", "qwen3")


def _read_json(path: Path) -> dict | None:
    """A JSON object file's contents; None when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _load_tokenizer(model_dir: Path):
    """`AutoTokenizer.from_pretrained(model_dir)`, with transformers imported here rather than
    with jaxpaged (seconds: it runs on a thread beside the model's loading).

    Where `tokenizer_config.json` names the generic fast tokenizer (`GENERIC_TOKENIZER_CLASSES`,
    as checkpoints saved by transformers 5 do) for a model type on which AutoTokenizer keeps it
    (`GENERIC_TOKENIZER_MODEL_TYPES`), with no custom code (`auto_map`) and no Mistral
    `tekken.json`, that class is loaded directly, the same tokenizer: importing AutoTokenizer
    imports `transformers.configuration_utils`, and with it torch where torch is installed
    (1.5 s of a 2-core machine's time at every start). Otherwise AutoTokenizer reads the model
    config only for its `model_type` (and `tokenizer_class`, and the name), which the generic
    `PreTrainedConfig` holds as well; `AutoConfig` would first import the family's config
    module, and with it about a second of torch.distributed."""
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json") or {}
    model_config = _read_json(model_dir / "config.json")
    tokenizer_class = tokenizer_config.get("tokenizer_class")
    if (tokenizer_class in GENERIC_TOKENIZER_CLASSES
            and (model_config or {}).get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES
            and "auto_map" not in tokenizer_config
            and (model_dir / "tokenizer.json").is_file()
            and not (model_dir / "tekken.json").exists()):
        import transformers
        return getattr(transformers, tokenizer_class).from_pretrained(model_dir)

    from transformers import AutoTokenizer, PreTrainedConfig

    if model_config is None:  # no or an odd config.json: AutoConfig's way
        return AutoTokenizer.from_pretrained(model_dir)
    try:
        config = PreTrainedConfig(**model_config)
    except (ValueError, TypeError):  # fields the generic config refuses: AutoConfig's way
        return AutoTokenizer.from_pretrained(model_dir)
    config._name_or_path = str(model_dir)  # as AutoConfig sets it
    return AutoTokenizer.from_pretrained(model_dir, config=config)


# Batch invariance (`LLM(batch_invariant=True)`). What makes a request's numbers depend on its
# batch on CPU, measured on 16 seeded requests (tests/test_batch_invariance.py): XLA:CPU's dot
# computes a row of `x @ w` one way for a few rows and another way (the same for every row
# count) from 64 rows on, so every step is padded to at least 64 tokens (the LM head's rows
# are the step's sequence slots, a fixed count); and the C++ attention kernel's sums depend on
# how a step splits the keys (its online-softmax tiles follow the cached blocks and then the
# step's new tokens, and it scores a key by one of two loops depending on how many queries
# share a tile): in its invariant order (`paged_attention_cpu(invariant=True)`) the tiles are
# aligned on positions, cached and new keys gathered into one tile, and every score goes one
# way; the xla backend writes each step's keys to the pool first and reads every key from there
# in position order. Norms, RoPE and the sampler's per-row reductions need nothing.
BATCH_INVARIANT_MIN_TOKENS = 64
# Row counts at which a step may be padded more cheaply, checked on the model's own
# projections when the engine starts (`batch_invariant_min_tokens`): with XLA's YNNPACK fusions
# off (`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`, read when jax starts;
# `jaxpaged ... --batch-invariant` sets it) XLA:CPU's dot computes a row the same way from 8
# rows on, on SmolLM2's and Qwen2 0.5B's shapes.
CHEAPER_MIN_TOKENS = (16, 24, 32, 48)
YNN_FUSIONS_OFF = "--xla_cpu_experimental_ynn_fusion_type="


def batch_invariant_min_tokens(config) -> int:
    """The fewest tokens a batch-invariant step on the C++ attention kernel is padded to: 16
    where XLA:CPU's dot gives each row of the model's projections (q/k/v, o, gate/up, down) the
    same bits at every step size in `CHEAPER_MIN_TOKENS` as at 64 rows (random inputs; about a
    second of small compiles), else `BATCH_INVARIANT_MIN_TOKENS`. (The rest of such a step
    works row by row; the xla backend's attention batches its tokens' dots, and pads to 64.)"""
    D, N, K, H = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                  config.head_dim)
    F = config.intermediate_size
    rng = np.random.default_rng(0)
    dot = jax.jit(lambda x, w: x @ w)
    for k, n in {(D, (N + 2 * K) * H), (N * H, D), (D, 2 * F), (F, D)}:
        w = rng.standard_normal((k, n), np.float32)
        x = rng.standard_normal((BATCH_INVARIANT_MIN_TOKENS, k), np.float32)
        full = np.asarray(dot(x, w))
        for m in CHEAPER_MIN_TOKENS:
            if not np.array_equal(np.asarray(dot(x[:m], w)), full[:m]):
                return BATCH_INVARIANT_MIN_TOKENS
    return CHEAPER_MIN_TOKENS[0]


def _batch_invariant_backend(attention_backend: str) -> str:
    """The attention backend batch-invariant mode runs on: "cpu" (the C++ kernel in its
    invariant order) or "xla"; "auto" is the one `make_attention_backend` would pick.

    Raises:
      ValueError: not on CPU, or a Pallas backend asked for.
    """
    if jax.default_backend() != "cpu":
        raise ValueError(f"batch_invariant=True is implemented on CPU only, not on "
                         f"{jax.default_backend()!r}")
    if attention_backend not in ("auto", "cpu", "xla"):
        raise ValueError(f"batch_invariant=True runs on the 'cpu' or 'xla' attention backend, "
                         f"not {attention_backend!r}")
    return attention_backend


POOLING_TYPES = ("last", "mean")  # `LLMEngine.embed`'s pooling (vLLM's LAST and MEAN)

def _release_freed_memory() -> None:
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
        model_dir = Path(config.model.model_dir or resolve_model(config.model.model))
        execution, tensor_parallel_size = config.execution, config.parallel.tensor_parallel_size
        attention_backend, precompile = execution.attention_backend, execution.precompile
        batch_invariant = execution.batch_invariant
        cache_dir = compilation_cache.resolve_cache_dir(execution.compilation_cache_dir)
        self.speculative_config = config.speculative
        # Tensor parallelism: the model and the pool split over a mesh (`jaxpaged.distributed.parallel`).
        self.mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size != 1 else None
        self.model_config = load_config(model_dir).for_tensor_parallel(tensor_parallel_size)
        self.dtype = resolve_dtype(config.model.dtype)
        quantization = config.quantization.method
        if quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization {quantization!r} is not one of "
                             f"{QUANTIZATION_METHODS}")
        self.quantization = quantization
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        pool_dtype = (KV_CODE_DTYPES[self.kv_cache_dtype][0]
                      if self.kv_cache_dtype in KV_CODE_DTYPES else self.kv_cache_dtype)
        if batch_invariant:
            attention_backend = _batch_invariant_backend(attention_backend)
        self.batch_invariant = batch_invariant
        backend = make_attention_backend(attention_backend, pool_dtype, self.mesh,
                                         batch_invariant=batch_invariant)
        self.attention_backend = backend.name
        if precompile is None:  # interpreted kernels take minutes a shape: compile as met
            precompile = not backend.name.endswith("-interpret")
        self.scheduler_config = config.scheduler
        cache_config = config.cache
        if cache_config.enable_prefix_caching and self.model_config.rope_switch_length:
            # A block's K/V then depends on its sequence's length (longrope rotates with the
            # long factors once a sequence passes the original length), not on its tokens alone.
            logger.warning("prefix caching is off: this model's RoPE (longrope) makes cached "
                           "blocks depend on the length of the sequence that computed them")
            cache_config = dataclasses.replace(cache_config, enable_prefix_caching=False)
            self.config = dataclasses.replace(config, cache=cache_config)
        self.cache_config = cache_config
        num_blocks = num_kv_blocks(self.model_config, cache_config, self.kv_cache_dtype)
        if num_blocks * cache_config.block_size < self.scheduler_config.max_model_len:
            raise ValueError(
                f"the KV pool holds {num_blocks} blocks of {cache_config.block_size} tokens, "
                f"fewer than max_model_len={self.scheduler_config.max_model_len}: raise "
                "num_kv_blocks / kv_cache_memory_bytes or lower max_model_len")

        # The tokenizer loads on a thread beside the weights and the executables: it is Python
        # imports (transformers, and torch where it is installed: seconds) and file reads, they
        # are mostly XLA and numpy, outside the GIL.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(_load_tokenizer, model_dir)
            model = self._load_model(model_dir, backend)
            self.model_cls = type(model)
            self.runner = ModelRunner(model, cache_config, num_blocks, self.kv_cache_dtype,
                                      max_num_seqs=self.scheduler_config.max_num_seqs,
                                      max_model_len=self.scheduler_config.max_model_len,
                                      compilation_cache_dir=cache_dir,
                                      min_step_tokens=(
                                          1 if not batch_invariant
                                          else batch_invariant_min_tokens(self.model_config)
                                          if backend.name == "cpu"
                                          else BATCH_INVARIANT_MIN_TOKENS))
            shapes = self.runner.step_shapes(self.scheduler_config.max_num_batched_tokens)
            if isinstance(precompile, (list, tuple)):  # those step sizes alone, quietly
                wanted = {self.runner.step_tokens(n) for n in precompile}
                self.runner.precompile([(T, v) for T, v in shapes if T in wanted],
                                       progress=False, sampler_variants=False)
            elif precompile:
                self.runner.precompile(shapes, spec_tokens=self._max_spec_step_tokens())
            self.tokenizer = tokenizer.result()
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                              self.scheduler_config.max_model_len)
        self.eos_token_ids = self.runner.eos_token_ids = self._eos_token_ids(model_dir)
        # With a reasoning parser, structured outputs apply after the thinking (ReasoningGate).
        self.reasoning_parser = reasoning_parser = config.reasoning.parser
        self.think_token_ids = (None if reasoning_parser is None
                                else think_token_ids(self.tokenizer, reasoning_parser))
        if reasoning_parser is not None and self.think_token_ids is None:
            logger.warning("reasoning_parser %r: <think> or </think> is several tokens of this "
                           "tokenizer, so structured outputs cannot wait for the reasoning to "
                           "end; the server refuses them", reasoning_parser)
        self.block_manager = BlockManager(num_blocks, cache_config.block_size,
                                          cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager,
                                   padded_tokens=self.runner.step_tokens,
                                   eos_token_ids=self.eos_token_ids,
                                   recompute_at=self.model_config.rope_switch_length)
        self.executor = FaultIsolatingExecutor(self.runner)
        self.proposer = (None if self.speculative_config is None
                         else self._make_proposer(self.speculative_config, backend, cache_dir))
        self.requests: dict[str, Request] = {}
        # seeds of requests that give none
        self._seed_rng = np.random.default_rng(config.model.seed)
        self._request_ids = itertools.count()
        self._arrivals = itertools.count()  # arrival order, for the priority policy
        self._token_texts: dict[int, str] = {}
        self.dead: EngineDeadError | None = None  # set by a fatal fault: no step runs after it
        self.num_failed_requests = 0  # requests failed by a fault in a step
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputes included)
        self.num_generation_tokens = 0  # tokens sampled
        self.model_dir = model_dir
        self._pooled = None  # the jitted embedding forward, built on first use
        self.sleep_level = 0  # `sleep`: 0 awake, 1 without the KV pool, 2 without the weights too

    def _load_model(self, model_dir: Path, backend) -> nnx.Module:
        """The model with its weights (read from the GGUF file itself for a folder that serves
        one, `gguf_import.write_gguf_metadata`), quantized as `quantization` says."""
        source = gguf_import.gguf_source(model_dir)
        readers = None
        if source is not None:
            hf_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
            readers = gguf_import.open_gguf_weights(source, types.SimpleNamespace(**hf_config))
        model = load_model(model_dir, self.model_config, self.dtype, backend, self.mesh,
                           readers)
        model = quantize_model(model, self.quantization, mesh=self.mesh)
        # Steps of a few tokens (verifications) on the few-row kernel; not in batch-invariant
        # mode, whose rows must be computed one way whatever the step's size.
        if (self.mesh is None and self.dtype == jnp.float32 and jax.default_backend() == "cpu"
                and not self.batch_invariant
                and os.environ.get("JAXPAGED_FEW_ROW_KERNEL", "1") != "0"):
            enable_few_row_kernel(model)
        del readers
        _release_freed_memory()
        return model

    def _make_proposer(self, config: SpeculativeConfig, backend, cache_dir):
        """The proposer of `config` (`jaxpaged.spec_decode.proposers`); a draft model gets its own
        runner and KV pool of as many blocks as the target's.

        Raises:
          ValueError: a combination speculative decoding does not support (named), or a draft
            model whose vocabulary differs from the target's.
        """
        if self.model_config.rope_switch_length:
            raise ValueError("speculative_config: not supported for a model whose RoPE switches "
                             "with the sequence length (longrope)")
        if self.mesh is not None:
            raise ValueError("speculative_config: not supported with tensor_parallel_size > 1")
        if config.method == "ngram":
            return NgramProposer(config)
        draft_dir = resolve_model(config.model)
        draft_config = load_config(draft_dir)
        if draft_config.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model {config.model!r} has "
                             f"vocab_size {draft_config.vocab_size}, the target "
                             f"{self.model_config.vocab_size}; it must share the tokenizer")
        draft = load_model(draft_dir, draft_config, self.dtype, backend)
        num_blocks = self.block_manager.num_blocks
        cache_config = dataclasses.replace(self.cache_config, num_kv_blocks=num_blocks,
                                           enable_prefix_caching=False)
        runner = ModelRunner(draft, cache_config, num_blocks, self.dtype,
                             max_num_seqs=self.scheduler_config.max_num_seqs,
                             max_model_len=self.scheduler_config.max_model_len,
                             compilation_cache_dir=cache_dir)
        return DraftModelProposer(config, runner, BlockManager(num_blocks, cache_config.block_size),
                                  self.scheduler_config.max_num_batched_tokens)

    def _max_spec_step_tokens(self) -> int:
        """The most tokens a step verifying proposals takes (0 without speculation): every
        sequence it may run for decoding, each with k proposals."""
        c = self.speculative_config
        if c is None:
            return 0
        seqs = min(self.scheduler_config.max_num_seqs,
                   c.disable_by_batch_size or self.scheduler_config.max_num_seqs)
        return min(self.scheduler_config.max_num_batched_tokens,
                   seqs * (c.num_speculative_tokens + 1))

    def _propose(self) -> None:
        """Sets the proposals of each decoding sequence for the next step: none while a
        request waits or a prompt is being computed (speculation steps aside under load, and
        steps that verify proposals only decode), or when more sequences decode than
        `disable_by_batch_size`."""
        running = self.scheduler.running
        self.proposer.release(running)  # sequences preempted or aborted since the last step
        for seq in running:
            seq.spec_token_ids = []
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1
                    and s.num_output_tokens > 0]
        limit = self.speculative_config.disable_by_batch_size
        if (not decoding or len(decoding) < len(running) or self.scheduler.waiting
                or (limit is not None and len(decoding) > limit)):
            return
        k = self.speculative_config.num_speculative_tokens
        ks = [num_proposals(seq, k, self.scheduler_config.max_model_len) for seq in decoding]
        for seq, proposal in zip(decoding, self.proposer.propose(decoding, ks)):
            seq.spec_token_ids = proposal

    def _eos_token_ids(self, model_dir: Path) -> set[int]:
        """The config's, the generation config's and the tokenizer's end-of-sequence ids.

        `generation_config.json` is read as JSON, as `GenerationConfig.from_pretrained` reads
        its `eos_token_id` (an id or a list), without importing transformers' generation
        module (and torch with it).

        Raises:
          ValueError: `generation_config.json` is not a JSON object (its path named).
        """
        ids = set(self.model_config.eos_token_ids)
        path = model_dir / "generation_config.json"
        if path.is_file():
            try:
                eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            except (ValueError, AttributeError) as e:
                raise ValueError(f"{path} is not a JSON object: {e}") from e
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- embeddings ---------------------------------------------------------------------------

    EMBED_BATCH = 16  # prompts per embedding forward

    def embed(self, token_ids: list[list[int]], pooling: str = "last",
              normalize: bool = True) -> np.ndarray:
        """Embeddings of prompts (`LLM.embed`, `/v1/embeddings`): the model's final hidden
        states pooled over each prompt (`models.pooled_hidden_states`), by the dense forward on
        the served parameters: no KV write, the pool untouched. Batches of `EMBED_BATCH`
        prompts, right-padded to a power of two of tokens and of rows, so few shapes compile.

        Returns:
          f32[len(token_ids), hidden_size].

        Raises:
          ValueError: an unknown `pooling`, or an empty prompt.
          RuntimeError: the weights were released by `sleep(level=2)`.
        """
        if pooling not in POOLING_TYPES:
            raise InvalidRequestError("pooling", f"pooling must be one of {POOLING_TYPES}, "
                                      f"got {pooling!r}")
        if any(len(ids) == 0 for ids in token_ids):
            raise InvalidRequestError("input", "an input to embed is empty")
        params = self.get_params()
        if self._pooled is None:
            self._pooled = jax.jit(functools.partial(pooled_hidden_states, self.runner.graphdef),
                                   static_argnames=("pooling", "normalize"))
        out = []
        for start in range(0, len(token_ids), self.EMBED_BATCH):
            rows = token_ids[start:start + self.EMBED_BATCH]
            B, T = next_power_of_2(len(rows)), next_power_of_2(max(map(len, rows)))
            ids, mask = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
            mask[len(rows):, 0] = 1  # padding rows: one token, dropped below
            for i, row in enumerate(rows):
                ids[i, :len(row)], mask[i, :len(row)] = row, 1
            pooled = self._pooled(params, ids, mask, pooling=pooling, normalize=normalize)
            out.append(np.asarray(pooled)[:len(rows)])
        return np.concatenate(out) if out else np.zeros((0, self.model_config.hidden_size),
                                                        np.float32)

    # -- weights and memory -------------------------------------------------------------------

    def get_params(self) -> nnx.State:
        """The parameter tree the engine serves (`LLM.get_params`).

        Raises:
          RuntimeError: the weights were released by `sleep(level=2)` and not restored.
        """
        if self.runner.params is None:
            raise RuntimeError("the weights were released by sleep(level=2): restore them with "
                               "update_params(...) or wake_up()")
        # A new tree of the same arrays: changing it in place changes nothing served.
        return jax.tree.map(lambda x: x, self.runner.params)

    def update_params(self, params) -> None:
        """Serves with `params` from the next step (`ModelRunner.replace_params`) and drops the
        prefix cache, whose K/V the old weights computed. Sequences already running keep the
        K/V they have."""
        self._check_alive()
        self.runner.replace_params(params)
        self.block_manager.reset_prefix_cache(force=True)

    def load_weights(self, weights) -> None:
        """Replaces the parameters that `(HF name, array)` pairs name
        (`models.loader.params_from_hf_weights`), the others kept, as `update_params` does.
        Single-process: stacked parameters are read back to the host to write a part.

        Raises:
          ValueError: the engine's weights are quantized (use `update_params` with quantized
            arrays), or see `params_from_hf_weights`.
        """
        if self.quantization is not None:
            raise ValueError(f"load_weights takes float checkpoint tensors, and this engine's "
                             f"weights are quantized ({self.quantization!r}): build the engine "
                             "without quantization, or pass quantized arrays to update_params")
        current = flat_params(self.get_params())
        changed = params_from_hf_weights(self.model_cls, self.model_config, current, weights,
                                         self.dtype)
        self.update_params({**current, **changed})

    def sleep(self, level: int = 1) -> None:
        """Releases the KV pool (level 1) and the weights too (level 2); see `LLM.sleep`.

        Raises:
          ValueError: a level other than 1 or 2.
          RuntimeError: requests are still running.
        """
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.has_unfinished_requests():
            raise RuntimeError("sleep needs an idle engine: requests are still running")
        self.block_manager.reset_prefix_cache()
        self.runner.release(kv_cache=True, params=level == 2)
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        """Restores what `sleep` released: a new (empty) KV pool, and the weights read again from
        the model folder unless `update_params` gave new ones meanwhile."""
        if self.runner.params is None:
            model = self._load_model(self.model_dir, self.runner.backend)
            self.runner.replace_params(nnx.split(model)[1])
        self.runner.restore_kv_cache()
        self.sleep_level = 0

    def _check_awake(self) -> None:
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (sleep level {self.sleep_level}): call "
                               "wake_up() before generating")

    # -- requests ---------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """`InputProcessor.tokenize_prompt`."""
        return self.input_processor.tokenize_prompt(prompt)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """`InputProcessor.chat_prompt`."""
        return self.input_processor.chat_prompt(messages, add_generation_prompt,
                                                continue_final_message, tools, template_kwargs)

    def add_request(self, prompt: str | dict, params: SamplingParams,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queues a prompt; returns its request id. Validates before queueing anything.
        `priority`: under `scheduling_policy="priority"`, lower runs first (ties by arrival).

        Raises:
          InvalidRequestError (a ValueError), naming the field: a bad prompt (see
          `tokenize_prompt`); token ids past the vocabulary; more completions (`best_of` or `n`)
          than `max_num_seqs` runs at once; `prompt_logprobs` over a prompt longer than
          `max_num_batched_tokens` (it is computed in one step); a request id in use; an
          invalid `structured_outputs` schema, regex or grammar; a `priority` that is not an
          int, or not 0 under the "fcfs" policy.
        """
        self._check_alive()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("priority", f"priority must be an int, got {priority!r}")
        if priority != 0 and self.scheduler_config.scheduling_policy != "priority":
            raise InvalidRequestError("priority", f"priority {priority} needs "
                                      "scheduling_policy='priority' (this engine is 'fcfs')")
        self._check_awake()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {params!r:.80}")
        params.check_vocab(self.model_config.vocab_size)
        self.check_seats(params)
        text, ids = self.tokenize_prompt(prompt)
        budget = self.scheduler_config.max_num_batched_tokens
        if params.prompt_logprobs is not None and len(ids) > budget:
            raise InvalidRequestError(
                "prompt_logprobs", f"prompt_logprobs needs the whole prompt in one step: the "
                f"prompt has {len(ids)} tokens, max_num_batched_tokens={budget}")
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**63))
        # One sequence is prefilled; it forks into the n completions right after (block sharing).
        seq = Sequence(request_id, 0, ids, params, seed)
        seq.priority, seq.arrival = priority, next(self._arrivals)
        if params.structured_outputs is not None:
            seq.matcher = self.grammar_compiler.matcher(params.structured_outputs)
            if self.think_token_ids is not None:
                seq.matcher = ReasoningGate.for_prompt(
                    seq.matcher, ids, self.think_token_ids,
                    starts_inside=self.reasoning_parser == "deepseek_r1")
        seq.num_forks = (params.best_of or params.n) - 1
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self.requests[request_id] = Request(request_id, text, ids, [seq], [detok],
                                            [new_stop_state(params)], params,
                                            RequestMetrics(arrival_time=time.time()))
        self.scheduler.add(seq)
        return request_id

    def scoring_prompt(self, prompt_token_ids, completion_token_ids) -> tuple[list[int], int]:
        """(token ids, index of the first scored one) of a completion to score after a prompt
        (`LLM.completion_logprobs`), validated.

        Raises:
          InvalidRequestError (a ValueError): an empty prompt, token ids outside the
            vocabulary, or prompt and completion together not under `max_model_len`.
        """
        vocab = self.model_config.vocab_size
        rows = {}
        for field, ids in (("prompt_token_ids", prompt_token_ids),
                           ("completion_token_ids", completion_token_ids)):
            if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__len__"):
                raise InvalidRequestError(field, f"{field} must be a list of token ids, got "
                                          f"{type(ids).__name__}: {ids!r:.80}")
            ids = rows[field] = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(field, f"{field} {bad[:8]} are not ids in [0, {vocab})")
        prompt_token_ids, completion_token_ids = rows.values()
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError("prompt_token_ids", "prompt_token_ids is empty: the first "
                                      "completion token needs a token before it")
        start = len(prompt_token_ids)
        ids = list(prompt_token_ids) + list(completion_token_ids)
        limit = self.scheduler_config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                "completion_token_ids", f"{start} prompt and {len(ids) - start} completion "
                f"tokens: together they must be fewer than max_model_len={limit}")
        return [int(t) for t in ids], start

    def add_scoring_request(self, ids: list[int], start: int, params: SamplingParams
                            ) -> Sequence:
        """Queues the scoring of `ids[start:]` given the tokens before each (`scoring_prompt`)
        under `params`' temperature, top-k and top-p; returns its sequence, whose
        `scoring.logprobs` are complete once its request has finished. It runs as a prompt
        (chunked and prefix-cached as any other, never from the cache past `start` - 1), then
        draws one token, which is dropped."""
        score = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                               output_kind=RequestOutputKind.FINAL_ONLY)
        request_id = self.add_request({"prompt_token_ids": ids}, score)
        seq = self.requests[request_id].seqs[0]  # not scheduled before the next step
        # A greedy sample's processed distribution is untruncated (the sampler's greedy rows
        # take the argmax, with no top-k / top-p), and so is a greedy scoring's.
        greedy = params.temperature == 0
        seq.scoring = Scoring(start, params.temperature, 0 if greedy else params.top_k,
                              1.0 if greedy else params.top_p,
                              np.full((len(ids) - start,), np.nan, np.float32))
        return seq

    @functools.cached_property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles and caches `structured_outputs` constraints for this model's tokenizer
        (thread-safe: the server compiles on its preprocessing threads)."""
        return GrammarCompiler(self.tokenizer, self.model_config.vocab_size)

    def _check_alive(self) -> None:
        """Raises `EngineDeadError` once a fatal fault has stopped the engine."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead)) from self.dead

    def check_seats(self, params: SamplingParams) -> None:
        """Raises `InvalidRequestError` if the request's completions cannot all run at once.

        A prompt forks into its `best_of` (or `n`) completions right after its prefill, and the
        scheduler admits it only once `max_num_seqs` has a seat for each: a request with more
        would wait at the head of the queue forever, and every request behind it too. (Its
        tokens always fit the KV pool: each sequence stops at `max_model_len`, and the pool holds
        at least that much, checked when the engine is built; forks that run out of blocks are
        preempted and recomputed.)
        """
        seats, limit = params.best_of or params.n, self.scheduler_config.max_num_seqs
        if seats > limit:
            field = "best_of" if params.best_of is not None else "n"
            raise InvalidRequestError(field, f"{field}={seats} completions cannot run at once: "
                                      f"this engine runs at most max_num_seqs={limit} sequences")

    def abort_request(self, request_id: str) -> None:
        """Drops a request and frees its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else []:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs of the requests it advanced, each
        as its `SamplingParams.output_kind` says (a FINAL_ONLY request only when it finishes).

        Finished requests are returned once with `finished=True` and then forgotten. A request
        that a fault in the step is traced to (see `FaultIsolatingExecutor`) is returned
        finished, with `error` set and its completions' finish_reason "error"; the others go on.

        Raises:
          EngineDeadError: a fatal fault (see `jaxpaged.errors`); the engine is unusable.
        """
        self._check_alive()
        if self.proposer is not None:
            try:
                self._propose()
            except Exception:  # a failed proposal costs its speedup, not the requests
                logger.exception("speculative proposals failed; this step decodes without")
                for seq in self.scheduler.running:
                    seq.spec_token_ids = []
        try:
            out = self.scheduler.schedule()
        except Exception as e:  # its state can no longer be trusted
            self.dead = EngineDeadError(f"the scheduler failed: {describe(e)}")
            raise self.dead from e
        if out is None or not out.seqs:
            return []
        now = time.time()
        for seq in out.seqs:
            m = self.requests[seq.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        try:
            sampled, prompt_lps, failed = self.executor.execute(out)
        except EngineDeadError as e:
            self.dead = e
            raise
        now = time.time()
        update = self.scheduler.update_from_output(out, sampled, set(failed))
        self.num_prompt_tokens += update.num_prompt_tokens
        for row, lps in prompt_lps.items():
            request = self.requests[out.seqs[row].request_id]
            if request.request_id not in failed and request.prompt_logprobs is None:
                request.prompt_logprobs = self._prompt_logprob_dicts(request, lps)
        touched = {}
        for row, appended in update.appended:
            request = self.requests[out.seqs[row].request_id]
            try:
                self._advance(request, appended, now)
                touched[request.request_id] = request
            except Exception as e:  # in detokenizing or stop checks: this request's own fault
                logger.exception("request %s failed after its step", request.request_id)
                failed[request.request_id] = describe(e)
        for request_id, reason in failed.items():
            touched[request_id] = self._fail(self.requests[request_id], reason)
            self.num_failed_requests += 1
        if self.proposer is not None:  # the draft's state of sequences that finished goes
            self.proposer.release(self.scheduler.running)
        outputs = []
        for request_id, request in touched.items():
            if request.finished:
                request.metrics.finished_time = time.time()
            output = request.output()
            if output is not None:
                outputs.append(output)
            if request.finished:
                del self.requests[request_id]
        return outputs

    def _advance(self, request: Request, appended: list, now: float) -> None:
        """The host side of a row's new tokens, which the scheduler has appended (and finished
        where a token id or a length ends them): registers the completions the row forked
        into, then for each token its log-probabilities, its text and the stop strings. A row
        that verified speculative tokens appends several tokens to one sequence; those after a
        stop string are taken back."""
        request.metrics.first_token_time = request.metrics.first_token_time or now
        first = appended[0][0]
        for seq, _ in appended[1:]:  # completions forked from the first (n > 1)
            if seq is not first:
                request.seqs.append(seq)
                request.detokenizers.append(IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, seq.params.skip_special_tokens))
                request.stop_states.append(new_stop_state(seq.params))
        for i, (seq, token) in enumerate(appended):
            self._add_text(seq, token, request.detokenizers[seq.index],
                           request.stop_states[seq.index])
            self.num_generation_tokens += 1
            if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
                later = [t for s, t in appended[i + 1:] if s is seq]
                if later:  # a stop string ended it before its last speculative token
                    del seq.token_ids[-len(later):]
                    seq.cumulative_logprob -= sum(t.logprob for t in later)
                    break
        request.metrics.num_generation_tokens = max(request.metrics.num_generation_tokens,
                                                    first.num_output_tokens)
        if first.spec_num_drafts:
            m = request.metrics
            m.spec_num_drafts = sum(s.spec_num_drafts for s in request.seqs)
            m.spec_num_draft_tokens = sum(s.spec_num_draft_tokens for s in request.seqs)
            m.spec_num_accepted_tokens = sum(s.spec_num_accepted_tokens for s in request.seqs)

    # -- faults -----------------------------------------------------------------------------

    def _fail(self, request: Request, reason: str) -> Request:
        """Ends every sequence of `request` with finish reason "error" and frees its blocks."""
        request.error = reason
        for seq in request.seqs:
            seq.num_forks = 0
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        return request

    def _prompt_logprob_dicts(self, request: Request, rows: list) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {id: Logprob} per token."""
        return [None] + [self._logprob_entry(token_id, lp, rank, top) for token_id, (lp, rank, top)
                         in zip(request.prompt_token_ids[1:], rows)]

    def _logprob_entry(self, token_id: int, logprob: float, rank: int,
                       top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """{id: Logprob} for the top-k tokens (ranks 1..k) and the chosen token."""
        entry = {t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(top)}
        entry[token_id] = Logprob(logprob, rank)
        for t, lp in entry.items():
            lp.decoded_token = self._token_text(t)
        return entry

    def _token_text(self, token_id: int) -> str:
        """One token's text, decoded once per engine (top log-probabilities name many)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _add_text(self, seq: Sequence, sampled, detok: IncrementalDetokenizer,
                  stop_state: StopStringState | None) -> None:
        """A new token's log-probabilities and text; finishes `seq` at a stop string (which
        takes precedence over an EOS, stop token or length that ends it at the same token)."""
        token_id, p = sampled.token_id, seq.params
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(token_id, sampled.logprob, sampled.rank,
                                                    sampled.top))
        delta = detok.add_token(token_id)
        found = None if stop_state is None else stop_state.feed(delta, len(detok.text))
        if not found or seq.num_output_tokens < p.min_tokens:
            return
        stop = self._cut_at_stop_string(detok, found, p)
        if seq.is_finished:
            seq.finish_reason, seq.stop_reason = "stop", stop
        else:
            self.scheduler.finish(seq, "stop", stop_reason=stop)

    @staticmethod
    def _cut_at_stop_string(detok: IncrementalDetokenizer, found: tuple[int, int],
                            p: SamplingParams) -> str:
        """Truncates the text at the stop string `found` = (start, length) that the newest
        characters complete (keeping it if `include_stop_str_in_output`); returns it."""
        start, length = found
        stop = detok.text[start:start + length]
        detok.text = detok.text[:start + (length if p.include_stop_str_in_output else 0)]
        return stop

    def stats(self) -> dict[str, int]:
        """Block and queue counts: num_total_blocks, num_free_blocks, num_used_blocks,
        num_shared_blocks, num_cow_copies, num_running, num_waiting (sequences),
        num_running_requests, num_waiting_requests (requests with a running sequence / with
        all sequences waiting), and the running totals num_preemptions, num_prompt_tokens,
        num_generation_tokens, num_failed_requests (failed by a fault in a step), num_prefix_cache_queries / num_prefix_cache_hits (full prompt
        blocks looked up in / found in the prefix cache); num_compilations (shapes the model step
        is compiled for); weight_bytes (the parameters' bytes, whole arrays) and
        kv_cache_bytes_per_token (pool bytes per token, all layers); with speculative decoding,
        num_spec_drafts, num_spec_draft_tokens, num_spec_accepted_tokens (steps a sequence
        verified proposals in, tokens proposed, tokens accepted) and spec_acceptance_rate."""
        bm, scheduler = self.block_manager, self.scheduler
        running_requests = {s.request_id for s in scheduler.running}
        waiting_requests = {s.request_id for s in scheduler.waiting} - running_requests
        return {
            "num_total_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
            "num_shared_blocks": bm.num_shared_blocks,
            "num_cow_copies": bm.num_cow_copies,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_running_requests": len(running_requests),
            "num_waiting_requests": len(waiting_requests),
            "num_preemptions": scheduler.num_preemptions,
            "num_prefix_cache_queries": bm.num_cache_queries,
            "num_prefix_cache_hits": bm.num_cache_hits,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_failed_requests": self.num_failed_requests,
            "num_compilations": self.runner.num_compilations,
            "weight_bytes": (0 if self.runner.params is None
                             else weight_bytes(self.runner.params)),
            "kv_cache_bytes_per_token": kv_cache_bytes_per_token(self.model_config,
                                                                 self.kv_cache_dtype),
            **({} if self.proposer is None else {
                "num_spec_drafts": scheduler.num_spec_drafts,
                "num_spec_draft_tokens": scheduler.num_spec_draft_tokens,
                "num_spec_accepted_tokens": scheduler.num_spec_accepted_tokens,
                "spec_acceptance_rate": (scheduler.num_spec_accepted_tokens
                                         / max(1, scheduler.num_spec_draft_tokens)),
            }),
        }
