"""The scheduler's books under async scheduling: a step is booked when it is launched, before
its draws are known, and its draws are filled in when they come back.

`Scheduler.update_from_output` books a step that ran, draws known. With async scheduling the
engine schedules step i+1 while step i runs, so step i is booked in two parts:

- `book_launched`, right after step i is launched: each row's scheduled tokens count as
  computed, and a row that draws gets a `PLACEHOLDER` token (forking first into its n
  completions, as `update_from_output` does), so that step i+1 can be scheduled as if the draws
  were known; step i+1 reads them on the device (`ModelRunner.launch`). A sequence whose
  placeholder is its last token by length (`max_tokens`, `max_model_len`) is marked
  `length_capped`: the scheduler leaves it out of later steps until it finishes.
- `book_draws`, when step i's draws are read (after step i+1 was launched): each placeholder
  takes its token, the blocks that step i filled join the prefix cache, and the stop checks run
  as in `update_from_output`. A sequence that a token finishes here may be in step i+1 already;
  that row's draw is dropped when step i+1 is booked (its sequence is no longer running).

Only steps of one model call with no speculative tokens are booked so, and only for sequences
whose draws depend on nothing the host learns from earlier draws (no penalties, grammars or
prompt logprobs: `host_needs.ASYNC_OVERLAP`).
"""

from __future__ import annotations

import dataclasses

from jaxpaged.core.scheduler import Sampled, Scheduler, SchedulerOutput, StepUpdate
from jaxpaged.core.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclasses.dataclass
class LaunchedBooking:
    """What `book_launched` booked: per draw (row, sequence, completion j, token index)."""

    draws: list[tuple[int, Sequence, int, int]]
    seqs: list[Sequence]  # the rows' sequences booked (running when booked)
    num_prompt_tokens: int  # prompt tokens booked (recomputes included)


def book_launched(scheduler: Scheduler, out: SchedulerOutput) -> LaunchedBooking:
    """Books launched step `out` before its draws are known (see the module). Rows whose
    sequence is no longer running (finished since it was scheduled) are left out."""
    draws, seqs, num_prompt_tokens = [], [], 0
    max_model_len = scheduler.config.max_model_len
    for row, (seq, q) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
        if seq.status is not SequenceStatus.RUNNING:
            continue
        num_prompt_tokens += max(0, min(seq.num_computed_tokens + q, seq.num_prompt_tokens)
                                 - seq.num_computed_tokens)
        seq.num_computed_tokens += q
        seqs.append(seq)
        if seq.num_computed_tokens != seq.num_tokens:  # a prompt chunk with more to come
            continue
        # Fork before appending: children copy the parent as it was.
        targets = [seq] + [scheduler._fork_completion(seq, j)
                           for j in range(1, 1 + seq.num_forks)]
        seq.num_forks = 0
        for j, target in enumerate(targets):
            target.token_ids.append(PLACEHOLDER)
            target.length_capped = (target.num_output_tokens == target.params.max_tokens
                                    or target.num_tokens >= max_model_len)
            draws.append((row, target, j, target.num_tokens - 1))
    return LaunchedBooking(draws, seqs, num_prompt_tokens)


def book_draws(scheduler: Scheduler, booking: LaunchedBooking,
               sampled: list[list[Sampled]]) -> StepUpdate:
    """Fills in a booked step's draws (`sampled`, per row, one per completion) and runs the
    stop checks (see the module); returns what `update_from_output` would have (its
    `num_prompt_tokens` are `book_launched`'s). Draws of sequences that finished since the
    step was booked (aborted, or failed) are dropped."""
    for seq in booking.seqs:  # the blocks the step filled join the cache before a stop
        if not seq.is_finished:
            scheduler.block_manager.cache_full_blocks(seq)
    by_row: dict[int, list[tuple[Sequence, Sampled]]] = {}
    for row, seq, j, index in booking.draws:
        if seq.is_finished:
            continue
        token = sampled[row][j]
        seq.token_ids[index] = token.token_id
        seq.length_capped = False
        seq.cumulative_logprob += token.logprob
        scheduler._check_stop(seq)
        by_row.setdefault(row, []).append((seq, token))
    return StepUpdate(booking.num_prompt_tokens, list(by_row.items()))
