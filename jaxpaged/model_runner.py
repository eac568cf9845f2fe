"""The model runner: owns params and the KV pool, turns a scheduled step into device arrays.

The host builds NumPy arrays padded to buckets (steps of 1.5x; see `bucket`), so the number of
distinct shapes, and thus of compilations, stays bounded. With the "cpu" attention backend a
step's decodes and prompt chunks go packed as one row of T tokens (`prepare_packed`, vLLM's
flattened batch); otherwise decodes run as `[B, 1]` and prompt chunks as `[B, Q]` batches, Q a
power of two (`prepare_input`). On the XLA and "cpu" paths the cached blocks go as one flat list
of NB entries (`pallas_kernels.paged_attention_xla_flat`); the Pallas kernels take M block-table
columns. One jitted step `(params, kv_cache, ModelInput) -> (logits, kv_cache)` runs with the
pool donated, then the jitted sampler; only the sampled token ids come back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged import sampler
from jaxpaged.buckets import bucket, buckets_upto, next_power_of_2, pow2s
from jaxpaged.config import CacheConfig
from jaxpaged.models import ModelConfig, ModelInput, forward
from jaxpaged.pallas_kernels import PAD_SLOT_ID, copy_blocks
from jaxpaged.sampler import SamplingMetadata, num_candidates, prompt_logprobs, sample_jit
from jaxpaged.scheduler import SchedulerOutput
from jaxpaged.sequence import Sequence, completion_seed

MIN_PREFILL_BUCKET = 16  # smallest padded prompt length
WARM_UP_TOKENS = 2048  # `precompile` also runs each shape of at most this many tokens once


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float  # raw model log-probability of the token
    rank: int  # 1-based rank under the raw distribution
    # (token id, log-probability) of the `logprobs` most likely tokens, most likely first; empty
    # for logprobs=0 (only the sampled token's), None when the request asked for none
    top: list[tuple[int, float]] | None


def _padding_context(NB: int, B: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A flat context list of NB padding entries: block 0, row B (dropped), 0 tokens."""
    return np.zeros((NB,), np.int32), np.full((NB,), B, np.int32), np.zeros((NB,), np.int32)


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Pool layout `[L, 2, K, P, S, H]` (see `pallas_kernels.reference`)."""
    return (config.num_hidden_layers, 2, config.num_key_value_heads, num_blocks, block_size,
            config.head_dim)


def num_kv_blocks(config: ModelConfig, cache_config: CacheConfig, dtype) -> int:
    """Blocks in the pool: `num_kv_blocks`, or as many as `kv_cache_memory_bytes` holds."""
    if cache_config.num_kv_blocks is not None:
        return cache_config.num_kv_blocks
    bytes_per_block = (np.prod(kv_cache_shape(config, 1, cache_config.block_size))
                       * jnp.dtype(dtype).itemsize)
    return int(cache_config.kv_cache_memory_bytes // bytes_per_block)


class ModelRunner:
    def __init__(self, model: nnx.Module, cache_config: CacheConfig, num_blocks: int,
                 dtype, eos_token_ids: set[int] = frozenset(), max_num_seqs: int = 256,
                 max_model_len: int | None = None):
        self.config = model.config
        self.eos_token_ids = eos_token_ids
        self.block_size = cache_config.block_size
        # The XLA and C++ paths read only cached tokens from the pool, as one flat list of the
        # rows' blocks (no padding to the longest row). The Pallas kernels take padded block
        # tables, and read the new tokens from the pool too, so their tables must cover them.
        self.flat_context = model.attention_backend in ("xla", "cpu")
        # The C++ kernel also takes packed sequences: a step's decodes and prompt chunks go as
        # one row of T tokens (`query_start_loc`), padded only at the end (`prepare_packed`).
        self.packed = model.attention_backend == "cpu" and jnp.dtype(dtype) == jnp.float32
        self.max_num_seqs = max_num_seqs
        max_model_len = max_model_len or self.config.max_position_embeddings
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        graphdef, self.params = nnx.split(model)
        self.kv_cache = jnp.zeros(kv_cache_shape(self.config, num_blocks, self.block_size), dtype)
        self._step = jax.jit(functools.partial(forward, graphdef), donate_argnums=1,
                             static_argnames=("all_positions",))
        # Executables compiled ahead of time by `precompile`, by `_shape_key`: jax.jit does not
        # reuse what `.lower().compile()` built, and filling its cache by calling the step on
        # padding inputs would run every shape, seconds each for the largest on CPU.
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._copy_blocks = jax.jit(copy_blocks, donate_argnums=0)
        # Test-only: called with each `SchedulerOutput` at the start of `execute`; a hook that
        # raises stands for a fault in the step (tests of the engine's fault isolation).
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None

    @property
    def num_compilations(self) -> int:
        """Shapes the model step has been compiled for: by `precompile`, and by the jitted
        step for each other bucket it has run."""
        return len(self._compiled) + self._step._cache_size()

    @staticmethod
    def _shape_key(batch: ModelInput, all_positions: bool) -> tuple:
        leaves, treedef = jax.tree.flatten(batch)
        return treedef, tuple(np.shape(x) for x in leaves), all_positions

    def _run_step(self, batch: ModelInput, all_positions: bool = False) -> jax.Array:
        """Runs the model step on `batch` (its precompiled executable if there is one) and
        keeps the updated pool; returns the logits."""
        compiled = self._compiled.get(self._shape_key(batch, all_positions))
        if compiled is not None:
            logits, self.kv_cache = compiled(self.params, self.kv_cache, batch)
        else:
            logits, self.kv_cache = self._step(self.params, self.kv_cache, batch,
                                               all_positions=all_positions)
        return logits

    def bucket_shapes(self, max_num_seqs: int, max_num_batched_tokens: int,
                      max_model_len: int) -> list[tuple[int, int, int]]:
        """Every (B, Q, C) a step can be padded to under these limits: decodes `[B, 1]` and
        prompt chunks `[B, Q]` whose fewest tokens (the longest Q/2 + 1, the others 1 each) fit
        the token budget; packed steps (the "cpu" backend) are `(1, T, C)` for every T up to
        the budget, each with one flat-list length NB (`_num_context_entries`). Otherwise C
        counts cached blocks: on the XLA path the flat list's length NB (`bucket` sizes up to
        what the rows or the pool hold), else block-table columns M (0 or powers of two up to
        `max_model_len`)."""
        max_blocks = -(-max_model_len // self.block_size)
        Bs = buckets_upto(max_num_seqs)
        Qs = pow2s(MIN_PREFILL_BUCKET, max(MIN_PREFILL_BUCKET, next_power_of_2(
            min(max_num_batched_tokens, max_model_len))))

        def contexts(B: int) -> list[int]:
            if self.flat_context:
                return [0] + buckets_upto(min(B * max_blocks, self.kv_cache.shape[3]))
            return [0] + pow2s(1, next_power_of_2(max_blocks))

        def fits(B: int, Q: int) -> bool:
            longest = Q // 2 + 1 if Q > MIN_PREFILL_BUCKET else 1
            return longest + bucket(B - 1) <= max_num_batched_tokens

        if self.packed:  # (1, T, NB): T tokens of up to `_num_seqs_bucket(T)` sequences
            Ts = buckets_upto(min(max_num_batched_tokens, max_num_seqs * max_model_len))
            return [(1, T, self._num_context_entries(T)) for T in Ts]
        decodes = [(B, 1, C) for B in Bs if bucket(B - 1) + 1 <= max_num_batched_tokens
                   for C in contexts(B) if C > 0]
        prefills = [(B, Q, C) for B in Bs for Q in Qs if fits(B, Q) for C in contexts(B)]
        return decodes + prefills

    def precompile(self, shapes: list[tuple[int, int, int]], progress: bool = True) -> None:
        """Compiles the model step ahead of time for each (B, Q, C) of `bucket_shapes`, and the
        sampler's default variants (`sampler.precompile`), so that serving compiles nothing
        new. A shape of at most `WARM_UP_TOKENS` tokens is also run once on its padding-only
        input (nothing is written to the pool): an executable's first run on CPU costs
        0.1-0.5 s more than the later ones, which would otherwise land on a request. Larger
        shapes take seconds a step, and are left to pay it when met."""
        for B, Q, C in tqdm(shapes, desc="Compiling step shapes", disable=not progress):
            batch = self._padding_batch(B, Q, C)
            key = self._shape_key(batch, False)
            if key in self._compiled:
                continue
            compiled = self._step.lower(self.params, self.kv_cache, batch,
                                        all_positions=False).compile()
            self._compiled[key] = compiled
            if B * Q <= WARM_UP_TOKENS:
                # Runs while the next shape compiles (dispatch is asynchronous).
                _, self.kv_cache = compiled(self.params, self.kv_cache, batch)
        # `prepare_sampling` pads the sample count to a power of two.
        sampler.precompile(self.config.vocab_size, pow2s(1, next_power_of_2(self.max_num_seqs)))
        jax.block_until_ready(self.kv_cache)

    def _padding_batch(self, B: int, Q: int, C: int) -> ModelInput:
        """A padding-only input of shape (B, Q, C) (see `bucket_shapes`): it writes nothing."""
        if self.packed:
            return self.prepare_packed([], [], T=Q, NB=C)
        zeros, flat = np.zeros((B, Q), np.int32), self.flat_context
        return ModelInput(zeros, zeros, np.full((B, Q), PAD_SLOT_ID, np.int32),
                          np.zeros((B, 0 if flat else C), np.int32),
                          np.zeros((B,), np.int32), np.zeros((B,), np.int32),
                          *(_padding_context(C, B) if flat else ()))

    def probe(self) -> None:
        """Runs the smallest padding-only step and a greedy draw from its first logits row,
        writing nothing to the pool: whether the device and the compiled step work with no
        request in them. Raises whatever they raise (`FaultIsolatingExecutor` calls it after a
        step in which every request failed alone)."""
        if self.fault_hook is not None:
            self.fault_hook(SchedulerOutput([], [], []))
        C = self._num_context_entries(1) if self.packed else 1
        logits = self._run_step(self._padding_batch(1, 1, C))
        one = np.zeros((1,), np.int32)
        md = SamplingMetadata(temperature=one.astype(np.float32), top_k=one,
                              top_p=np.ones((1,), np.float32), seeds=np.zeros((1, 2), np.uint32),
                              output_index=one)
        jax.block_until_ready(sample_jit(logits[:1], md, all_greedy=True, num_logprobs=0))

    def execute(self, out: SchedulerOutput) -> tuple[list[list[SampledToken]], dict]:
        """Runs one scheduled step: with the "cpu" backend all its sequences packed in one call
        (`prepare_packed`), unless a row wants prompt logprobs; otherwise its decodes as one
        `[B, 1]` batch and its prompt chunks as `[B, Q]` batches by padded length (see
        `_batches`). Then one sampler call over all.

        Returns:
          (each row's sampled tokens, {row: prompt logprobs} for rows whose request asked for
          them and whose prompt this step computed). A row that completes its tokens draws
          `1 + seq.num_forks` samples (a parent about to fork into its n completions after its
          prefill); a prompt chunk with more to come draws none. Prompt logprobs are a list over
          prompt tokens 1.. of (token logprob, rank, [(id, logprob)] top-k).
        """
        if self.fault_hook is not None:
            self.fault_hook(out)
        if out.blocks_to_copy:
            self.apply_copies(out.blocks_to_copy)
        logits_parts, logits_row, prompt_lps = [], {}, {}
        batches = self._batches(out)
        # Prompt logprobs need logits at every position of a row: such steps stay padded.
        if self.packed and not any(self._wants_prompt_logprobs(s) for s in out.seqs):
            batch = self.prepare_packed(out.seqs, out.num_scheduled_tokens)
            logits_parts.append(self._run_step(batch))
            logits_row.update({row: row for row in range(len(out.seqs))})
            batches = []
        for rows, is_prefill in batches:
            seqs = [out.seqs[r] for r in rows]
            qs = [out.num_scheduled_tokens[r] for r in rows]
            batch = self.prepare_input(seqs, qs, is_prefill)
            want = [i for i, s in enumerate(seqs)
                    if is_prefill and self._wants_prompt_logprobs(s)]
            logits = self._run_step(batch, all_positions=bool(want))
            if want:
                k = max(seqs[i].params.prompt_logprobs for i in want)
                logits, *plp = prompt_logprobs(logits, batch.input_ids, batch.query_lens,
                                               num_logprobs=next_power_of_2(k) if k else 0)
                collected = self._collect_prompt_logprobs(seqs, qs, want, jax.device_get(plp))
                prompt_lps.update({rows[i]: lps for i, lps in collected.items()})
            offset = sum(part.shape[0] for part in logits_parts)
            logits_row.update({row: offset + i for i, row in enumerate(rows)})
            logits_parts.append(logits)
        logits = (logits_parts[0] if len(logits_parts) == 1
                  else jnp.concatenate(logits_parts))
        per_row = [[] for _ in out.seqs]
        samples = [(row, seq, j) for row, seq in enumerate(out.seqs) if out.completes(row)
                   for j in range(1 + seq.num_forks)]
        if not samples:
            return per_row, prompt_lps
        rows, md = self.prepare_sampling(samples, logits_row)
        num_logprobs = max((s.params.logprobs or 0) for _, s, _ in samples)
        num_logprobs = next_power_of_2(num_logprobs) if num_logprobs else 0
        res = jax.device_get(sample_jit(
            sampler.gather_rows(logits, rows), md,
            all_greedy=all(s.params.is_greedy for _, s, _ in samples),
            num_logprobs=num_logprobs))
        for i, (row, seq, _) in enumerate(samples):
            k = seq.params.logprobs
            top = (None if k is None else [] if k == 0 else
                   list(zip(res.top_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist())))
            per_row[row].append(SampledToken(int(res.token_ids[i]), float(res.logprobs[i]),
                                             int(res.ranks[i]), top))
        return per_row, prompt_lps

    @staticmethod
    def _batches(out: SchedulerOutput) -> list[tuple[list[int], bool]]:
        """The step's rows as model calls: all decodes in one `[B, 1]` batch, prompt chunks
        grouped by their padded length Q, so a short chunk is never padded to a long one's
        length (the cost of a `[B, Q]` call is B * Q tokens)."""
        decodes, by_bucket = [], {}
        for row, (seq, q) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            if q == 1 and seq.num_output_tokens > 0:
                decodes.append(row)
            else:
                by_bucket.setdefault(max(MIN_PREFILL_BUCKET, next_power_of_2(q)), []).append(row)
        batches = [(decodes, False)] if decodes else []
        return batches + [(rows, True) for _, rows in sorted(by_bucket.items())]

    @staticmethod
    def _wants_prompt_logprobs(seq: Sequence) -> bool:
        """Whether this step computes the start of a prompt whose request asked for prompt
        logprobs (only a prompt's first chunk, never chunked, gets them)."""
        return (seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is not None
                and seq.num_output_tokens == 0)

    @staticmethod
    def _collect_prompt_logprobs(seqs, qs, rows: list[int], plp) -> dict:
        target_lp, ranks, top_ids, top_lp = plp
        collected = {}
        for row in rows:
            seq, q = seqs[row], qs[row]
            k = seq.params.prompt_logprobs
            collected[row] = [
                (float(target_lp[row, i]), int(ranks[row, i]),
                 list(zip(top_ids[row, i, :k].tolist(), top_lp[row, i, :k].tolist()))
                 if k else [])
                for i in range(min(q, seq.num_prompt_tokens) - 1)]
        return collected

    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies, padded to a power of two with repeats of the first."""
        pairs = copies + [copies[0]] * (next_power_of_2(len(copies)) - len(copies))
        src, dst = (np.asarray(x, np.int32) for x in zip(*pairs))
        self.kv_cache = self._copy_blocks(self.kv_cache, src, dst)

    def prepare_input(self, seqs: list, num_new_tokens: list[int], is_prefill: bool
                      ) -> ModelInput:
        """Pads rows to buckets: B rows (`bucket`), Q new tokens per row (1 for decodes; a
        power of two of at least MIN_PREFILL_BUCKET for prompt chunks), and the cached blocks:
        a flat list of `bucket(NB)` entries on the XLA path, else M block-table columns."""
        S = self.block_size
        B = bucket(len(seqs))
        Q = 1 if not is_prefill else max(MIN_PREFILL_BUCKET, next_power_of_2(max(num_new_tokens)))
        covered = [s.num_computed_tokens + (0 if self.flat_context else q)
                   for s, q in zip(seqs, num_new_tokens)]
        num_blocks = [-(-n // S) for n in covered]
        M = 0 if self.flat_context or max(num_blocks) == 0 else next_power_of_2(max(num_blocks))

        input_ids = np.zeros((B, Q), np.int32)
        positions = np.zeros((B, Q), np.int32)
        slot_mapping = np.full((B, Q), PAD_SLOT_ID, np.int32)
        block_tables = np.zeros((B, M), np.int32)
        num_computed = np.zeros((B,), np.int32)
        query_lens = np.zeros((B,), np.int32)
        for row, (seq, q) in enumerate(zip(seqs, num_new_tokens)):
            input_ids[row, :q], positions[row, :q], slot_mapping[row, :q] = (
                self._new_tokens(seq, q))
            if M:
                block_tables[row, :num_blocks[row]] = seq.block_table[:num_blocks[row]]
            num_computed[row] = seq.num_computed_tokens
            query_lens[row] = q
        context = self._flat_context(seqs, num_blocks, B) if self.flat_context else ()
        return ModelInput(input_ids, positions, slot_mapping, block_tables, num_computed,
                          query_lens, *context)

    def _new_tokens(self, seq: Sequence, q: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The next q tokens of `seq` to compute: (token ids, positions i32[q], flat pool slots
        i32[q], `block * block_size + offset`)."""
        S = self.block_size
        first = seq.num_computed_tokens
        pos = np.arange(first, first + q)
        table = np.asarray(seq.block_table, np.int32)
        return seq.token_ids[first:first + q], pos, table[pos // S] * S + pos % S

    def _num_seqs_bucket(self, T: int) -> int:
        """Sequence slots of a packed step of T tokens: its logits rows. Tied to T, so packed
        shapes vary in T only."""
        return min(T, bucket(self.max_num_seqs))

    def _num_context_entries(self, T: int, num_blocks: int = 0) -> int:
        """Entries of a packed step's flat context list: as many cached blocks as its
        sequences can hold (`max_blocks_per_seq` each) or the pool holds, whichever is fewer,
        so that a packed step's shape depends on T alone. The kernel skips padding entries at
        the cost of reading their row ids. Only shared blocks (forks, prefix hits) can take a
        step's list past the pool's size; such a step gets the most its sequences can hold, one
        more shape for that T, compiled when first met (not by `precompile`)."""
        most = self._num_seqs_bucket(T) * self.max_blocks_per_seq
        fixed = min(most, self.kv_cache.shape[3])
        return fixed if num_blocks <= fixed else most

    def prepare_packed(self, seqs: list, num_new_tokens: list[int], T: int | None = None,
                       NB: int | None = None) -> ModelInput:
        """The step's sequences packed on one token axis, `[1, T]` with T = `bucket` of their
        tokens, decodes and prompt chunks alike (vLLM's flattened batch): sequence i's tokens
        start at `query_start_loc[i]`; only the tail past the last one is padding. The
        per-sequence arrays have `_num_seqs_bucket(T)` entries, the flat block list
        `_num_context_entries(T)` (T and NB may be given, for precompilation of padding-only
        steps)."""
        S = self.block_size
        total = sum(num_new_tokens)
        T = bucket(total) if T is None else T
        num_seqs = self._num_seqs_bucket(T)
        input_ids = np.zeros((1, T), np.int32)
        positions = np.zeros((1, T), np.int32)
        slot_mapping = np.full((1, T), PAD_SLOT_ID, np.int32)
        num_computed = np.zeros((num_seqs,), np.int32)
        query_lens = np.zeros((num_seqs,), np.int32)
        query_start_loc = np.full((num_seqs + 1,), total, np.int32)
        start = 0
        for i, (seq, q) in enumerate(zip(seqs, num_new_tokens)):
            tokens = slice(start, start + q)
            input_ids[0, tokens], positions[0, tokens], slot_mapping[0, tokens] = (
                self._new_tokens(seq, q))
            num_computed[i], query_lens[i], query_start_loc[i] = seq.num_computed_tokens, q, start
            start += q
        num_blocks = [-(-s.num_computed_tokens // S) for s in seqs]
        NB = self._num_context_entries(T, sum(num_blocks)) if NB is None else NB
        context = self._flat_context(seqs, num_blocks, num_seqs, NB)
        return ModelInput(input_ids, positions, slot_mapping, np.zeros((num_seqs, 0), np.int32),
                          num_computed, query_lens, *context, query_start_loc=query_start_loc)

    def _flat_context(self, seqs: list, num_blocks: list[int], B: int, NB: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(context_blocks, context_rows, context_lens), i32[bucket(NB)] each: the rows' cached
        blocks one after another, then padding entries (block 0, row B, 0 tokens)."""
        S = self.block_size
        blocks, rows, lens = _padding_context(bucket(sum(num_blocks)) if NB is None else NB, B)
        start = 0
        for row, (seq, n) in enumerate(zip(seqs, num_blocks)):
            end = start + n
            blocks[start:end] = seq.block_table[:n]
            rows[start:end] = row
            lens[start:end] = S
            if n:
                lens[end - 1] = seq.num_computed_tokens - (n - 1) * S
            start = end
        return blocks, rows, lens

    def prepare_sampling(self, samples: list[tuple[int, Sequence, int]],
                         logits_row: dict[int, int]) -> tuple[np.ndarray, SamplingMetadata]:
        """Per-sample arrays for `sampler.sample`, padded to a power of two R, and i32[R] the
        logits row each sample draws from.

        `samples` are (batch row, seq, j): sample j of a row drawing several uses seed
        `seq.seed + j` (mod 2**64), so the j-th of n completions equals a lone request seeded
        `seed + j` (vLLM's convention). `logits_row` maps a batch row to its logits row.
        """
        R, V = next_power_of_2(len(samples)), self.config.vocab_size
        f = {name: np.zeros((R,), np.float32) for name in
             ("temperature", "min_p", "frequency_penalty", "presence_penalty")}
        f["top_p"], f["repetition_penalty"] = np.ones((R,), np.float32), np.ones((R,), np.float32)
        row_index, top_k, output_index = (np.zeros((R,), np.int32) for _ in range(3))
        seeds = np.zeros((R, 2), np.uint32)
        params = [seq.params for _, seq, _ in samples]
        use_bias = any(p.logit_bias or p.allowed_token_ids is not None
                       or seq.num_output_tokens < p.min_tokens
                       for p, (_, seq, _) in zip(params, samples))
        use_penalties = any(p.repetition_penalty != 1 or p.frequency_penalty
                            or p.presence_penalty for p in params)
        bias = np.zeros((R, V), np.float32) if use_bias else None
        counts = np.zeros((R, V), np.int32) if use_penalties else None
        prompt_mask = np.zeros((R, V), bool) if use_penalties else None
        for i, ((row, seq, j), p) in enumerate(zip(samples, params)):
            seed = completion_seed(seq.seed, j)
            row_index[i], top_k[i] = logits_row[row], p.top_k
            output_index[i] = seq.num_output_tokens
            seeds[i] = (seed & 0xFFFFFFFF, seed >> 32)
            for name in f:
                f[name][i] = getattr(p, name)
            if use_bias:
                self._fill_bias(bias[i], seq)
            if use_penalties:
                np.add.at(counts[i], seq.output_token_ids, 1)
                prompt_mask[i, seq.token_ids[:seq.num_prompt_tokens]] = True
        md = SamplingMetadata(
            temperature=f["temperature"], top_k=top_k, top_p=f["top_p"],
            min_p=f["min_p"] if f["min_p"].any() else None, seeds=seeds,
            output_index=output_index, logit_bias=bias,
            output_counts=counts, prompt_mask=prompt_mask,
            repetition_penalty=f["repetition_penalty"] if use_penalties else None,
            frequency_penalty=f["frequency_penalty"] if use_penalties else None,
            presence_penalty=f["presence_penalty"] if use_penalties else None,
            num_candidates=num_candidates([p.top_k for p in params if not p.is_greedy],
                                          [p.top_p for p in params if not p.is_greedy], V))
        return row_index, md

    def _fill_bias(self, bias: np.ndarray, seq) -> None:
        """logit_bias, the allowed_token_ids mask, and min_tokens' mask of EOS / stop tokens."""
        p = seq.params
        if p.allowed_token_ids is not None:
            bias[:] = -np.inf
            bias[p.allowed_token_ids] = 0.0
        for token_id, value in (p.logit_bias or {}).items():
            bias[token_id] += value
        if seq.num_output_tokens < p.min_tokens:
            stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            bias[stop_ids] = -np.inf
