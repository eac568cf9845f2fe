"""New parameters for a running engine, checked and placed (`ModelRunner.replace_params`)."""

from __future__ import annotations

import jax
import numpy as np

from jaxpaged.models.loader import flat_params


def placed_params(params, param_specs: dict) -> list[jax.Array]:
    """`params`' arrays in the order of `param_specs`, each checked against its spec and placed
    with its sharding, as copies.

    Args:
      params: an `nnx.State` or a nested dict (`nnx.to_pure_dict`) of the engine's parameter
        tree, leaves `jax.Array` (on any device, sharded or not) or NumPy arrays.
      param_specs: path -> (shape, dtype, sharding) of the parameters served now.

    Raises:
      ValueError: a parameter missing or extra, deleted, or of another shape or dtype (its
        path named).
    """
    new = flat_params(params)
    missing = [p for p in param_specs if p not in new]
    extra = [p for p in new if p not in param_specs]
    if missing or extra:
        raise ValueError("update_params: the parameter tree differs from the engine's:"
                         + (f" missing {missing[:4]}" if missing else "")
                         + (f" unknown {extra[:4]}" if extra else ""))
    for path, (shape, dtype, _) in param_specs.items():
        x = new[path] = new[path] if hasattr(new[path], "dtype") else np.asarray(new[path])
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(f"update_params: parameter {path!r} is a deleted array "
                             "(donated to a jitted function?)")
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise ValueError(f"update_params: parameter {path!r} is {x.dtype}"
                             f"{list(x.shape)}, the engine's is {dtype}{list(shape)}")
    # Copies, never aliases: the caller may go on to change its NumPy arrays in place, or
    # donate its jax arrays to its next training step. (On CPU, `device_put` of a NumPy array
    # can share its memory even with may_alias=False: NumPy leaves are copied first.)
    return [jax.device_put(np.array(x) if isinstance(x, np.ndarray) else x, sharding,
                           may_alias=False)
            for x, (_, _, sharding) in ((new[path], spec)
                                        for path, spec in param_specs.items())]
