"""Devices and processes: the mesh tensor parallelism runs on, and joining several processes
(hosts) into one JAX runtime through `jax.distributed`.

One process per host, each seeing its own devices; after `init_distributed`, `jax.devices()`
lists every process's, and one `Mesh` spans them all (JAX's multi-controller model: every
process runs the same computations in the same order; see `jaxpaged.distributed.multihost` for how the
engine keeps them in step).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpaged.pallas_kernels import DATA_AXIS, MODEL_AXIS

logger = logging.getLogger(__name__)

# Seconds a process waits for the others to join, and without a heartbeat from one before it
# gives up on it: a process that dies or never comes is an error on the others within about
# this long, not a hang.
DISTRIBUTED_TIMEOUT_S = 30


def init_distributed(coordinator_address: str, num_processes: int, process_id: int,
                     timeout_s: int = DISTRIBUTED_TIMEOUT_S) -> None:
    """Joins this process to the others (`jax.distributed.initialize`); process 0 hosts the
    coordinator at `coordinator_address` ("host:port"). Call it before anything else uses jax's
    devices. Collectives between processes on CPU go over gloo.

    Raises:
      ValueError: a bad argument (named).

    If the others have not all joined within `timeout_s` seconds, jax's runtime ends the process
    ("Terminating process because the JAX distributed service detected fatal errors ...
    DEADLINE_EXCEEDED"), after the warning this logs on joining.
    """
    if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
        raise ValueError(f"coordinator_address must be 'host:port', got {coordinator_address!r}")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
    # A warning, so that it shows without logging set up: when the others do not come, jax ends
    # this process from its C++ runtime, with no Python exception to tell what it waited for.
    logger.warning("process %d of %d: joining the others at %s (waiting up to %d s)",
                   process_id, num_processes, coordinator_address, timeout_s)
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=timeout_s)


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A (data=1, model=tensor_parallel_size) mesh over the first `tensor_parallel_size` devices
    of `jax.devices()` (every process's, after `init_distributed`).

    Raises:
      ValueError: not an int >= 1, or more than there are devices.
    """
    tp = tensor_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; jax sees "
                         f"{len(devices)} ({devices[0].platform})")
    return Mesh(np.array(devices[:tp]).reshape(1, tp), (DATA_AXIS, MODEL_AXIS))
