"""The model runner: owns params and the KV pool, turns a scheduled step into device arrays.

Every step goes packed (vLLM v1's flattened batch): its decodes and prompt chunks lie on one
token axis of T tokens, T padded to a bucket (steps of 1.5x; see `buckets.bucket`), and the
attention backend (`pallas_kernels.backends`) adds how it reads the cached blocks. A step's
shapes depend on T (and, for the Pallas backends, whether it only decodes) alone, so the
shapes under given limits are few and `precompile` compiles them all. One jitted step
`(params, kv_cache, ModelInput) -> (logits, greedy draws, routes, kv_cache)` runs with the
pool donated, then the jitted sampler unless every draw is a plain greedy one, which the step
made itself; only the sampled token ids (and an MoE model's expert ids, `routed_experts`)
come back to the host. A scheduled multi-step decode (`SchedulerOutput.num_steps` k > 1) runs
k steps in one call instead (`multi_step`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from jaxpaged.sample import sampler
from jaxpaged.sample.rejection_sampler import rejection_sample
from jaxpaged.worker.compilation_cache import ExecutableCache
from jaxpaged.worker.buckets import bucket, buckets_upto, next_power_of_2, pow2s
from jaxpaged.worker.kv_cache import KVCache, KVCacheSpec
from jaxpaged.config import CacheConfig
from jaxpaged.models import ModelInput, forward
from jaxpaged.models.loader import flat_params
from jaxpaged.models.lora import LoRA
from jaxpaged.models.moe import recording_routes, stacked_routes
from jaxpaged.models.quantization import activation_modes
from jaxpaged.pallas_kernels import StepLimits, copy_blocks
from jaxpaged.sample.sampler import (SampledToken, SamplingMetadata, prompt_logprobs,
                                     sample_jit)
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.sequence import Sequence
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.worker.multi_step import jit_multi_step, multi_step_jobs, run_steps
from jaxpaged.worker.params import placed_params
from jaxpaged.worker.routed_experts import RoutedExperts
from jaxpaged.worker.prompt_logprobs import (collect_prompt_logprobs, score, scored_tokens,
                                             wants_prompt_logprobs)

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 8  # `precompile` also runs each shape of at most this many tokens once


class ModelRunner:
    def __init__(self, model: nnx.Module, cache_config: CacheConfig, num_blocks: int,
                 kv_cache_dtype: str, eos_token_ids: set[int] = frozenset(),
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 compilation_cache_dir=None, min_step_tokens: int = 1, min_seq_slots: int = 1):
        """`kv_cache_dtype` is the pool's dtype name (`kv_cache.POOL_DTYPES`); the pool
        (`self.kv_cache`, a `KVCache`) has `num_blocks` blocks of `cache_config.block_size`.
        A step has `bucket(max(max_num_seqs, min_seq_slots))` sequence slots at most (logits
        rows; batch invariance sets `min_seq_slots`)."""
        self.config = model.config
        # Steps of fewer tokens are padded up to this many (`step_tokens`; batch invariance).
        self.min_step_tokens = min_step_tokens
        # Plain greedy draws from the step (`_sample_rows`). Off in batch-invariant mode, where a
        # row's logprob would otherwise depend on whether its batch-mates are plain greedy.
        self.greedy_draws = True
        self.backend = model.backend  # `pallas_kernels.backends.AttentionBackend`
        self.block_size = cache_config.block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.limits = StepLimits(block_size=self.block_size, num_blocks=num_blocks,
                                 max_seq_slots=bucket(max(max_num_seqs, min_seq_slots)),
                                 max_blocks_per_seq=-(-self.max_model_len // self.block_size))
        # A model with adapter slots (`models.lora.enable_lora`): every step carries each
        # token's slot, so its shapes are the same whichever adapters run.
        self.uses_lora = any(isinstance(node, LoRA) for _, node in nnx.iter_graph(model))
        self.graphdef, params = nnx.split(model)
        # What `replace_params` checks a new parameter against: path -> (shape, dtype, sharding).
        self.param_treedef = treedef = jax.tree.structure(params)
        self.params = params
        self.param_specs = {path: (tuple(x.shape), x.dtype, x.sharding)
                            for path, x in flat_params(self.params).items()}
        self.mesh = self.backend.mesh  # tensor parallelism's, or None: one device
        self.kv_cache = KVCache(KVCacheSpec.for_model(self.config, kv_cache_dtype, num_blocks,
                                                      self.block_size, self.mesh))
        self.routes = RoutedExperts.for_model(model, num_blocks, self.block_size)
        # The step takes the parameters as their flat list of arrays (`param_leaves`): jax
        # flattens a list in C++, an `nnx.State` of Variables in Python (a millisecond a step).
        graphdef = self.graphdef
        self.replicated = None if self.mesh is None else NamedSharding(self.mesh, P())

        def model_step(leaves, kv_cache, batch, all_positions):
            with recording_routes() as routes:
                logits, kv_cache = forward(graphdef, jax.tree.unflatten(treedef, leaves),
                                           kv_cache, batch, all_positions)
            # Each row's greedy draw: plain greedy decoding then needs no sampler call.
            return (logits, None if all_positions else sampler.greedy_draw(logits),
                    stacked_routes(routes), kv_cache)

        self.num_scheduler_steps = 1  # decode steps a call (`multi_step`; the scheduler's)
        self._multi_step = jit_multi_step(self)
        if self.mesh is None:
            self._step = jax.jit(model_step, donate_argnums=1, static_argnums=3)
            self._copy_blocks = jax.jit(copy_blocks, donate_argnums=0)
        else:
            # Explicit shardings: params as the loader laid them out, the pool by KV head, the
            # step's metadata in and the logits out replicated (the sampler runs on every
            # device, so each process has the sampled tokens).
            pool = self.kv_cache.spec.sharding
            params = [x.sharding for x in self.param_leaves]
            self._step = jax.jit(model_step, donate_argnums=1, static_argnums=3,
                                 in_shardings=(params, pool, self.replicated),
                                 out_shardings=(*[self.replicated] * 3, pool))
            self._copy_blocks = jax.jit(copy_blocks, donate_argnums=0, out_shardings=pool)
        # The step's and the sampler's executables by their inputs' shapes: compiled or loaded,
        # or None for one that `precompile` found in the compilation cache's folder and left
        # there until it first runs.
        self._compiled: dict[tuple, jax.stages.Compiled | None] = {}
        self.executables = ExecutableCache(compilation_cache_dir, (
            repr(self.config), self.kv_cache.spec.dtype,
            self.backend.name, repr(self.limits),
            repr(sorted((path, spec[:2]) for path, spec in self.param_specs.items())),
            f"invariant={getattr(self.backend, 'invariant', False)}",
            repr(model.config.kernels),  # `pallas_kernels.plan.KernelPlan`
            f"activations={activation_modes(model)}",
            repr(None if self.mesh is None else self.mesh.devices.tolist())),
            None if self.mesh is None else list(self.mesh.devices.flat))
        # Test-only: called with each `SchedulerOutput` at the start of `execute`; a hook that
        # raises stands for a fault in the step (tests of the engine's fault isolation).
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        self.input_batch = InputBatch(
            max(max_num_seqs, self.limits.max_seq_slots), self.limits.max_blocks_per_seq,
            self.config.vocab_size, eos_token_ids, self.replicated)

    # -- weights and memory (the research API: `LLM.update_params`, `LLM.sleep`) -------------

    @property
    def params(self) -> nnx.State | None:
        """The served parameters (`nnx.split(model)`'s state); None once released."""
        return self._params

    @params.setter
    def params(self, params: nnx.State | None) -> None:
        self._params = params
        # What the step is called with (its key in `_compiled` leaves them out: fixed shapes).
        self.param_leaves = None if params is None else jax.tree.leaves(params)

    def replace_params(self, params) -> None:
        """Serves with `params` from the next step: the same executables (no compilation), each
        array placed with the sharding of the one it replaces.

        Args:
          params: an `nnx.State` or a nested dict (`nnx.to_pure_dict`) of the engine's
            parameter tree, leaves `jax.Array` (on any device, sharded or not) or NumPy arrays
            of each parameter's shape and dtype.

        Raises:
          ValueError: a parameter missing or extra, or of another shape or dtype (its path
            named); nothing is replaced then.
        """
        self.params = jax.tree.unflatten(self.param_treedef,
                                         placed_params(params, self.param_specs))

    def release(self, kv_cache: bool = True, params: bool = False) -> None:
        """Lets go of the KV pool (its contents are lost; `KVCache.release`) and, with
        `params`, of the engine's references to the parameters (freed unless the caller holds
        them too)."""
        if kv_cache:
            self.kv_cache.release()
        if params:
            self.params = None

    def restore_kv_cache(self) -> None:
        """A new KV pool of zeros in place of one `release` let go of (`KVCache.restore`)."""
        self.kv_cache.restore()

    @property
    def num_compilations(self) -> int:
        """Shapes the model step has an executable for (compiled, loaded from the compilation
        cache, or found there to load when first run): by `precompile`, and for each other
        shape it has run."""
        return sum(key[0] is self._step for key in self._compiled)

    def _key(self, jitted, args: tuple, static_args: tuple, static_kwargs: dict) -> tuple:
        # The parameters' shapes never change (`replace_params` checks them): left out.
        if args and args[0] is self.param_leaves:
            args = args[1:]
        leaves, treedef = jax.tree.flatten(args)
        return (jitted, treedef, tuple(np.shape(x) for x in leaves), static_args,
                tuple(sorted(static_kwargs.items())))

    def _executable(self, jitted, args: tuple, *static_args, **static_kwargs
                    ) -> jax.stages.Compiled:
        """The executable of `jitted(*args, *static_args, **static_kwargs)` for these shapes:
        this runner's, else from the compilation cache (memory, then disk), else compiled."""
        key = self._key(jitted, args, static_args, static_kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            # XLA:CPU loads no executable while another one runs: wait for the last step.
            self.kv_cache.block_until_ready()
            compiled = self.executables.get_or_compile(jitted, args, static_args, static_kwargs)
            self._compiled[key] = compiled
        return compiled

    def _prepare_executable(self, jitted, args: tuple, static_args: tuple,
                            static_kwargs: dict) -> None:
        """Compiles (and stores) the executable of these shapes unless the compilation cache's
        folder has it; one found there is loaded by `_executable` when it first runs."""
        key = self._key(jitted, args, static_args, static_kwargs)
        if key not in self._compiled:
            self._compiled[key] = self.executables.get_or_compile(
                jitted, args, static_args, static_kwargs, load=False)

    def _run_step(self, batch: ModelInput, all_positions: bool = False
                  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, jax.Array | None]:
        """Runs the model step on `batch` and keeps the updated pool; returns the logits,
        unless `all_positions` each logits row's greedy draw (`sampler.greedy_draw`), and an
        MoE model's i16[L_moe, T, k] expert ids (`models.moe.stacked_routes`)."""
        args = (self.param_leaves, self.kv_cache.pool, batch)
        *out, self.kv_cache.pool = self._executable(self._step, args, all_positions)(*args)
        return tuple(out)

    def compute_logits(self, seqs: list[Sequence], num_new_tokens: list[int]) -> jax.Array:
        """Computes the next `num_new_tokens[i]` tokens of each of `seqs` (after their
        `num_computed_tokens`, in blocks the caller appended) and writes their K/V to the pool;
        samples nothing. For a proposer's own model (`spec_decode.draft_model`).

        Returns:
          f32[R, V] on the device: the logits of each sequence's last new token, in the order
          of `seqs` (R >= len(seqs): padding rows after them).
        """
        return self._run_step(self.prepare(seqs, num_new_tokens))[0]

    def step_tokens(self, num_tokens: int) -> int:
        """The padded token count T of a step of `num_tokens` tokens: their `bucket`, at least
        `min_step_tokens`."""
        return max(bucket(num_tokens), self.min_step_tokens)

    def step_shapes(self, max_num_batched_tokens: int) -> list[tuple[int, bool]]:
        """Every (T, decode_only) a step can take under these limits: each token bucket up to
        the budget (or what `max_num_seqs` sequences of `max_model_len` hold), with each
        variant the backend compiles for it (`AttentionBackend.variants`)."""
        Ts = sorted({self.step_tokens(T) for T in buckets_upto(
            min(max_num_batched_tokens, self.max_num_seqs * self.max_model_len))})
        return [(T, v) for T in Ts for v in self.backend.variants(T, self.limits)]

    def precompile(self, shapes: list[tuple[int, bool]], progress: bool = True,
                   sampler_variants: bool = True, spec_tokens: int = 0) -> None:
        """Compiles the model step ahead of time for each (T, decode_only) of `step_shapes`,
        multi-step decoding's (`multi_step_jobs`) and (with `sampler_variants`) the sampler's
        default variants (`sampler.precompile`), so that serving compiles nothing new. With
        `spec_tokens`, each shape of 2 to that many tokens also gets the variant with logits
        at every token (`logits_indices`: verifying steps), and the sampler's cover as many
        draws. A shape of at most `WARM_UP_TOKENS` tokens is also run once on its padding-only
        input (writing nothing): an executable's first run on CPU is slower than later ones,
        which would otherwise land on a request; larger shapes' steps dwarf that."""
        cache = self.executables
        before = cache.num_compiled, cache.num_on_disk
        batches = [(T, self._padding_batch(T, decode_only)) for T, decode_only in shapes]
        batches += [(T, dataclasses.replace(b, logits_indices=np.zeros((T,), np.int32)))
                    for T, b in batches if 2 <= T <= spec_tokens]
        # `prepare_sampling` pads the sample count to a power of two.
        counts = pow2s(1, next_power_of_2(max(self.max_num_seqs, spec_tokens)))
        draws = (sampler.precompile_inputs(self.config.vocab_size, counts, self.replicated)
                 if sampler_variants else [])
        jobs = ([(self._step, (self.param_leaves, self.kv_cache.pool, b), (False,), {})
                 for _, b in batches] + multi_step_jobs(self, {T for T, _ in shapes})
                + [(sample_jit, (logits, md), (), dict(all_greedy=g, num_logprobs=0))
                   for logits, md, g in draws])
        bar = tqdm(total=len(jobs), desc="Compiling (or finding in the cache)",
                   disable=not progress)
        # Two threads: XLA compiles outside the GIL. An executable the cache's folder holds is
        # not read here but when it first runs (0.1-0.2 s each on CPU, seconds for them all).
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for _ in pool.map(lambda job: self._prepare_executable(*job), jobs):
                bar.update()
                bar.set_postfix(compiled=cache.num_compiled - before[0],
                                cached=cache.num_on_disk - before[1])
        bar.close()
        for T, batch in batches:
            if T <= WARM_UP_TOKENS:
                self._run_step(batch)
        self.kv_cache.block_until_ready()
        logger.info("compiled %d executables, found %d in the compilation cache%s (loaded "
                    "when first run; %d step shapes, %d sampler variants)",
                    cache.num_compiled - before[0], cache.num_on_disk - before[1],
                    "" if cache.folder is None else f" {cache.folder.parent}",
                    len(shapes), len(draws))

    def _padding_batch(self, T: int, decode_only: bool = False) -> ModelInput:
        """A padding-only step of T tokens (see `step_shapes`): it writes nothing."""
        zeros = np.zeros((T,), np.int32)
        return ModelInput(zeros, zeros, self.backend.build(self.limits, T, [], decode_only),
                          rope_seq_lens=zeros if self.config.rope_switch_length else None,
                          lora_slots=zeros if self.uses_lora else None)

    def probe(self) -> None:
        """Runs the smallest padding-only step (with its greedy draws), writing nothing to the
        pool: whether the device and the compiled step work with no request in them. Raises
        whatever they raise (`FaultIsolatingExecutor` calls it after a step in which every
        request failed alone)."""
        if self.fault_hook is not None:
            self.fault_hook(SchedulerOutput([], [], []))
        jax.block_until_ready(self._run_step(self._padding_batch(1)))

    def execute(self, out: SchedulerOutput) -> tuple[list[list[SampledToken]], dict]:
        """Runs one scheduled step: all its sequences packed in one model call (`prepare`),
        then one sampler call over all.

        Returns:
          (each row's sampled tokens, {row: prompt logprobs} for rows whose request asked for
          them and whose prompt this step computed). A row that completes its tokens draws
          `1 + seq.num_forks` samples (a parent about to fork into its n completions after its
          prefill); a prompt chunk with more to come draws none. Prompt logprobs are a list over
          prompt tokens 1.. of (token logprob, rank, [(id, logprob)] top-k); they come from the
          same packed step, with logits at every token.
        """
        if self.fault_hook is not None:
            self.fault_hook(out)
        self.input_batch.remove(out.finished_seq_ids)
        self.input_batch.remove(seq.seq_id for seq in out.preempted)
        if out.blocks_to_copy:
            self.apply_copies(out.blocks_to_copy)
        if out.num_steps > 1 and (sampled := run_steps(self, out)) is not None:
            return sampled, {}
        spec = [out.spec_tokens(row) for row in range(len(out.seqs))]
        # Where each row's logits start among the rows the step returns: one per row, or for a
        # row verifying k proposals, k + 1 (its last token's and each proposal's).
        first_logit = np.cumsum([0] + [1 + len(s) for s in spec])
        logits_indices = None
        if any(spec):  # padded to the step's T: one executable per step size
            ends = np.cumsum(out.num_scheduled_tokens)
            logits_indices = np.zeros((self.step_tokens(int(ends[-1])),), np.int32)
            for row, (end, s) in enumerate(zip(ends, spec)):
                logits_indices[first_logit[row]:first_logit[row + 1]] = \
                    np.arange(end - 1 - len(s), end)
        batch = self.prepare(out.seqs, out.num_scheduled_tokens, spec)
        want = [row for row, seq in enumerate(out.seqs) if wants_prompt_logprobs(seq)]
        scored = scored_tokens(out, batch.attention.query_start_loc)
        prompt_lps = {}
        if want or scored:
            logits, greedy, routes = self._run_step(batch, all_positions=True)
            md = batch.attention
            last = (logits_indices if logits_indices is not None else
                    np.minimum(md.query_start_loc[:-1] + np.maximum(md.query_lens - 1, 0),
                               len(batch.input_ids) - 1))
            if scored:
                score(logits, scored, self.config.vocab_size)
            if want:
                k = max(out.seqs[row].params.prompt_logprobs for row in want)
                logits, *plp = prompt_logprobs(logits, batch.input_ids, last,
                                               num_logprobs=next_power_of_2(k) if k else 0)
                prompt_lps = collect_prompt_logprobs(out, md.query_start_loc, want,
                                                           jax.device_get(plp))
            else:
                logits = sampler.gather_rows(logits, last)
        else:
            logits, greedy, routes = self._run_step(dataclasses.replace(
                batch, logits_indices=logits_indices))
        sampled = self._sample_rows(out, logits, greedy, spec, first_logit)
        if self.routes is not None:  # read after the sampler's call, which waits for the step
            self.routes.record_step(out.seqs, out.num_scheduled_tokens, batch, routes)
        return sampled, prompt_lps

    def _sample_rows(self, out: SchedulerOutput, logits: jax.Array, greedy: tuple | None,
                     spec: list[list[int]], first_logit: np.ndarray
                     ) -> list[list[SampledToken]]:
        """Each row's sampled tokens from the step's logits (rows from `first_logit[row]`):
        `1 + seq.num_forks` draws for a row that completes its tokens, and for a row verifying
        proposals its draws up to the first that differs from them (`rejection_sample`)."""
        per_row = [[] for _ in out.seqs]
        first = first_logit.tolist()
        # (logits row, seq, completion j, proposals before this draw) of each draw, and its row.
        samples, row_of = [], []
        for row, (seq, q, proposals) in enumerate(zip(out.seqs, out.num_scheduled_tokens,
                                                       spec)):
            if seq.num_computed_tokens + q - len(proposals) != len(seq.token_ids):
                continue  # a prompt chunk with more to come samples nothing (`completes`)
            if not proposals and not seq.num_forks:  # one draw: most rows
                samples.append((first[row], seq, 0, ()))
                row_of.append(row)
                continue
            for j in range(1 + seq.num_forks):
                for i in range(1 + len(proposals)):
                    samples.append((first[row] + i, seq, j, proposals[:i]))
                    row_of.append(row)
        if not samples:
            return per_row
        # Plain greedy draws are the step's own (`greedy_draws`).
        plain = self.greedy_draws and self.input_batch.plain_greedy(samples)
        res = (sampler.pick_greedy(jax.device_get(greedy), [s[0] for s in samples])
               if greedy is not None and plain
               else jax.device_get(self.draw_on_device(samples, logits)))
        # Of a row verifying proposals, its draws up to the first that differs from them.
        output = (rejection_sample(res.token_ids[:len(samples)], np.asarray(row_of),
                                   [len(before) for _, _, _, before in samples], spec).tolist()
                  if any(spec) else None)
        token_ids, logprobs, ranks = (x.tolist() for x in (res.token_ids, res.logprobs,
                                                           res.ranks))
        for i, ((_, seq, _, _), row) in enumerate(zip(samples, row_of)):
            if output is not None and not output[i]:
                continue
            k = seq.params.logprobs
            top = (None if k is None else [] if k == 0 else
                   list(zip(res.top_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist())))
            per_row[row].append(SampledToken(token_ids[i], logprobs[i], ranks[i], top))
        return per_row

    def draw_on_device(self, samples: list[tuple[int, Sequence, int, list[int]]],
                       logits: jax.Array) -> sampler.SamplerOutput:
        """The jitted `sampler.sample`'s draws for `samples` (`prepare_sampling`), on device."""
        rows, md = self.prepare_sampling(samples)
        num_logprobs = max((s.params.logprobs or 0) for _, s, _, _ in samples)
        num_logprobs = num_logprobs and next_power_of_2(num_logprobs)
        # Draws from logits rows 0.. in order, as many rows as samples (a decode step): the
        # step's logits as they are (the padding samples draw from padding rows).
        if not (len(rows) == logits.shape[0]
                and (rows[:len(samples)] == np.arange(len(samples))).all()):
            logits = sampler.gather_rows(logits, rows)
        # Processed logprobs read the truncated distribution, which the greedy path skips.
        all_greedy = all(s.params.is_greedy and s.params.logprobs_mode == "raw"
                         for _, s, _, _ in samples)
        return self._executable(sample_jit, (logits, md), all_greedy=all_greedy,
                                num_logprobs=num_logprobs)(logits, md)

    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies, padded to a power of two with repeats of the first."""
        pairs = copies + [copies[0]] * (next_power_of_2(len(copies)) - len(copies))
        src, dst = (np.asarray(x, np.int32) for x in zip(*pairs))
        self.kv_cache.pool = self._copy_blocks(self.kv_cache.pool, src, dst)
        if self.routes is not None:
            self.routes.copy_blocks(src, dst)

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int],
                spec_token_ids: list[list[int]] | None = None) -> ModelInput:
        """The step's sequences packed on one token axis of T = `step_tokens` of their
        tokens, in the order given (sequence i's logits are row i); the backend's metadata for
        them, from the persistent `input_batch`'s block tables. A row's `spec_token_ids`
        (speculative proposals) follow its own tokens and are counted in its `num_new_tokens`.
        """
        rows = self.input_batch.sync(seqs, self.block_size)
        q = np.asarray(num_new_tokens, np.int32)
        total = int(q.sum())
        T = self.step_tokens(total)
        computed = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int32, len(seqs))
        input_ids, positions = np.zeros((T,), np.int32), np.zeros((T,), np.int32)
        rope_seq_lens = np.zeros((T,), np.int32) if self.config.rope_switch_length else None
        if total == len(seqs):  # one token each: the decodes' last tokens
            input_ids[:total] = [seq.token_ids[c] for seq, c in zip(seqs, computed.tolist())]
        else:
            start = 0
            for row, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
                first = seq.num_computed_tokens
                spec = spec_token_ids[row] if spec_token_ids else ()
                own = n - len(spec)
                input_ids[start:start + own] = seq.token_ids[first:first + own]
                input_ids[start + own:start + n] = spec
                start += n
        starts = np.cumsum(q) - q
        token_row = np.repeat(np.arange(len(seqs)), q)
        positions[:total] = computed[token_row] + np.arange(total) - starts[token_row]
        if rope_seq_lens is not None:
            rope_seq_lens[:total] = np.repeat(
                np.fromiter((seq.num_tokens for seq in seqs), np.int32, len(seqs)), q)
        md = self.backend.build_from_arrays(self.limits, T, self.input_batch.block_tables[rows],
                                            computed, q)
        lora_slots = None
        if self.uses_lora:
            lora_slots = np.zeros((T,), np.int32)
            lora_slots[:total] = np.repeat(
                np.fromiter((seq.lora_slot for seq in seqs), np.int32, len(seqs)), q)
        return ModelInput(input_ids, positions, md, rope_seq_lens, lora_slots=lora_slots)

    def prepare_sampling(self, samples: list[tuple[int, Sequence, int, list[int]]]
                         ) -> tuple[np.ndarray, SamplingMetadata]:
        """Per-sample arrays for `sampler.sample`, padded to a power of two R, and i32[R] the
        logits row each sample draws from, from the persistent `input_batch`'s per-row
        parameters (`InputBatch.sampling_metadata`). `samples` are (logits row, seq, j,
        proposals): sample j of a row drawing several uses seed `seq.seed + j` (mod 2**64), as
        a lone request seeded `seed + j` would (vLLM's convention). A draw verifying
        speculative tokens after `proposals` (taken as accepted) is output token
        `num_output_tokens + len(proposals)`, with that token's key (proposals go only to
        sequences whose draws depend on no earlier output: `spec_decode.num_proposals`)."""
        row_index = np.zeros((next_power_of_2(len(samples)),), np.int32)
        row_index[:len(samples)] = [row for row, _, _, _ in samples]
        return row_index, self.input_batch.sampling_metadata(samples)
