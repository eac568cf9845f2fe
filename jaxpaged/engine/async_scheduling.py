"""Async scheduling (vLLM's `async_scheduling`): the host prepares and launches step i + 1 while
the device runs step i, so that the device does not wait for the host between steps.

Each `LLMEngine.step` call:

1. schedules step i + 1, with step i booked as if its draws were known (`core.async_booking`:
   each draw is a placeholder token);
2. launches it (`ModelRunner.launch`): its decode inputs that are step i's draws are read from
   step i's device arrays, with no wait;
3. collects step i's draws (`ModelRunner.collect`: the one wait of the call, while step i + 1
   runs), fills them in, runs
   the stop checks (token ids, lengths, stop strings) and returns step i's outputs;
4. books step i + 1 as launched.

The host so learns each draw one step late: a sequence that a draw ends (EOS, a stop token or a
stop string) has one more token computed in step i + 1, which is dropped; lengths are known
ahead (`Sequence.length_capped`), so a sequence is never scheduled past `max_tokens` or
`max_model_len`. The tokens drawn are the same as in the synchronous loop: a seeded draw's key
depends on its sequence and its position only (`sampler._sample_key`).

Steps whose sequences need the host to know earlier draws before drawing run synchronously: in
a call where any running or waiting sequence has penalties, a grammar, prompt logprobs or is a
scoring sequence (`host_needs.ASYNC_OVERLAP`), the step in flight is read first and the next one runs as
`LLMEngine.run_step` runs it; the step after a prompt forks into its n completions waits for
that step too, and so does a multi-step call (`num_scheduler_steps`). An engine with a
speculative proposer, or over several processes, never runs this way (`LLMEngine`). Weights
changed between two calls (`update_params`) reach the steps launched after the change; the
step in flight finishes with the old ones.

Faults: a fault raised while launching (before anything runs on the device) reads the step in
flight first, then runs the step through the fault-isolating executor, as the synchronous loop
does. A fault raised when reading a step's draws fails the requests of that step (the step
launched after it is dropped and scheduled again); the synchronous loop would instead run them
one at a time to find the one at fault.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from jaxpaged.core.async_booking import LaunchedBooking, book_draws, book_launched
from jaxpaged.core.host_needs import ASYNC_OVERLAP, free_of
from jaxpaged.core.scheduler import StepUpdate
from jaxpaged.core.sequence import PLACEHOLDER, SequenceStatus
from jaxpaged.engine.faults import describe
from jaxpaged.errors import EngineDeadError
from jaxpaged.outputs import RequestOutput
from jaxpaged.worker.model_runner import LaunchedStep

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _InFlight:
    step: LaunchedStep
    booking: LaunchedBooking


class AsyncScheduling:
    """`LLMEngine.step` with the next step launched before the last one's draws are read (see
    the module). `num_overlapped_steps` counts the steps launched while another ran."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight: _InFlight | None = None
        self.num_overlapped_steps = 0

    def _all_can_overlap(self) -> bool:
        scheduler = self.engine.scheduler
        return all(free_of(seq, ASYNC_OVERLAP)
                   for seq in (*scheduler.running, *scheduler.waiting))

    def step(self) -> list[RequestOutput]:
        """One call (see the module): the outputs of the step whose draws it read."""
        engine, prev = self.engine, self.in_flight
        overlap = self._all_can_overlap()
        if prev is not None and (prev.step.forks or not overlap):
            return self._finish()
        out = engine.schedule()
        if out is None:
            return self._finish() if prev is not None else []
        # A k-step decode reads its rows' last tokens on the host: the step in flight first.
        if not overlap or out.num_steps > 1:
            return self._run_sync(out)
        try:
            launched = engine.runner.launch(out, None if prev is None else prev.step)
        except Exception as e:  # nothing of `out` ran: run it as the synchronous loop does
            logger.warning("launching a step raised %s; running it synchronously", describe(e))
            return self._run_sync(out)
        outputs = []
        if prev is not None:
            self.num_overlapped_steps += 1
            outputs, read = self._read()
            if not read:  # `launched` read its draws: dropped, its rows are scheduled again
                return outputs
        self.in_flight = _InFlight(launched, book_launched(engine.scheduler, out))
        return outputs

    def _run_sync(self, out) -> list[RequestOutput]:
        """Reads the step in flight, then runs `out` (scheduled while it was in flight) as the
        synchronous loop does, without the rows whose sequences finished meanwhile."""
        outputs = self._finish() if self.in_flight is not None else []
        self.engine.check_alive()
        rows = [row for row, s in enumerate(out.seqs) if s.status is SequenceStatus.RUNNING]
        if not rows:
            return outputs
        out = dataclasses.replace(
            out, seqs=[out.seqs[r] for r in rows],
            num_scheduled_tokens=[out.num_scheduled_tokens[r] for r in rows],
            spec_token_ids=[out.spec_tokens(r) for r in rows])
        return outputs + self.engine.run_step(out)

    def _finish(self) -> list[RequestOutput]:
        """Reads the step in flight, books its draws and returns its outputs."""
        return self._read()[0]

    def _read(self) -> tuple[list[RequestOutput], bool]:
        """`_finish`, and whether the draws were read (else its requests failed, `_fail`)."""
        engine, done = self.engine, self.in_flight
        self.in_flight = None
        try:
            sampled = engine.runner.collect(done.step).sampled
        except Exception as fault:
            return self._fail(done, fault), False
        now = time.time()
        update = book_draws(engine.scheduler, done.booking, sampled)
        return engine.book.outputs(done.step.out, update, {}, now), True

    def _fail(self, done: _InFlight, fault: Exception) -> list[RequestOutput]:
        """A step whose draws could not be read: fatal if the pool went with it, else its
        requests fail (their K/V and draws cannot be trusted; none of its blocks is cached)."""
        engine = self.engine
        try:
            engine.executor.check_pool(fault)
        except EngineDeadError as e:
            engine.dead = e
            raise
        logger.error("a launched step raised %s; failing its requests", describe(fault),
                     exc_info=fault)
        for _, seq, _, index in done.booking.draws:
            if seq.token_ids[index:] == [PLACEHOLDER]:
                del seq.token_ids[index:]
            seq.length_capped = False
        reason = describe(fault)
        failed = {seq.request_id: reason for seq in done.booking.seqs}
        return engine.book.outputs(done.step.out, StepUpdate(0, []), failed, time.time())
