"""The model runner: owns params and the KV pool, turns a scheduled step into device arrays.

The host builds NumPy arrays padded to power-of-two buckets (rows B, new tokens per row Q, cached
blocks per row M), so the number of distinct shapes, and thus of compilations, stays small. One
jitted step `(params, kv_cache, ModelInput) -> (logits, kv_cache)` runs with the pool donated,
then the jitted sampler; only the sampled token ids come back to the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.config import CacheConfig
from jaxpaged.models import LlamaConfig, LlamaForCausalLM, ModelInput, forward
from jaxpaged.pallas_kernels import PAD_SLOT_ID, copy_blocks
from jaxpaged.sampler import sample_jit
from jaxpaged.scheduler import SchedulerOutput

MIN_PREFILL_BUCKET = 16  # smallest padded prompt length


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def kv_cache_shape(config: LlamaConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Pool layout `[L, 2, K, P, S, H]` (see `pallas_kernels.reference`)."""
    return (config.num_hidden_layers, 2, config.num_key_value_heads, num_blocks, block_size,
            config.head_dim)


def num_kv_blocks(config: LlamaConfig, cache_config: CacheConfig, dtype) -> int:
    """Blocks in the pool: `num_kv_blocks`, or as many as `kv_cache_memory_bytes` holds."""
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    bytes_per_block = (np.prod(kv_cache_shape(config, 1, cache_config.block_size))
                       * jnp.dtype(dtype).itemsize)
    return int(cache_config.kv_cache_memory_bytes // bytes_per_block)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache_config: CacheConfig, num_blocks: int,
                 dtype):
        self.config = model.config
        self.block_size = cache_config.block_size
        # The XLA path reads only cached tokens from the pool; the Pallas kernels read the new
        # ones there too, so their block tables must cover them.
        self.tables_cover_new_tokens = model.attention_backend != "xla"
        graphdef, self.params = nnx.split(model)
        self.kv_cache = jnp.zeros(kv_cache_shape(self.config, num_blocks, self.block_size), dtype)
        self._step = jax.jit(functools.partial(forward, graphdef), donate_argnums=1)
        self._copy_blocks = jax.jit(copy_blocks, donate_argnums=0)

    def execute(self, out: SchedulerOutput) -> list[list[int]]:
        """Runs one scheduled step; returns each row's sampled token ids.

        A row draws `1 + seq.num_forks` samples (a parent about to fork into its n completions
        after its prefill), all others one.
        """
        if out.blocks_to_copy:
            self._apply_copies(out.blocks_to_copy)
        batch = self.prepare_input(out)
        logits, self.kv_cache = self._step(self.params, self.kv_cache, batch)
        tokens = np.asarray(sample_jit(logits, *self.prepare_sampling(out), all_greedy=all(
            s.params.is_greedy for s in out.seqs))).tolist()
        per_row, i = [], 0
        for seq in out.seqs:
            per_row.append(tokens[i:i + 1 + seq.num_forks])
            i += 1 + seq.num_forks
        return per_row

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies, padded to a power of two with repeats of the first."""
        pairs = copies + [copies[0]] * (next_power_of_2(len(copies)) - len(copies))
        src, dst = (np.asarray(x, np.int32) for x in zip(*pairs))
        self.kv_cache = self._copy_blocks(self.kv_cache, src, dst)

    def prepare_input(self, out: SchedulerOutput) -> ModelInput:
        """Pads the step to buckets: B rows, Q new tokens per row, M table blocks per row."""
        S = self.block_size
        B = next_power_of_2(len(out.seqs))
        Q = 1 if not out.is_prefill else max(MIN_PREFILL_BUCKET,
                                             next_power_of_2(max(out.num_scheduled_tokens)))
        covered = [s.num_computed_tokens + (q if self.tables_cover_new_tokens else 0)
                   for s, q in zip(out.seqs, out.num_scheduled_tokens)]
        max_blocks = max(-(-n // S) for n in covered)
        M = 0 if max_blocks == 0 else next_power_of_2(max_blocks)

        input_ids = np.zeros((B, Q), np.int32)
        positions = np.zeros((B, Q), np.int32)
        slot_mapping = np.full((B, Q), PAD_SLOT_ID, np.int32)
        block_tables = np.zeros((B, M), np.int32)
        num_computed = np.zeros((B,), np.int32)
        query_lens = np.zeros((B,), np.int32)
        for row, (seq, q, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens, covered)):
            start = seq.num_computed_tokens
            pos = np.arange(start, start + q)
            table = np.asarray(seq.block_table, np.int32)
            input_ids[row, :q] = seq.token_ids[start:start + q]
            positions[row, :q] = pos
            slot_mapping[row, :q] = table[pos // S] * S + pos % S
            num_blocks = -(-n // S)
            block_tables[row, :num_blocks] = table[:num_blocks]
            num_computed[row] = start
            query_lens[row] = q
        return ModelInput(input_ids, positions, slot_mapping, block_tables, num_computed,
                          query_lens)

    def prepare_sampling(self, out: SchedulerOutput) -> tuple[np.ndarray, ...]:
        """Per-sample arrays for `sampler.sample`, padded to a power of two.

        Sample j of a row drawing several uses seed `seq.seed + j` (mod 2**64), so the j-th of
        n completions equals a lone request seeded `seed + j` (vLLM's convention).
        """
        samples = [(row, seq, j) for row, seq in enumerate(out.seqs)
                   for j in range(1 + seq.num_forks)]
        R = next_power_of_2(len(samples))
        row_index = np.zeros((R,), np.int32)
        temperature = np.zeros((R,), np.float32)
        top_k = np.zeros((R,), np.int32)
        top_p = np.ones((R,), np.float32)
        seeds = np.zeros((R, 2), np.uint32)
        output_index = np.zeros((R,), np.int32)
        for i, (row, seq, j) in enumerate(samples):
            p = seq.params
            seed = (seq.seed + j) % 2**64
            row_index[i] = row
            temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
            seeds[i] = (seed & 0xFFFFFFFF, seed >> 32)
            output_index[i] = seq.num_output_tokens
        return row_index, temperature, top_k, top_p, seeds, output_index
