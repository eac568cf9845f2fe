"""A step's draws: which rows draw, the step's own greedy draws or the sampler's, and the samples
assembled on the host. Written once for every kind of step (one step, a k-step decode, a step
launched before the last one's draws are read).

A row that completes its scheduled tokens draws `1 + seq.num_forks` samples (a parent about to
fork into its n completions after its prefill); a prompt chunk with more to come draws none; a
row verifying k proposals draws at each of its k + 1 logits rows and keeps its draws up to the
first that differs from them (`rejection_sample`). Plain greedy draws (`host_needs.
ON_DEVICE_DRAW` needs nothing) are the model step's own argmax (`sampler.greedy_draw`): no
sampler call. Nothing here waits for the device until `Draws.read`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxpaged.core.host_needs import ON_DEVICE_DRAW, free_of
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.sequence import Sequence
from jaxpaged.sample import sampler
from jaxpaged.sample.rejection_sampler import rejection_sample
from jaxpaged.sample.sampler import SampledToken, SamplerOutput, SamplingMetadata
from jaxpaged.worker.buckets import next_power_of_2
from jaxpaged.worker.input_batch import InputBatch

# One draw: (logits row, sequence, completion j, the proposals it comes after).
Sample = tuple[int, Sequence, int, list[int]]


def plan_samples(out: SchedulerOutput, spec: list[list[int]], first_logit: list[int]
                 ) -> tuple[list[Sample], list[int]]:
    """The step's draws and the batch row of each (see the module); row r's logits start at
    `first_logit[r]`."""
    samples, row_of = [], []
    for row, (seq, q, proposals) in enumerate(zip(out.seqs, out.num_scheduled_tokens, spec)):
        if seq.num_computed_tokens + q - len(proposals) != seq.num_tokens:
            continue  # a prompt chunk with more to come samples nothing
        for j in range(1 + seq.num_forks):
            for i in range(1 + len(proposals)):
                samples.append((first_logit[row] + i, seq, j, proposals[:i]))
                row_of.append(row)
    return samples, row_of


@dataclasses.dataclass
class Draws:
    """A step's draws, still on the device; exactly one of `greedy`, `sampled`, `steps` is set
    when `samples` is not empty."""

    num_rows: int
    samples: list[Sample]
    row_of: list[int]  # each sample's batch row
    spec: list[list[int]]  # each row's proposals
    # `sampler.greedy_draw` of every logits row: (i32[R] token ids, f32[R] logprobs).
    greedy: tuple[jax.Array, jax.Array] | None = None
    sampled: SamplerOutput | None = None  # the sampler's draw of each sample
    # A k-step decode's draws: (i32[k, S] token ids, f32[k, S] logprobs), row r at column r.
    steps: tuple[jax.Array, jax.Array] | None = None

    @property
    def forks(self) -> bool:
        """Whether some row forks into its n completions when this step is booked."""
        return any(j for _, _, j, _ in self.samples)

    def token_source(self) -> tuple[jax.Array | None, dict[int, int]]:
        """(i32[?] the draws on the device, {seq_id: index there}) of each sequence's own draw
        (completion 0): what a step launched before these are read takes as its inputs."""
        if self.greedy is not None:
            source, index = self.greedy[0], [s[0] for s in self.samples]
        elif self.sampled is not None:
            source, index = self.sampled.token_ids, range(len(self.samples))
        else:
            return None, {}
        return source, {seq.seq_id: i for i, (_, seq, j, _) in zip(index, self.samples)
                        if j == 0}

    def _host(self) -> tuple[list, list, list, np.ndarray | None, np.ndarray | None]:
        """Waits for the draws: (token ids, logprobs, ranks) each [k][n] (k = 1 but for a
        k-step decode), and the top-k ids and logprobs [n, K] or None."""
        rows = [s[0] for s in self.samples]
        if self.steps is not None:
            tokens, logprobs = (x[:, rows] for x in jax.device_get(self.steps))
            return tokens.tolist(), logprobs.tolist(), np.ones_like(tokens).tolist(), None, None
        res = (sampler.pick_greedy(jax.device_get(self.greedy), rows)
               if self.greedy is not None else jax.device_get(self.sampled))
        ids, lps, ranks = ([x.tolist()] for x in (res.token_ids, res.logprobs, res.ranks))
        return ids, lps, ranks, res.top_ids, res.top_logprobs

    def read(self) -> list[list[SampledToken]]:
        """Waits for the draws and returns each row's sampled tokens, in order."""
        per_row = [[] for _ in range(self.num_rows)]
        if not self.samples:
            return per_row
        ids, lps, ranks, top_ids, top_lps = self._host()
        kept = (rejection_sample(np.asarray(ids[0][:len(self.samples)]),
                                 np.asarray(self.row_of), [len(s[3]) for s in self.samples],
                                 self.spec).tolist() if any(self.spec) else None)
        for i, ((_, seq, _, _), row) in enumerate(zip(self.samples, self.row_of)):
            if kept is not None and not kept[i]:
                continue
            k = seq.params.logprobs
            top = (None if k is None else [] if k == 0 else
                   list(zip(top_ids[i, :k].tolist(), top_lps[i, :k].tolist())))
            per_row[row] += [SampledToken(t[i], lp[i], r[i], top)
                             for t, lp, r in zip(ids, lps, ranks)]
        return per_row


