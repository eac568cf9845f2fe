"""The runner's device programs and their executables: the model step, the k-step decode, the
copy-on-write block copy and the sampler, each jitted once with the pool donated, and looked up
by their inputs' shapes (compiled, or loaded from the compilation cache).

The model step is `(params, kv_cache, ModelInput) -> (logits, greedy draws, routes,
kv_cache)`: the logits of each sequence's last new token (or of every token: prompt logprobs,
scoring), each logits row's argmax (`sampler.greedy_draw`; plain greedy decoding then needs
no sampler call), and an MoE model's expert ids. The k-step decode runs k model steps in one
`lax.scan`, step i + 1 reading step i's greedy draws on the device (vLLM v0's multi-step
scheduling); its inputs are k steps' `ModelInput` stacked (`StepInputs.decode_steps`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.models import ModelInput, forward
from jaxpaged.models.moe import recording_routes, stacked_routes
from jaxpaged.pallas_kernels import copy_blocks
from jaxpaged.sample import sampler
from jaxpaged.sample.sampler import sample_jit
from jaxpaged.worker.compilation_cache import ExecutableCache
from jaxpaged.worker.kv_cache import KVCache


def step_program(graphdef, treedef, leaves, kv_cache, batch: ModelInput, all_positions: bool):
    """The pure model step (see the module); `leaves` the parameters' flat list."""
    with recording_routes() as routes:
        logits, kv_cache = forward(graphdef, jax.tree.unflatten(treedef, leaves), kv_cache,
                                   batch, all_positions)
    return (logits, None if all_positions else sampler.greedy_draw(logits),
            stacked_routes(routes), kv_cache)


def steps_program(graphdef, treedef, leaves, kv_cache, first_ids: jax.Array,
                  steps: ModelInput):
    """The pure k-step decode.

    Args:
      leaves: the parameters' flat list.
      kv_cache: the pool; donated.
      first_ids: i32[T] each row's last token (padding after the rows).
      steps: each of the k steps' `ModelInput`, stacked: every leaf has a leading axis of k
        (their `input_ids` are ignored: step 0 reads `first_ids`, step i + 1 step i's draws).

    Returns:
      ((i32[k, S] each step's argmax per row, f32[k, S] its raw log-probability, an MoE
      model's i16[k, L_moe, T, k_experts] expert ids or None), kv_cache).
    """
    params = jax.tree.unflatten(treedef, leaves)
    T = first_ids.shape[0]

    def step(carry, batch):
        ids, kv_cache = carry
        with recording_routes() as routes:
            logits, kv_cache = forward(graphdef, params, kv_cache,
                                       dataclasses.replace(batch, input_ids=ids))
        tokens, logprobs = sampler.greedy_draw(logits)
        # Row r's token sits at position r of a decode step; the padding rows' draws land on
        # padding tokens, which write nothing.
        ids = jnp.zeros((T,), jnp.int32).at[:min(T, tokens.shape[0])].set(tokens[:T])
        return (ids, kv_cache), (tokens, logprobs, stacked_routes(routes))

    (_, kv_cache), draws = jax.lax.scan(step, (first_ids, kv_cache), steps)
    return draws, kv_cache


