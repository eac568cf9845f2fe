"""Multi-step decoding: k decode steps of the same sequences in one device call.

A decode step at small batch sizes costs the host about as much as the device's memory-bound
model step would allow for several (dispatching an executable of a few hundred parameter
arrays, building the step's arrays, booking its tokens). When every running sequence draws
plainly greedily (`draws_plain_greedy`) and nothing waits, the scheduler books k tokens' slots
at once (`SchedulerOutput.num_steps`), and `run_steps` runs k model steps in one `lax.scan`:
step i computes each row's token i and draws token i + 1 by argmax (`sampler.greedy_draw`),
which step i + 1 reads, on the device. The host prepares the k steps' metadata up front (step
i is step 0 with every position i later, in the same booked blocks) and reads all k x S draws
once at the end. vLLM's v0 multi-step scheduling (`--num-scheduler-steps`) does the same.

The tokens are those k single steps would draw: each step is the same packed step of one token
per row, and the draws are the step's own greedy draws.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models import ModelInput, forward
from jaxpaged.models.moe import recording_routes, stacked_routes
from jaxpaged.sample import sampler
from jaxpaged.sample.sampler import SampledToken
from jaxpaged.sampling_params import SamplingParams


def draws_plain_greedy(params: SamplingParams) -> bool:
    """Whether a request's draws are each the argmax of its raw logits, with no logprobs
    reported: no bias, allowed tokens, min_tokens (its masked stop tokens), penalties or
    grammar (`InputBatch.plain_greedy`'s test, from the parameters alone)."""
    return (params.is_greedy and params.logprobs is None and params.logprobs_mode == "raw"
            and not params.logit_bias and params.allowed_token_ids is None
            and not params.min_tokens and params.structured_outputs is None
            and params.repetition_penalty == 1 and not params.frequency_penalty
            and not params.presence_penalty)


def plain_greedy_decode(seq) -> bool:
    """Whether `seq` (a `Sequence`) may decode several steps in a row (`draws_plain_greedy`,
    and no grammar matcher)."""
    return seq.matcher is None and draws_plain_greedy(seq.params)


def multi_step(graphdef, treedef, leaves: list[jax.Array], kv_cache, first_ids: jax.Array,
               steps: ModelInput):
    """The pure k-step decode (`jax.jit` it with `graphdef`, `treedef` bound, the pool donated).

    Args:
      leaves: the parameters' flat list (`ModelRunner.param_leaves`).
      kv_cache: the pool; donated.
      first_ids: i32[T] each row's last token (padding after the rows).
      steps: each of the k steps' `ModelInput`, stacked: every leaf has a leading axis of k
        (their `input_ids` are ignored: step 0 reads `first_ids`, step i + 1 step i's draws).

    Returns:
      ((i32[k, S] each step's argmax per row, f32[k, S] its raw log-probability, an MoE
      model's i16[k, L_moe, T, k_experts] expert ids or None), kv_cache).
    """
    params = jax.tree.unflatten(treedef, leaves)
    T = first_ids.shape[0]

    def step(carry, batch):
        ids, kv_cache = carry
        with recording_routes() as routes:
            logits, kv_cache = forward(graphdef, params, kv_cache,
                                       dataclasses.replace(batch, input_ids=ids))
        tokens, logprobs = sampler.greedy_draw(logits)
        # Row r's token sits at position r of a decode step; the padding rows' draws land on
        # padding tokens, which write nothing.
        ids = jnp.zeros((T,), jnp.int32).at[:min(T, tokens.shape[0])].set(tokens[:T])
        return (ids, kv_cache), (tokens, logprobs, stacked_routes(routes))

    (_, kv_cache), draws = jax.lax.scan(step, (first_ids, kv_cache), steps)
    return draws, kv_cache


def jit_multi_step(runner):
    """`multi_step` jitted for `runner`'s model with the pool donated; under tensor
    parallelism with the parameters' and the pool's shardings, the draws replicated."""
    fn = functools.partial(multi_step, runner.graphdef, runner.param_treedef)
    if runner.mesh is None:
        return jax.jit(fn, donate_argnums=1)
    params = [x.sharding for x in runner.param_leaves]
    pool, replicated = runner.kv_cache.spec.sharding, runner.replicated
    return jax.jit(fn, donate_argnums=1,
                   in_shardings=(params, pool, replicated, replicated),
                   out_shardings=((replicated,) * 3, pool))


def prepare_steps(runner, seqs, k: int) -> tuple[np.ndarray, ModelInput] | None:
    """(i32[T] the rows' last tokens, the k steps' stacked `ModelInput`) for decoding `seqs`
    k steps in a row, from their booked blocks; None where the steps' shapes differ (a CPU
    step's flat block list can grow past the pool's size when many blocks are shared)."""
    rows = runner.input_batch.sync(seqs, runner.block_size)
    tables = runner.input_batch.block_tables[rows]
    n = len(seqs)
    T = runner.step_tokens(n)
    computed = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int32, n)
    first_ids = np.zeros((T,), np.int32)
    first_ids[:n] = [seq.token_ids[-1] for seq in seqs]
    lora_slots = None
    if runner.uses_lora:
        lora_slots = np.zeros((T,), np.int32)
        lora_slots[:n] = [seq.lora_slot for seq in seqs]
    ones = np.ones((n,), np.int32)
    batches = []
    for i in range(k):
        positions = np.zeros((T,), np.int32)
        positions[:n] = computed + i
        md = runner.backend.build_from_arrays(runner.limits, T, tables, computed + i, ones)
        batches.append(ModelInput(np.zeros((T,), np.int32), positions, md,
                                  lora_slots=lora_slots))
    shapes = {tuple(np.shape(x) for x in jax.tree.leaves(b)) for b in batches}
    if len(shapes) > 1:
        return None
    return first_ids, jax.tree.map(lambda *xs: np.stack(xs), *batches)


