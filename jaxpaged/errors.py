"""The errors of jaxpaged's public API, and which faults they stand for.

- `InvalidRequestError` (a `ValueError`): a request's input is wrong; nothing was queued. Over
  HTTP it is a 400 whose `param` is the error's `param`.
- `RequestFailedError`: a fault inside an engine step was traced to this request (the step was
  rerun for each of its requests alone, and this one's run raised). Only this request ends; its
  blocks are freed and the others go on. Over HTTP it is a 500 with the reason.
- `EngineDeadError`: the engine stopped. A step fault is fatal when the KV pool was lost with it
  (a fault inside the compiled step after the pool was donated), when it is outside the model
  step (the scheduler, copy-on-write copies), or when it recurs without any request: after a
  step in which every request failed alone, a step of padding alone raises too
  (`jaxpaged.engine.faults`). Every unfinished request fails with it, later calls raise it,
  `/health` answers 503 and `jaxpaged serve` exits with status 1, so that a supervisor
  restarts it.

Beam search (`LLM.beam_search`) runs its steps itself, without this isolation: a fault there
raises to the caller.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad input: `param` names the offending field (a `SamplingParams` field, or "prompt")."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    """A step fault failed this request alone; the message gives the fault."""


class EngineDeadError(RuntimeError):
    """The engine stopped on a fatal fault; every unfinished request failed with this."""