class StepSampler:
    """Makes a step's draws: the step's own greedy draws where every sample allows them, else
    one call of the jitted sampler (`sampler.sample`) over the samples' rows."""

    def __init__(self, input_batch: InputBatch, sample_fn, greedy_draws: bool = True):
        """`sample_fn(logits, md, all_greedy=, num_logprobs=)`: the runner's sampler
        executable. `greedy_draws`: False in batch-invariant mode, where a row's logprob would
        otherwise depend on whether its batch-mates draw plainly greedily."""
        self.input_batch, self.sample_fn, self.greedy_draws = input_batch, sample_fn, greedy_draws

    def draw(self, draws: Draws, logits: jax.Array,
             greedy: tuple[jax.Array, jax.Array] | None) -> Draws:
        """`draws` with its draws made: from `greedy` (the step's argmax of every logits row)
        when allowed, else by the sampler from `logits` f32[R, V]."""
        if not draws.samples:
            return draws
        if (greedy is not None and self.greedy_draws
                and all(free_of(s[1], ON_DEVICE_DRAW) for s in draws.samples)):
            draws.greedy = greedy
        else:
            draws.sampled = self.draw_on_device(draws.samples, logits)
        return draws

    def draw_on_device(self, samples: list[Sample], logits: jax.Array) -> SamplerOutput:
        """The jitted sampler's draws for `samples` (`prepare_sampling`), on the device."""
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
        return self.sample_fn(logits, md, all_greedy=all_greedy, num_logprobs=num_logprobs)

    def prepare_sampling(self, samples: list[Sample]) -> tuple[np.ndarray, SamplingMetadata]:
        """Per-sample arrays for `sampler.sample`, padded to a power of two R, and i32[R] the
        logits row each sample draws from, from the persistent `input_batch`'s per-row
        parameters (`InputBatch.sampling_metadata`). Sample j of a row drawing several uses
        seed `seq.seed + j` (mod 2**64), as a lone request seeded `seed + j` would (vLLM's
        convention). A draw verifying speculative tokens after `proposals` (taken as
        accepted) is output token `num_output_tokens + len(proposals)`, with that token's key
        (proposals go only to sequences whose draws depend on no earlier output:
        `host_needs.SPECULATION`)."""
        row_index = np.zeros((next_power_of_2(len(samples)),), np.int32)
        row_index[:len(samples)] = [row for row, _, _, _ in samples]
        return row_index, self.input_batch.sampling_metadata(samples)
