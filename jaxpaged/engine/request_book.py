"""The requests in flight and what each booked step makes of them: the engine's host side after
the scheduler has booked a step (`Scheduler.update_from_output`, or `async_booking.book_draws`
under async scheduling), the same for every kind of step.

For each row that got tokens, `OutputProcessor.advance` makes their text, logprobs and stop
strings; a request that a fault is traced to is failed (its completions end with finish reason
"error" and give back their blocks); each touched request reports as its `output_kind` says,
and a finished one is returned once, then forgotten.
"""

from __future__ import annotations

import logging
import time

from jaxpaged.core.scheduler import Scheduler, SchedulerOutput, StepUpdate
from jaxpaged.core.sequence import Sequence
from jaxpaged.engine.faults import describe
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.request import Request
from jaxpaged.outputs import RequestOutput

logger = logging.getLogger(__name__)


class RequestBook:
    """The engine's requests by id, and their outputs from each booked step.

    Args:
      output_processor: makes a row's new tokens' text, logprobs and stop strings.
      scheduler: ends sequences (`Scheduler.finish`) and holds those not yet listed.
      proposer: a speculative proposer whose state of finished sequences goes after each
        step, or None.
      forks_unlisted: async scheduling: a launched step may fork a prompt's completions before
        any output lists them (`core.async_booking`).
    """

    def __init__(self, output_processor: OutputProcessor, scheduler: Scheduler, proposer=None,
                 forks_unlisted: bool = False):
        self.output_processor, self.scheduler = output_processor, scheduler
        self.proposer, self.forks_unlisted = proposer, forks_unlisted
        self.requests: dict[str, Request] = {}
        self.num_failed_requests = 0  # requests failed by a fault in a step
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputes included)

    def all_seqs(self, request: Request) -> list[Sequence]:
        """`request.seqs`, and under async scheduling the completions a launched step forked
        from its prompt that no output has listed yet."""
        if not self.forks_unlisted:
            return request.seqs
        listed = {seq.seq_id for seq in request.seqs}
        return request.seqs + [
            seq for seq in (*self.scheduler.running, *self.scheduler.waiting)
            if seq.request_id == request.request_id and seq.seq_id not in listed]

    def abort(self, request_id: str) -> None:
        """Drops a request and frees its blocks; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        for seq in self.all_seqs(request) if request else []:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def add_prompt_logprobs(self, out: SchedulerOutput, prompt_lps: dict[int, list],
                            failed: dict[str, str]) -> None:
        """Sets the prompt logprobs (`RunnerOutput.prompt_logprobs`, by row of `out`) of the
        requests that have none yet and did not fail."""
        for row, lps in prompt_lps.items():
            request = self.requests[out.seqs[row].request_id]
            if request.request_id not in failed and request.prompt_logprobs is None:
                request.prompt_logprobs = self.output_processor.prompt_logprob_dicts(
                    request, lps)

    def outputs(self, out: SchedulerOutput, update: StepUpdate, failed: dict[str, str],
                now: float) -> list[RequestOutput]:
        """The host side of booked step `out` (see the module): `failed` is {request id:
        reason}; `now` the step's end in seconds since the epoch. Returns the outputs of the
        requests it advanced."""
        self.num_prompt_tokens += update.num_prompt_tokens
        touched = {}
        for row, appended in update.appended:
            request = self.requests.get(out.seqs[row].request_id)
            if request is None:  # aborted while its step ran (async scheduling)
                continue
            try:
                self.output_processor.advance(request, appended, now)
                touched[request.request_id] = request
            except Exception as e:  # in detokenizing or stop checks: this request's own fault
                logger.exception("request %s failed after its step", request.request_id)
                failed[request.request_id] = describe(e)
        for request_id, reason in failed.items():
            if request_id in self.requests:
                touched[request_id] = self.fail(self.requests[request_id], reason)
                self.num_failed_requests += 1
        if self.proposer is not None:  # the draft's state of sequences that finished goes
            self.proposer.release(self.scheduler.running)
        outputs = []
        for request_id, request in touched.items():
            finished = request.finished
            if finished:
                request.metrics.finished_time = time.time()
            output = request.output()
            if output is not None:
                outputs.append(output)
            if finished:
                del self.requests[request_id]
        return outputs

    def fail(self, request: Request, reason: str) -> Request:
        """Ends every sequence of `request` with finish reason "error" and frees its blocks."""
        request.error = reason
        for seq in self.all_seqs(request):
            seq.num_forks = 0
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        return request