def multi_step_jobs(runner, Ts) -> list[tuple]:
    """`ModelRunner.precompile`'s jobs (jitted, args, static args, static kwargs) for the
    multi-step calls of the step sizes `Ts` that decodes of at most `max_num_seqs` rows take,
    each on k padding-only steps; none when `runner.num_scheduler_steps` is 1."""
    k, jobs = runner.num_scheduler_steps, []
    for T in sorted(Ts):
        if k == 1 or T > runner.step_tokens(runner.max_num_seqs):
            continue
        batch = runner._padding_batch(T, True in runner.backend.variants(T, runner.limits))
        steps = jax.tree.map(lambda *xs: np.stack(xs), *[batch] * k)
        jobs.append((runner._multi_step, (runner.param_leaves, runner.kv_cache.pool,
                                          np.zeros((T,), np.int32), steps), (), {}))
    return jobs


def run_steps(runner, out) -> list[list] | None:
    """Each row's `out.num_steps` greedy draws (`SampledToken`s, rank 1, no top logprobs),
    decoded in one call; None (nothing run) where `prepare_steps` finds the steps' shapes
    differ: the caller runs one step then."""
    prepared = prepare_steps(runner, out.seqs, out.num_steps)
    if prepared is None:
        return None
    args = (runner.param_leaves, runner.kv_cache.pool, *prepared)
    (tokens, logprobs, routes), runner.kv_cache.pool = runner._executable(
        runner._multi_step, args)(*args)
    if runner.routes is not None:
        starts = np.fromiter((s.num_computed_tokens for s in out.seqs), np.int32, len(out.seqs))
        runner.routes.record_steps(out.seqs, starts, prepared[1].attention.slot_mapping,
                                   np.asarray(jax.device_get(routes)))
    tokens, logprobs = (x.T.tolist() for x in jax.device_get((tokens, logprobs)))
    return [[SampledToken(t, lp, 1, None) for t, lp in zip(tokens[row], logprobs[row])]
            for row in range(len(out.seqs))]
