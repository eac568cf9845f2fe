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
- Serving (`jaxpaged serve`): only process 0 serves HTTP. Its engine is a `LeaderEngine`, an
  explicit client: it publishes every call that changes engine state or runs on the devices
  (`FORWARDED`: requests, steps, embeddings, sleep/wake-up, prefix-cache resets) to the others,
  in order, through the key-value store of `jax.distributed`'s coordination service; every other
  process runs `follow`, which makes the same calls on its own engine. It reads host state
  (`HOST_READS`) on process 0 and refuses everything else by name (`REFUSED`: new weights, whose
  arrays cannot travel between processes here), so that no computation over the mesh runs on
  process 0 alone (which would wait for the others forever).

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


# The explicit client: what process 0's engine may do on several processes, by name.
# Calls that change engine state or run on the devices: published to the followers, which make
# the same call in the same order (the engines stay equal; a computation over the mesh is entered
# by every process together).
FORWARDED = ("add_request", "abort_request", "step", "embed", "sleep", "wake_up",
             "reset_prefix_cache")
# Reads of process 0's host state (configs, the tokenizer, counters): no device, no change.
HOST_READS = frozenset({
    "tokenizer", "input_processor", "grammar_compiler", "tokenize_prompt", "chat_prompt",
    "model_config", "scheduler_config", "cache_config", "speculative_config", "model_dir",
    "dtype", "kv_cache_dtype", "quantization", "attention_backend", "batch_invariant",
    "reasoning_parser", "think_token_ids", "eos_token_ids", "sleep_level", "dead", "stats",
    "has_unfinished_requests", "scoring_prompt"})
# Refused by name: weights held by one process cannot reach the others' devices through the
# coordination service's key-value store (meant for small control messages), and process 0
# alone cannot read or write arrays whose shards live on the other processes.
OFFLINE_UPDATE = ("run the same LLM(...) script on every process (coordinator_address, "
                  "num_processes, process_id) and call update_params on each with its own copy "
                  "of the weights (NumPy arrays)")
REFUSED = {
    "update_params": "the new weights would have to reach every process's devices, and arrays "
                     "do not travel between processes here; " + OFFLINE_UPDATE,
    "load_weights": "the checkpoint tensors would have to reach every process's devices, and "
                    "arrays do not travel between processes here; " + OFFLINE_UPDATE,
    "get_params": "the parameters span every process's devices; process 0 alone cannot read "
                  "them (offline, jax.experimental.multihost_utils.process_allgather on every "
                  "process can)",
    "lora": "LoRA adapters are read and placed in their device slots by one process's host "
            "code; serve them on one process",
}


class MultiProcessUnsupportedError(AttributeError, NotImplementedError):
    """An engine operation refused on several processes; the message names it and says why.

    A NotImplementedError (the server answers 501 with the message) and an AttributeError
    (`hasattr(engine, name)` is False for an operation the engine does not offer here)."""

    def __init__(self, name: str):
        reason = REFUSED.get(name, f"{LeaderEngine.__name__} forwards only "
                                   f"{', '.join(FORWARDED)} to every process and reads host "
                                   "state on process 0")
        super().__init__(f"{name} is not supported when the engine runs on several processes: "
                         + reason)


class LeaderEngine:
    """Process 0's engine on several processes: an explicit client of the wrapped `LLMEngine`.

    Each operation is one of three kinds, listed by name in this module:
    - `FORWARDED`: published to the followers (`follow`), which make the same call on their
      engines in the same order. A call that only changes host state (`add_request`,
      `abort_request`, `sleep`, `reset_prefix_cache`) runs here first and is published once it
      succeeded (a request this engine refuses is never sent); a call that runs on the devices
      (`step`, `embed`, `wake_up`) is published before it runs, so that the followers enter its
      collectives together with this process.
    - `HOST_READS`: read from process 0's engine (configs, tokenizer, stats).
    - anything else: refused with `MultiProcessUnsupportedError` (a NotImplementedError and an
      AttributeError) naming the operation and why (`REFUSED`: `update_params`, `load_weights`,
      `get_params`). Nothing runs on process 0 alone.
    """

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self._client = _client()
        self._num_calls = 0
        self._num_deleted = 0  # calls 0 .. _num_deleted - 1 are gone from the store

    def __getattr__(self, name: str):
        # Only names not found on the class reach here.
        if name in HOST_READS:
            return getattr(self._engine, name)
        if name.startswith("__"):  # protocols probed by copy, pickle, inspect: absent
            raise AttributeError(name)
        raise MultiProcessUnsupportedError(name)

    def _publish(self, method: str, *args) -> None:
        key = f"{KEY_PREFIX}{self._num_calls}"
        self._client.key_value_set_bytes(key, pickle.dumps((method, args)))
        self._num_calls += 1

    # -- forwarded: host state, run here first ------------------------------------------------

    def add_request(self, prompt, params, request_id=None, priority=0, lora_request=None
                    ) -> str:
        if lora_request is not None:  # the adapter would be loaded on process 0 alone
            raise MultiProcessUnsupportedError("lora")
        request_id = self._engine.add_request(prompt, params, request_id, priority)
        self._publish("add_request", prompt, params, request_id, priority)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self._engine.abort_request(request_id)
        self._publish("abort_request", request_id)

    def sleep(self, level: int = 1) -> None:
        """`LLMEngine.sleep` on every process (each releases its shards)."""
        self._engine.sleep(level)
        self._publish("sleep", level)

    def reset_prefix_cache(self) -> bool:
        """`LLMEngine.reset_prefix_cache` on every process (the schedule depends on it)."""
        done = self._engine.reset_prefix_cache()
        if done:
            self._publish("reset_prefix_cache")
        return done

    # -- forwarded: device work, published first ----------------------------------------------

    def step(self):
        self._publish("step")
        outputs = self._engine.step()
        while self._num_deleted < self._num_calls - KEPT_CALLS:
            self._client.key_value_delete(f"{KEY_PREFIX}{self._num_deleted}")
            self._num_deleted += 1
        return outputs

    def embed(self, token_ids: list[list[int]], pooling: str = "last", normalize: bool = True):
        """`LLMEngine.embed` on every process; returns process 0's f32[len(token_ids), D]."""
        token_ids = [[int(t) for t in ids] for ids in token_ids]
        self._publish("embed", token_ids, pooling, normalize)
        return self._engine.embed(token_ids, pooling, normalize)

    def wake_up(self) -> None:
        """`LLMEngine.wake_up` on every process (a new pool, maybe the weights read again)."""
        self._publish("wake_up")
        self._engine.wake_up()

    # -- refused ------------------------------------------------------------------------------

    def update_params(self, params) -> None:
        """Raises MultiProcessUnsupportedError: see `REFUSED`."""
        raise MultiProcessUnsupportedError("update_params")

    def load_weights(self, weights) -> None:
        """Raises MultiProcessUnsupportedError: see `REFUSED`."""
        raise MultiProcessUnsupportedError("load_weights")

    def get_params(self):
        """Raises MultiProcessUnsupportedError: see `REFUSED`."""
        raise MultiProcessUnsupportedError("get_params")

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
        if method not in FORWARDED:
            raise RuntimeError(f"process {jax.process_index()}: process 0 published "
                               f"{method!r}, which is not a forwarded call")
        try:
            getattr(engine, method)(*args)
        except EngineDeadError as error:
            raise RuntimeError(f"process {jax.process_index()}: the engine died: {error}"
                               ) from error
        except (ValueError, RuntimeError) as error:  # raised on process 0 too (equal engines)
            logger.info("process %d: %s raised %r, as on process 0", jax.process_index(),
                        method, error)
