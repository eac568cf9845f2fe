"""Async scheduling's device side (vLLM's `async_scheduling`): a step launched without waiting
for its draws, and collected later.

`launch` dispatches a step and returns at once with its draws still on the device. A row of the
step whose last input token is still a placeholder (`PLACEHOLDER`: the engine booked the step
before it, whose draw that is, before the draw came back) reads that draw from the previous
step's device array, so that the host never waits for the device between two steps
(`engine.async_scheduling` builds the loop). `collect` waits for a launched step and returns its
draws as `ModelRunner.execute` would.

A launched step is one model call and at most one sampler call, with no speculative tokens,
prompt logprobs or scored tokens (`can_launch`): those steps run through `ModelRunner.execute`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.sequence import PLACEHOLDER, Sequence
from jaxpaged.sample import sampler
from jaxpaged.sample.sampler import SampledToken
from jaxpaged.worker.prompt_logprobs import wants_prompt_logprobs


@dataclasses.dataclass
class LaunchedStep:
    """A step dispatched by `launch`, its draws not yet read."""

    out: SchedulerOutput
    # (logits row, sequence, completion j, ()) of each draw and the row it belongs to, in
    # `ModelRunner._sample_rows`'s order.
    samples: list[tuple[int, Sequence, int, tuple]]
    row_of: list[int]
    # i32[?] on the device, and for each draw its index there: what the next step's
    # placeholder inputs read (by sequence id: a parent's own draw, completion 0).
    token_source: jax.Array
    source_index: dict[int, int]
    # The draws on the device: `greedy_draw`'s (token ids, logprobs) of every logits row, or
    # the sampler's `SamplerOutput` of each draw.
    greedy: tuple[jax.Array, jax.Array] | None
    drawn: sampler.SamplerOutput | None
    # An MoE model's routes and what recording them needs (`RoutedExperts.record`), else None.
    routes: jax.Array | None = None
    starts: np.ndarray | None = None
    slot_mapping: np.ndarray | None = None
    forks: bool = False  # some row forks into its n completions when booked


def can_launch(out: SchedulerOutput) -> bool:
    """Whether `out` is a step `launch` runs: one step, no speculative tokens, no prompt
    logprobs and nothing scored."""
    return (out.num_steps == 1 and not any(out.spec_token_ids)
            and not any(wants_prompt_logprobs(s) or s.scoring is not None for s in out.seqs))


@jax.jit
def _merge_ids(input_ids: jax.Array, source: jax.Array, tokens: jax.Array) -> jax.Array:
    """i32[T]: `input_ids`, but token i is `tokens[source[i]]` where `source[i] >= 0`."""
    return jnp.where(source >= 0, tokens[jnp.maximum(source, 0)], input_ids)


def launch(runner, out: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
    """Dispatches step `out` (`can_launch`) on `runner` (a `ModelRunner`) without waiting for
    it. Its inputs that are still placeholders are `prev`'s draws for the same sequences.

    Raises:
      ValueError: a placeholder input with no draw of `prev` for it.
      whatever `runner.fault_hook` raises (before anything is dispatched).
    """
    if runner.fault_hook is not None:
        runner.fault_hook(out)
    runner.input_batch.remove(out.finished_seq_ids)
    runner.input_batch.remove(seq.seq_id for seq in out.preempted)
    if out.blocks_to_copy:
        runner.apply_copies(out.blocks_to_copy)
    batch = runner.prepare(out.seqs, out.num_scheduled_tokens)
    source, ends = None, np.cumsum(out.num_scheduled_tokens)
    for seq, end in zip(out.seqs, ends.tolist()):
        if seq.token_ids[-1] != PLACEHOLDER:
            continue
        if prev is None or seq.seq_id not in prev.source_index:
            raise ValueError(f"{seq}: its last token is not known and no step drew it")
        if source is None:
            source = np.full(batch.input_ids.shape, -1, np.int32)
        source[end - 1] = prev.source_index[seq.seq_id]
    if source is not None:
        ids = _merge_ids(batch.input_ids, source, prev.token_source)
        if runner.replicated is not None:
            ids = jax.device_put(ids, runner.replicated)
        batch = dataclasses.replace(batch, input_ids=ids)
    samples, row_of = [], []
    for row, (seq, q) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
        if seq.num_computed_tokens + q == seq.num_tokens:  # it completes: it draws
            for j in range(1 + seq.num_forks):
                samples.append((row, seq, j, ()))
                row_of.append(row)
    logits, greedy, routes = runner._run_step(batch)
    launched = LaunchedStep(out, samples, row_of, None, {}, None, None,
                            forks=any(seq.num_forks for _, seq, _, _ in samples))
    if runner.routes is not None:
        launched.routes, launched.slot_mapping = routes, np.asarray(batch.attention.slot_mapping)
        launched.starts = np.fromiter((s.num_computed_tokens for s in out.seqs), np.int32,
                                      len(out.seqs))
    if not samples:
        return launched
    if greedy is not None and runner.greedy_draws and runner.input_batch.plain_greedy(samples):
        launched.greedy, launched.token_source = greedy, greedy[0]
        indices = [row for row, _, _, _ in samples]  # logits row r is step row r
    else:
        launched.drawn = runner.draw_on_device(samples, logits)
        launched.token_source = launched.drawn.token_ids
        indices = range(len(samples))
    for i, (_, seq, j, _) in zip(indices, samples):
        if j == 0:
            launched.source_index[seq.seq_id] = i
    return launched


def collect(runner, launched: LaunchedStep) -> list[list[SampledToken]]:
    """Waits for `launched` and returns each row's draws, as `ModelRunner.execute` does. An
    MoE model's routes are recorded for the rows whose sequences have not finished since."""
    out = launched.out
    per_row = [[] for _ in out.seqs]
    if launched.routes is not None:  # finished sequences' rows are not written
        runner.routes.record(out.seqs, launched.starts,
                             np.asarray(out.num_scheduled_tokens, np.int32),
                             launched.slot_mapping, np.asarray(jax.device_get(launched.routes)))
    if not launched.samples:
        return per_row
    if launched.greedy is not None:
        res = sampler.pick_greedy(jax.device_get(launched.greedy),
                                  [row for row, _, _, _ in launched.samples])
    else:
        res = jax.device_get(launched.drawn)
    token_ids, logprobs, ranks = (x.tolist() for x in (res.token_ids, res.logprobs, res.ranks))
    for i, ((_, seq, _, _), row) in enumerate(zip(launched.samples, launched.row_of)):
        k = seq.params.logprobs
        top = (None if k is None else [] if k == 0 else
               list(zip(res.top_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist())))
        per_row[row].append(SampledToken(token_ids[i], logprobs[i], ranks[i], top))
    return per_row
