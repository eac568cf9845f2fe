"""The model runner: owns the parameters and the KV pool, and runs every kind of step through one
path: `launch(scheduler_output) -> LaunchedStep`, then `collect(launched) -> RunnerOutput`.

`launch` prepares the step's inputs from the persistent input batch (`StepInputs`), dispatches
its device program (`StepPrograms`: one model step, or for a scheduled k-step decode,
`SchedulerOutput.num_steps` k > 1, k model steps in one `lax.scan`) and makes its draws
(`StepSampler`: the step's own greedy draws or one sampler call), returning at once with the
draws still on the device. `collect` waits for them and assembles each row's samples
(`Draws.read`), its prompt logprobs and an MoE model's routes. The synchronous engine runs
`collect(launch(out))` (`execute`); async scheduling launches step i + 1 before collecting step
i, step i + 1's inputs that are still placeholders read step i's draws on the device.

A new kind of step input enters at `StepInputs.model_input`, the one function that builds a
`ModelInput`; every path above reads it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.config import CacheConfig
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.sequence import PLACEHOLDER, Sequence
from jaxpaged.models import ModelInput
from jaxpaged.models.loader import flat_params
from jaxpaged.models.lora import LoRA
from jaxpaged.models.quantization import activation_modes
from jaxpaged.pallas_kernels import StepLimits
from jaxpaged.sample import sampler
from jaxpaged.sample.sampler import SampledToken, prompt_logprobs
from jaxpaged.worker.buckets import bucket, buckets_upto, next_power_of_2, pow2s
from jaxpaged.worker.compilation_cache import ExecutableCache
from jaxpaged.worker.draws import Draws, StepSampler, plan_samples
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.worker.kv_cache import KVCache, KVCacheSpec
from jaxpaged.worker.params import placed_params
from jaxpaged.worker.programs import StepPrograms
from jaxpaged.worker.prompt_logprobs import (collect_prompt_logprobs, score, scored_tokens,
                                             wants_prompt_logprobs)
from jaxpaged.worker.routed_experts import RoutedExperts
from jaxpaged.worker.step_inputs import StepInputs, stack

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 8  # `precompile` also runs each shape of at most this many tokens once


class RunnerOutput(NamedTuple):
    """What a collected step returns to the engine."""

    # Each row's sampled tokens in order (none for a prompt chunk with more to come; k for a
    # k-step decode; a verifying row's accepted draws).
    sampled: list[list[SampledToken]]
    # {row: [(token logprob, rank, [(id, logprob)] top-k)] over prompt tokens 1..} for rows
    # whose request asked for prompt logprobs and whose prompt this step computed.
    prompt_logprobs: dict[int, list]


@dataclasses.dataclass
class LaunchedStep:
    """A step `launch` dispatched, its draws not yet read (`collect`)."""

    out: SchedulerOutput
    draws: Draws
    # An MoE model's routes on the device, and what recording them needs.
    routes: jax.Array | None = None
    starts: np.ndarray | None = None  # i32[S] each row's first position computed
    slot_mapping: np.ndarray | None = None  # i32[T] (i32[k, T] for a k-step decode)
    # Prompt logprobs on the device: (the rows wanting them, i32[S + 1] query starts, arrays).
    prompt_logprobs: tuple | None = None

    @property
    def forks(self) -> bool:
        """Whether some row forks into its n completions when this step is booked."""
        return self.draws.forks


@jax.jit
def _merge_ids(input_ids: jax.Array, source: jax.Array, tokens: jax.Array) -> jax.Array:
    """i32[T]: `input_ids`, but token i is `tokens[source[i]]` where `source[i] >= 0`."""
    return jnp.where(source >= 0, tokens[jnp.maximum(source, 0)], input_ids)


class ModelRunner:
    def __init__(self, model: nnx.Module, cache_config: CacheConfig, num_blocks: int,
                 kv_cache_dtype: str, eos_token_ids: set[int] = frozenset(),
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 compilation_cache_dir=None, min_seq_slots: int = 1,
                 num_scheduler_steps: int = 1, greedy_draws: bool = True):
        """`kv_cache_dtype` is the pool's dtype name (`kv_cache.POOL_DTYPES`); the pool
        (`self.kv_cache`, a `KVCache`) has `num_blocks` blocks of `cache_config.block_size`.
        A step has `bucket(max(max_num_seqs, min_seq_slots))` sequence slots at most (logits
        rows; batch invariance sets `min_seq_slots`). `num_scheduler_steps`: the steps of a
        k-step decode, as resolved for this engine (1: none; `precompile` compiles them);
        `greedy_draws`: plain greedy draws from the step itself (`StepSampler`)."""
        self.config = model.config
        self.backend = model.backend  # `pallas_kernels.backends.AttentionBackend`
        self.block_size = cache_config.block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.num_scheduler_steps = num_scheduler_steps
        self.limits = StepLimits(block_size=self.block_size, num_blocks=num_blocks,
                                 max_seq_slots=bucket(max(max_num_seqs, min_seq_slots)),
                                 max_blocks_per_seq=-(-self.max_model_len // self.block_size))
        self.graphdef, params = nnx.split(model)
        # What `replace_params` checks a new parameter against: path -> (shape, dtype, sharding).
        self.param_treedef = jax.tree.structure(params)
        self.params = params
        self.param_specs = {path: (tuple(x.shape), x.dtype, x.sharding)
                            for path, x in flat_params(self.params).items()}
        self.mesh = self.backend.mesh  # tensor parallelism's, or None: one device
        self.kv_cache = KVCache(KVCacheSpec.for_model(self.config, kv_cache_dtype, num_blocks,
                                                      self.block_size, self.mesh))
        self.routes = RoutedExperts.for_model(model, num_blocks, self.block_size)
        self.executables = ExecutableCache(compilation_cache_dir, (
            repr(self.config), self.kv_cache.spec.dtype,
            self.backend.name, repr(self.limits),
            repr(sorted((path, spec[:2]) for path, spec in self.param_specs.items())),
            f"invariant={getattr(self.backend, 'invariant', False)}",
            repr(model.config.kernels),  # `pallas_kernels.plan.KernelPlan`
            f"activations={activation_modes(model)}",
            repr(None if self.mesh is None else self.mesh.devices.tolist())),
            None if self.mesh is None else list(self.mesh.devices.flat))
        self.programs = StepPrograms(self.graphdef, self.param_treedef, self.param_leaves,
                                     self.kv_cache, self.mesh, self.executables)
        self.replicated = self.programs.replicated
        # Test-only: called with each `SchedulerOutput` at the start of `launch`; a hook that
        # raises stands for a fault in the step (tests of the engine's fault isolation).
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        self.input_batch = InputBatch(
            max(max_num_seqs, self.limits.max_seq_slots), self.limits.max_blocks_per_seq,
            self.config.vocab_size, eos_token_ids, self.replicated)
        # A model with adapter slots (`models.lora.enable_lora`): every token carries its slot.
        uses_lora = any(isinstance(node, LoRA) for _, node in nnx.iter_graph(model))
        self.inputs = StepInputs(self.backend, self.limits, self.input_batch,
                                 bool(self.config.rope_switch_length), uses_lora)
        self.sampler = StepSampler(self.input_batch, self.programs.run_sampler, greedy_draws)

    # -- weights and memory (the research API: `LLM.update_params`, `LLM.sleep`) -------------

    @property
    def params(self) -> nnx.State | None:
        """The served parameters (`nnx.split(model)`'s state); None once released."""
        return self._params

    @params.setter
    def params(self, params: nnx.State | None) -> None:
        self._params = params
        # What the programs are called with: jax flattens a list in C++, an `nnx.State` of
        # Variables in Python (a millisecond a step).
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

    # -- shapes and compilation ---------------------------------------------------------------

    @property
    def min_step_tokens(self) -> int:
        """Steps of fewer tokens are padded up to this many (batch invariance's floor)."""
        return self.inputs.min_step_tokens

    @min_step_tokens.setter
    def min_step_tokens(self, n: int) -> None:
        self.inputs.min_step_tokens = n

    @property
    def num_compilations(self) -> int:
        """Shapes the model step has an executable for (compiled, loaded from the compilation
        cache, or found there to load when first run): by `precompile`, and for each other
        shape it has run."""
        return self.programs.num_executables(self.programs.step)

    @property
    def num_multi_step_executables(self) -> int:
        """Shapes the k-step decode has an executable for (see `num_compilations`)."""
        return self.programs.num_executables(self.programs.multi_step)

    def step_tokens(self, num_tokens: int) -> int:
        """`StepInputs.step_tokens`: the padded token count T of a step."""
        return self.inputs.step_tokens(num_tokens)

    def step_shapes(self, max_num_batched_tokens: int) -> list[tuple[int, bool]]:
        """Every (T, decode_only) a step can take under these limits: each token bucket up to
        the budget (or what `max_num_seqs` sequences of `max_model_len` hold), with each
        variant the backend compiles for it (`AttentionBackend.variants`)."""
        Ts = sorted({self.step_tokens(T) for T in buckets_upto(
            min(max_num_batched_tokens, self.max_num_seqs * self.max_model_len))})
        return [(T, v) for T in Ts for v in self.backend.variants(T, self.limits)]

    def _precompile_jobs(self, shapes, spec_tokens: int, sampler_variants: bool):
        """(jobs for `StepPrograms.prepare`, the step batches, the sampler variants)."""
        batches = [(T, self.inputs.padding(T, decode_only)) for T, decode_only in shapes]
        batches += [(T, dataclasses.replace(b, logits_indices=np.zeros((T,), np.int32)))
                    for T, b in batches if 2 <= T <= spec_tokens]
        jobs = [(self.programs.step, (self.param_leaves, self.kv_cache.pool, b), (False,))
                for _, b in batches]
        k = self.num_scheduler_steps
        for T in sorted({T for T, _ in shapes}) if k > 1 else ():
            if T <= self.step_tokens(self.max_num_seqs):  # a k-step decode of T rows
                steps = stack([self.inputs.padding(
                    T, True in self.backend.variants(T, self.limits))] * k)
                jobs.append((self.programs.multi_step, (self.param_leaves, self.kv_cache.pool,
                                                        np.zeros((T,), np.int32), steps)))
        # The sampler pads its sample count to a power of two.
        counts = pow2s(1, next_power_of_2(max(self.max_num_seqs, spec_tokens)))
        draws = (sampler.precompile_inputs(self.config.vocab_size, counts, self.replicated)
                 if sampler_variants else [])
        jobs += [(self.programs.sample, (logits, md), (), dict(all_greedy=g, num_logprobs=0))
                 for logits, md, g in draws]
        return jobs, batches, draws

    def precompile(self, shapes: list[tuple[int, bool]], progress: bool = True,
                   sampler_variants: bool = True, spec_tokens: int = 0) -> None:
        """Compiles the model step ahead of time for each (T, decode_only) of `step_shapes`,
        the k-step decodes of those shapes that `max_num_seqs` rows take (when
        `num_scheduler_steps` > 1) and (with `sampler_variants`) the sampler's default variants
        (`sampler.precompile_inputs`), so that serving compiles nothing new. With
        `spec_tokens`, each shape of 2 to that many tokens also gets the variant with logits
        at every token (`logits_indices`: verifying steps), and the sampler's cover as many
        draws. A shape of at most `WARM_UP_TOKENS` tokens is also run once on its padding-only
        input (writing nothing): an executable's first run on CPU is slower than later ones,
        which would otherwise land on a request; larger shapes' steps dwarf that."""
        cache = self.executables
        before = cache.num_compiled, cache.num_on_disk
        jobs, batches, draws = self._precompile_jobs(shapes, spec_tokens, sampler_variants)
        bar = tqdm(total=len(jobs), desc="Compiling (or finding in the cache)",
                   disable=not progress)
        # Two threads: XLA compiles outside the GIL. An executable the cache's folder holds is
        # not read here but when it first runs (0.1-0.2 s each on CPU, seconds for them all).
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for _ in pool.map(lambda job: self.programs.prepare(*job), jobs):
                bar.update()
                bar.set_postfix(compiled=cache.num_compiled - before[0],
                                cached=cache.num_on_disk - before[1])
        bar.close()
        for T, batch in batches:
            if T <= WARM_UP_TOKENS:
                self.programs.run_step(self.param_leaves, batch)
        self.kv_cache.block_until_ready()
        logger.info("compiled %d executables, found %d in the compilation cache%s (loaded "
                    "when first run; %d step shapes, %d sampler variants)",
                    cache.num_compiled - before[0], cache.num_on_disk - before[1],
                    "" if cache.folder is None else f" {cache.folder.parent}",
                    len(shapes), len(draws))

    def lower_step(self, T: int) -> jax.stages.Lowered:
        """The model step of a padding-only step of T tokens, lowered (to read its HLO)."""
        return self.programs.lower_step(self.param_leaves, self.inputs.padding(T))

    # -- running steps ------------------------------------------------------------------------

    def run_model(self, batch: ModelInput) -> jax.Array:
        """Runs the model step on `batch` (`StepInputs.model_input`) and keeps the updated pool;
        samples nothing. Returns f32[R, V] the logits of each sequence's last new token (R
        >= its sequences: padding rows after them), on the device. For probes (a platform's
        batch-invariance floor, a benchmark's timing)."""
        return self.programs.run_step(self.param_leaves, batch)[0]

    def compute_logits(self, seqs: list[Sequence], num_new_tokens: list[int]) -> jax.Array:
        """Computes the next `num_new_tokens[i]` tokens of each of `seqs` (after their
        `num_computed_tokens`, in blocks the caller appended) and writes their K/V to the pool;
        samples nothing. For a proposer's own model (`spec_decode.draft_model`).

        Returns:
          f32[R, V] on the device: the logits of each sequence's last new token, in the order
          of `seqs` (R >= len(seqs): padding rows after them).
        """
        return self.run_model(self.inputs.prepare(seqs, num_new_tokens))

    def probe(self) -> None:
        """Runs the smallest padding-only step (with its greedy draws), writing nothing to the
        pool: whether the device and the compiled step work with no request in them. Raises
        whatever they raise (`FaultIsolatingExecutor` calls it after a step in which every
        request failed alone)."""
        if self.fault_hook is not None:
            self.fault_hook(SchedulerOutput([], [], []))
        jax.block_until_ready(self.programs.run_step(self.param_leaves, self.inputs.padding(1)))

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Runs one scheduled step and waits for it: `collect(launch(out))`."""
        return self.collect(self.launch(out))

    def launch(self, out: SchedulerOutput, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Dispatches scheduled step `out` without waiting for it: its sequences packed in one
        model call (or k of them in one program for a k-step decode), then its draws (see the
        module). A row whose last input token is still a placeholder (async scheduling booked
        `prev` before its draws were read) reads `prev`'s draw for it on the device.

        Raises:
          ValueError: a placeholder input with no draw of `prev` for it.
          whatever `fault_hook` raises (before anything is dispatched).
        """
        if self.fault_hook is not None:
            self.fault_hook(out)
        self.input_batch.remove(out.finished_seq_ids)
        self.input_batch.remove(seq.seq_id for seq in out.preempted)
        if out.blocks_to_copy:
            self.apply_copies(out.blocks_to_copy)
        if out.num_steps > 1:
            launched = self._launch_steps(out)
            if launched is not None:
                return launched
        return self._launch_step(out, prev)

    def _launch_step(self, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """`launch` of one model step; prompt logprobs and scoring take logits at every token."""
        spec = [out.spec_tokens(row) for row in range(len(out.seqs))]
        # Where each row's logits start among the rows the step returns: one per row, or for a
        # row verifying k proposals, k + 1 (its last token's and each proposal's).
        first_logit = np.cumsum([0] + [1 + len(s) for s in spec])
        batch = self._with_placeholders(
            self.inputs.prepare(out.seqs, out.num_scheduled_tokens, spec), out, prev)
        logits_indices = None
        if any(spec):  # padded to the step's T: one executable per step size
            ends = np.cumsum(out.num_scheduled_tokens)
            logits_indices = np.zeros(batch.input_ids.shape, np.int32)
            for row, (end, s) in enumerate(zip(ends, spec)):
                logits_indices[first_logit[row]:first_logit[row + 1]] = \
                    np.arange(end - 1 - len(s), end)
        md = batch.attention
        launched = LaunchedStep(out, Draws(len(out.seqs), *plan_samples(
            out, spec, first_logit.tolist()), spec))
        want = [row for row, seq in enumerate(out.seqs) if wants_prompt_logprobs(seq)]
        scored = scored_tokens(out, md.query_start_loc)
        if want or scored:
            logits, greedy, routes = self.programs.run_step(self.param_leaves, batch, True)
            last = (logits_indices if logits_indices is not None else
                    np.minimum(md.query_start_loc[:-1] + np.maximum(md.query_lens - 1, 0),
                               len(batch.input_ids) - 1))
            if scored:
                score(logits, scored, self.config.vocab_size)
            if want:
                k = max(out.seqs[row].params.prompt_logprobs for row in want)
                logits, *plp = prompt_logprobs(logits, batch.input_ids, last,
                                               num_logprobs=next_power_of_2(k) if k else 0)
                launched.prompt_logprobs = (want, md.query_start_loc, plp)
            else:
                logits = sampler.gather_rows(logits, last)
        else:
            logits, greedy, routes = self.programs.run_step(
                self.param_leaves, dataclasses.replace(batch, logits_indices=logits_indices))
        self._keep_routes(launched, routes, np.asarray(md.slot_mapping))
        self.sampler.draw(launched.draws, logits, greedy)
        return launched

    def _launch_steps(self, out: SchedulerOutput) -> LaunchedStep | None:
        """`launch` of a k-step decode (`out.num_steps`); None (nothing run) where the steps'
        shapes differ (`StepInputs.decode_steps`): the caller runs one step then."""
        prepared = self.inputs.decode_steps(out.seqs, out.num_steps)
        if prepared is None:
            return None
        tokens, logprobs, routes = self.programs.run_steps(self.param_leaves, *prepared)
        n = len(out.seqs)
        samples = [(row, seq, 0, []) for row, seq in enumerate(out.seqs)]
        launched = LaunchedStep(out, Draws(n, samples, list(range(n)), [[]] * n,
                                           steps=(tokens, logprobs)))
        self._keep_routes(launched, routes, np.asarray(prepared[1].attention.slot_mapping))
        return launched

    def _with_placeholders(self, batch: ModelInput, out: SchedulerOutput,
                           prev: LaunchedStep | None) -> ModelInput:
        """`batch` with each row's placeholder last token taken from `prev`'s draws."""
        waiting = [(seq, end) for seq, end in zip(out.seqs,
                                                  np.cumsum(out.num_scheduled_tokens).tolist())
                   if seq.token_ids[-1] == PLACEHOLDER]
        if not waiting:
            return batch
        tokens, index = (None, {}) if prev is None else prev.draws.token_source()
        source = np.full(batch.input_ids.shape, -1, np.int32)
        for seq, end in waiting:
            if seq.seq_id not in index:
                raise ValueError(f"{seq}: its last token is not known and no step drew it")
            source[end - 1] = index[seq.seq_id]
        ids = _merge_ids(batch.input_ids, source, tokens)
        if self.replicated is not None:
            ids = jax.device_put(ids, self.replicated)
        return dataclasses.replace(batch, input_ids=ids)

    def _keep_routes(self, launched: LaunchedStep, routes, slot_mapping: np.ndarray) -> None:
        """Keeps an MoE model's routes of `launched` to record when it is collected."""
        if self.routes is not None:
            launched.routes, launched.slot_mapping = routes, slot_mapping
            launched.starts = np.fromiter((s.num_computed_tokens for s in launched.out.seqs),
                                          np.int32, len(launched.out.seqs))

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """Waits for `launched` and returns its draws and prompt logprobs. An MoE model's routes
        are recorded for the rows whose sequences have not finished since it was launched."""
        out = launched.out
        sampled = launched.draws.read()
        if launched.routes is not None:
            routes = np.asarray(jax.device_get(launched.routes))
            if launched.draws.steps is not None:
                self.routes.record_steps(out.seqs, launched.starts, launched.slot_mapping,
                                         routes)
            else:
                self.routes.record(out.seqs, launched.starts,
                                   np.asarray(out.num_scheduled_tokens, np.int32),
                                   launched.slot_mapping, routes)
        prompt_lps = {}
        if launched.prompt_logprobs is not None:
            want, query_start_loc, plp = launched.prompt_logprobs
            prompt_lps = collect_prompt_logprobs(out, query_start_loc, want,
                                                 jax.device_get(plp))
        return RunnerOutput(sampled, prompt_lps)

    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies, padded to a power of two with repeats of the first."""
        pairs = copies + [copies[0]] * (next_power_of_2(len(copies)) - len(copies))
        src, dst = (np.asarray(x, np.int32) for x in zip(*pairs))
        self.programs.run_copies(src, dst)
        if self.routes is not None:
            self.routes.copy_blocks(src, dst)
