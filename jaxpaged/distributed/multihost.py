"""Several processes (hosts) running one engine: how every process runs the same computations in
the same order.

JAX's multi-controller model: each process runs the same program, and every jitted step over
the mesh is a collective that all processes must enter together. jaxpaged keeps the processes in
step by keeping their engines equal: the engine is deterministic (the same calls give the same
schedule, the same seeds, the same steps), so it is enough that every process makes the same
engine calls in the same order.

- Offline (`LLM(...)` from Python): run the same script on every process, each with
  `coordinator_address`, `num_processes` and its `process_id`; the same `generate` calls on each
  give the same outputs on each.
- Serving (`jaxpaged serve`): only process 0 serves HTTP. Its engine is a `LeaderEngine`, which
  publishes every call that changes engine state (`add_request`, `abort_request`, `step`) to the
  others, in order, through the key-value store of `jax.distributed`'s coordination service;
  every other process runs `follow`, which makes the same calls on its own engine.

Failure: the coordination service checks each process's heartbeat (`parallel.init_distributed`'s
timeout). A follower that loses process 0 (whose process hosts the service) gets an error from
the store and exits; a process that dies during a step makes the step's collectives fail on
the others, and the service reports the missing heartbeat within the timeout.
"""

from __future__ import annotations

import logging
import pickle

import jax

from jaxpaged.errors import EngineDeadError
from jaxpaged.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

KEY_PREFIX = "jaxpaged/engine-call/"
POLL_MS = 5_000  # how long a follower waits on the store before it checks again
# Calls kept in the store behind the newest. A step that runs the model is a collective of all
# processes, so no follower is more than a step's calls behind process 0; a step that schedules
# nothing is not, hence the margin.
KEPT_CALLS = 1024


def _client():
    # The coordination service's client: `jax.distributed` exposes it only through this module
    # (jax's own `multihost_utils` uses it the same way).
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized (see parallel.init_distributed)")
    return distributed.global_state.client


class LeaderEngine:
    """Process 0's engine: each call that changes its state is published to the followers.

    Forwards everything else to the wrapped `LLMEngine`. A call is published once it has been
    validated here (a request this engine refuses is never sent), before it runs, for `step`,
    so that the followers enter the step's collectives together with this process.
    """

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self._client = _client()
        self._num_calls = 0
        self._num_deleted = 0  # calls 0 .. _num_deleted - 1 are gone from the store

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _publish(self, method: str, *args) -> None:
        key = f"{KEY_PREFIX}{self._num_calls}"
        self._client.key_value_set_bytes(key, pickle.dumps((method, args)))
        self._num_calls += 1

    def add_request(self, prompt, params, request_id=None, priority=0) -> str:
        request_id = self._engine.add_request(prompt, params, request_id, priority)
        self._publish("add_request", prompt, params, request_id, priority)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self._engine.abort_request(request_id)
        self._publish("abort_request", request_id)

    def step(self):
        self._publish("step")
        outputs = self._engine.step()
        while self._num_deleted < self._num_calls - KEPT_CALLS:
            self._client.key_value_delete(f"{KEY_PREFIX}{self._num_deleted}")
            self._num_deleted += 1
        return outputs

    def shutdown(self) -> None:
        """Tells the followers to exit."""
        self._publish("shutdown")


def follow(engine: LLMEngine) -> None:
    """Makes on `engine` the calls process 0's `LeaderEngine` publishes, in order, until it
    publishes "shutdown".

    Raises:
      RuntimeError: process 0 is gone (the coordination service cannot be reached) or the
        engine died of a fatal fault (as process 0's did).
    """
    client = _client()
    logger.info("process %d: following process 0's engine calls", jax.process_index())
    num_calls = 0
    while True:
        key = f"{KEY_PREFIX}{num_calls}"
        try:
            data = client.blocking_key_value_get_bytes(key, POLL_MS)
        except Exception as error:  # a timeout: nothing new yet; else the service is gone
            if "DEADLINE_EXCEEDED" in str(error) or "timed out" in str(error).lower():
                continue
            raise RuntimeError(f"process {jax.process_index()}: lost process 0's coordination "
                               f"service: {error}") from error
        num_calls += 1
        method, args = pickle.loads(data)
        if method == "shutdown":
            return
        try:
            getattr(engine, method)(*args)
        except EngineDeadError as error:
            raise RuntimeError(f"process {jax.process_index()}: the engine died: {error}"
                               ) from error
        except ValueError:  # refused here as on process 0 (the same engine state)
            pass