class StepPrograms:
    """The jitted programs of one model and pool, and their executables by input shapes."""

    def __init__(self, graphdef: nnx.GraphDef, treedef, param_leaves: list[jax.Array],
                 kv_cache: KVCache, mesh, executables: ExecutableCache):
        """Under tensor parallelism (`mesh`), explicit shardings: parameters as the loader laid
        them out, the pool by KV head, the step's metadata in and its outputs replicated (the
        sampler runs on every device, so each process has the sampled tokens)."""
        self.kv_cache, self.executables = kv_cache, executables

        # Closures, not partials: the compilation cache keys a program by its qualified name,
        # and jax names its compilations after it (`jit(model_step)`, `jit(multi_step)`).
        def model_step(leaves, kv_cache, batch, all_positions):
            return step_program(graphdef, treedef, leaves, kv_cache, batch, all_positions)

        def multi_step(leaves, kv_cache, first_ids, batches):
            return steps_program(graphdef, treedef, leaves, kv_cache, first_ids, batches)

        self.replicated = None if mesh is None else NamedSharding(mesh, P())
        if mesh is None:
            self.step = jax.jit(model_step, donate_argnums=1, static_argnums=3)
            self.multi_step = jax.jit(multi_step, donate_argnums=1)
            self.copy_blocks = jax.jit(copy_blocks, donate_argnums=0)
        else:
            pool, rep = kv_cache.spec.sharding, self.replicated
            params = [x.sharding for x in param_leaves]
            self.step = jax.jit(model_step, donate_argnums=1, static_argnums=3,
                                in_shardings=(params, pool, rep),
                                out_shardings=(rep, rep, rep, pool))
            self.multi_step = jax.jit(multi_step, donate_argnums=1,
                                      in_shardings=(params, pool, rep, rep),
                                      out_shardings=((rep,) * 3, pool))
            self.copy_blocks = jax.jit(copy_blocks, donate_argnums=0, out_shardings=pool)
        self.sample = sample_jit
        # Executables by (program, input shapes): compiled or loaded, or None for one that
        # `prepare` found in the compilation cache's folder, loaded when it first runs.
        self._compiled: dict[tuple, jax.stages.Compiled | None] = {}

    @staticmethod
    def _key(jitted, args: tuple, static_args: tuple, static_kwargs: dict) -> tuple:
        # The parameters' shapes never change (`ModelRunner.replace_params` checks them).
        if jitted is not sample_jit:
            args = args[1:]
        leaves, treedef = jax.tree.flatten(args)
        return (jitted, treedef, tuple(np.shape(x) for x in leaves), static_args,
                tuple(sorted(static_kwargs.items())))

    def executable(self, jitted, args: tuple, *static_args, **static_kwargs
                   ) -> jax.stages.Compiled:
        """The executable of `jitted(*args, *static_args, **static_kwargs)` for these shapes:
        this runner's, else from the compilation cache (memory, then disk), else compiled."""
        key = self._key(jitted, args, static_args, static_kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            # XLA:CPU loads no executable while another one runs: wait for the last step.
            self.kv_cache.block_until_ready()
            compiled = self.executables.get_or_compile(jitted, args, static_args, static_kwargs)
            self._compiled[key] = compiled
        return compiled

    def prepare(self, jitted, args: tuple, static_args: tuple = (),
                static_kwargs: dict | None = None) -> None:
        """Compiles (and stores) the executable of these shapes unless the compilation cache's
        folder has it; one found there is loaded by `executable` when it first runs."""
        static_kwargs = static_kwargs or {}
        key = self._key(jitted, args, static_args, static_kwargs)
        if key not in self._compiled:
            self._compiled[key] = self.executables.get_or_compile(
                jitted, args, static_args, static_kwargs, load=False)

    def num_executables(self, jitted) -> int:
        """How many shapes of program `jitted` (`step`, `multi_step`, `sample`) have an
        executable (compiled, loaded, or found in the compilation cache to load)."""
        return sum(key[0] is jitted for key in self._compiled)

    def run_step(self, leaves: list[jax.Array], batch: ModelInput, all_positions: bool = False
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, jax.Array | None]:
        """Runs the model step on `batch`, keeping the updated pool; returns (the logits,
        unless `all_positions` each logits row's greedy draw, an MoE model's
        i16[L_moe, T, k] expert ids)."""
        args = (leaves, self.kv_cache.pool, batch)
        *out, self.kv_cache.pool = self.executable(self.step, args, all_positions)(*args)
        return tuple(out)

    def run_steps(self, leaves: list[jax.Array], first_ids: np.ndarray, steps: ModelInput):
        """Runs the k-step decode (`steps_program`), keeping the updated pool; returns its draws."""
        args = (leaves, self.kv_cache.pool, first_ids, steps)
        draws, self.kv_cache.pool = self.executable(self.multi_step, args)(*args)
        return draws

    def run_sampler(self, logits: jax.Array, md, *, all_greedy: bool, num_logprobs: int):
        """The jitted sampler's draws (`sampler.sample`), on the device."""
        return self.executable(self.sample, (logits, md), all_greedy=all_greedy,
                               num_logprobs=num_logprobs)(logits, md)

    def run_copies(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copies pool blocks `src` to `dst` (i32[n] each), in place."""
        self.kv_cache.pool = self.copy_blocks(self.kv_cache.pool, src, dst)

    def lower_step(self, leaves: list[jax.Array], batch: ModelInput) -> jax.stages.Lowered:
        """The model step lowered for `batch`'s shapes (to read its HLO)."""
        return self.step.lower(leaves, self.kv_cache.pool, batch, False)
