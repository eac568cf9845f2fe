"""Fault isolation for engine steps: a step that raises fails only the requests it comes from.

A step runs many requests' rows in one model call, so an exception does not say whose input
caused it. `FaultIsolatingExecutor` runs such a step again one request at a time. Rerunning is
safe: a step writes the same K/V to the same pool slots (a copy-on-write copy applied again
restores slots that the rerun then writes again), a seeded sample draws the same token however
often it is drawn (`sampler._sample_key`), and blocks enter the prefix cache only after a step
succeeds. A request whose run still raises on its own is failed. The others then run the step
again together, as the step would have run without the failed requests: a row's numbers depend
on the rows beside it (the step's padded size, how the kernels split their work), so a seeded
sample drawn from a lone run can differ from the one a step without the faulty request draws.
Their K/V, written by their lone runs, is written again to the same slots by that run. Should
that run raise (a fault that only their combination brings), they keep their lone runs' results.

When every request of a step failed alone, the fault may not be theirs: the runner then probes
the device with a step of padding alone (`ModelRunner.probe`). If that raises too, the fault
recurs without any request and is fatal; otherwise the engine goes on, so that a client who
retries a request that always fails (OpenAI's SDK retries a 500 twice) never stops the engine.
The other fatal faults are listed in `jaxpaged.errors`.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxpaged.errors import EngineDeadError
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def describe(e: BaseException) -> str:
    """An exception as "Type: message", the reason a failed request is given."""
    return f"{type(e).__name__}: {e}"


class FaultIsolatingExecutor:
    """`ModelRunner.execute` with a step's faults isolated to its requests."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, out: SchedulerOutput) -> tuple[list, dict, dict[str, str]]:
        """Runs one scheduled step.

        Returns:
          (samples per row, {row: prompt logprobs}) as `ModelRunner.execute` returns them, and
          {request id: reason} for the requests whose rows raised when run alone (their rows'
          samples are empty).

        Raises:
          EngineDeadError: the KV pool was lost with the fault, copy-on-write copies failed,
            every request failed alone and a padding-only step raised too, or the engine spans
            several processes (a fault there is most likely another process gone, and running
            requests alone would need it).
        """
        try:
            return *self.runner.execute(out), {}
        except Exception as fault:
            if jax.process_count() > 1:
                raise EngineDeadError(
                    f"a step across {jax.process_count()} processes failed (another process "
                    f"may have died): {describe(fault)}") from fault
            self.check_pool(fault)
            logger.warning("a step of %d rows raised %s; running its requests one at a time",
                           len(out.seqs), describe(fault), exc_info=fault)
            return self._execute_alone(out)

    def _execute_alone(self, out: SchedulerOutput) -> tuple[list, dict, dict[str, str]]:
        rows_of: dict[str, list[int]] = {}
        for row, seq in enumerate(out.seqs):
            rows_of.setdefault(seq.request_id, []).append(row)
        if out.blocks_to_copy:  # the reruns write into the copies: they must be in place
            try:
                self.runner.apply_copies(out.blocks_to_copy)
            except Exception as e:
                self.check_pool(e)
                raise EngineDeadError(f"copy-on-write copies failed: {describe(e)}") from e
        sampled, prompt_lps, failed = [[] for _ in out.seqs], {}, {}
        for request_id, rows in rows_of.items():
            try:
                self._run_rows(out, rows, sampled, prompt_lps)
            except Exception as e:
                self.check_pool(e)
                logger.error("request %s failed in a step: %s", request_id, describe(e),
                             exc_info=e)
                failed[request_id] = describe(e)
        if len(failed) == len(rows_of):
            try:
                self.runner.probe()
            except Exception as e:
                self.check_pool(e)
                raise EngineDeadError(f"the fault recurs on a step without any request: "
                                      f"{describe(e)}") from e
        elif len(rows_of) - len(failed) > 1:  # the others together, as without the failed
            kept = [row for request_id, rows in rows_of.items() if request_id not in failed
                    for row in rows]
            try:
                self._run_rows(out, kept, sampled, prompt_lps)
            except Exception as e:
                self.check_pool(e)
                logger.warning("the %d requests that ran alone raised %s together; they keep "
                               "their lone runs' results", len(rows_of) - len(failed),
                               describe(e), exc_info=e)
        return sampled, prompt_lps, failed

    def _run_rows(self, out: SchedulerOutput, rows: list[int], sampled: list,
                  prompt_lps: dict) -> None:
        """Runs rows `rows` of step `out` as a step of their own (its copy-on-write copies
        already applied; every other field of `out` kept: multi-step, rows leaving the input
        batch) and stores their results at their rows of `sampled` and `prompt_lps`; raises
        whatever the run raises, storing nothing then."""
        part = dataclasses.replace(
            out, seqs=[out.seqs[r] for r in rows],
            num_scheduled_tokens=[out.num_scheduled_tokens[r] for r in rows], blocks_to_copy=[],
            spec_token_ids=[out.spec_tokens(r) for r in rows])
        part_sampled, part_lps = self.runner.execute(part)
        for i, row in enumerate(rows):
            sampled[row] = part_sampled[i]
            prompt_lps.pop(row, None)
        prompt_lps.update({rows[i]: lps for i, lps in part_lps.items()})

    def check_pool(self, fault: Exception) -> None:
        """A fault inside the compiled step, after the pool was donated, takes the pool with
        it (on an accelerator it may show only when the pool is next read): every running
        sequence's K/V is gone, which is fatal."""
        lost = self.runner.kv_cache.is_deleted()  # `KVCache`: float and 8-bit pools alike
        if not lost:
            try:
                self.runner.kv_cache.block_until_ready()
            except Exception:  # the step's fault, shown only when the pool is read
                lost = True
        if lost:
            raise EngineDeadError(f"the KV pool was lost with a fault in the step: "
                                  f"{describe(fault)}") from fault
