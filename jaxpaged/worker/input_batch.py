"""The runner's persistent input batch (vLLM v1's `gpu_input_batch.InputBatch`).

Rows are keyed by sequence (`Sequence.seq_id`) and live across steps: a row's block table and
its sampling parameters are written once when the sequence joins, and a later step copies only
what changed (the block table from the block its new tokens land in: appended blocks and
copy-on-write replacements). Rows leave when the scheduler says their sequence finished or was
preempted (`SchedulerOutput.finished_seq_ids`, `preempted`); a full batch also drops the rows
the current step does not use, so a caller that tells nothing (the draft proposer) stays right.

Sampling metadata is kept per row and sparse: logit bias as (ids, values), allowed tokens and
min_tokens' stop tokens as id lists, penalties' prompt and output tokens as ids. The dense
f32[R, V] bias and i32[R, V] / bool[R, V] penalty arrays are built on the device
(`densify_jit`), only for steps whose samples use them.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.core.sequence import Sequence, completion_seed
from jaxpaged.sample.sampler import TOP_P_CANDIDATES, SamplingMetadata
from jaxpaged.sample.structured_outputs import allocate_bitmask, fill_bitmask
from jaxpaged.worker.buckets import next_power_of_2

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")


def _pad_ids(rows: list[np.ndarray], fill: int = 0) -> np.ndarray:
    """i32[len(rows), L] the id lists padded with `fill` to a power of two L."""
    L = next_power_of_2(max([len(r) for r in rows] + [1]))
    out = np.full((len(rows), L), fill, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _mark(R: int, V: int, ids, num):
    """bool[R, V] True at each row's first `num` (i32[R, 1]) ids of i32[R, K]."""
    valid = jnp.arange(ids.shape[1])[None, :] < num
    return jnp.zeros((R, V), bool).at[jnp.arange(R)[:, None], jnp.where(valid, ids, V)].set(
        True, mode="drop")


def densify(vocab_size: int, bias_ids, bias_values, allowed_ids, num_allowed, stop_ids,
            num_stop, token_ids, num_prompt, num_tokens):
    """The dense per-sample arrays `sampler.sample` reads, from sparse per-row data (R rows).

    Args:
      bias_ids, bias_values: i32[R, Kb], f32[R, Kb] logit_bias (0 values pad), or None.
      allowed_ids, num_allowed: i32[R, Ka], i32[R] allowed tokens (num_allowed 0: all), or None.
      stop_ids, num_stop: i32[R, Ks], i32[R] tokens masked by min_tokens, or None.
      token_ids, num_prompt, num_tokens: i32[R, L], i32[R], i32[R] each row's tokens, prompt
        first (penalties), or None.

    Returns:
      (logit_bias f32[R, V] or None, output_counts i32[R, V] or None, prompt_mask bool[R, V]
      or None): as the host built them before, allowed mask, then bias, then min_tokens.
    """
    bias = counts = prompt_mask = None
    if bias_ids is not None:
        R = bias_ids.shape[0]
        bias = jnp.zeros((R, vocab_size), jnp.float32)
        if allowed_ids is not None:
            allowed = _mark(R, vocab_size, allowed_ids, num_allowed[:, None])
            bias = jnp.where((num_allowed[:, None] > 0) & ~allowed, -jnp.inf, bias)
        bias = bias.at[jnp.arange(R)[:, None], bias_ids].add(bias_values)
        if stop_ids is not None:
            stopped = _mark(R, vocab_size, stop_ids, num_stop[:, None])
            bias = jnp.where(stopped, -jnp.inf, bias)
    if token_ids is not None:
        R, L = token_ids.shape
        rows = jnp.arange(R)[:, None]
        pos = jnp.arange(L)[None, :]
        is_output = (pos >= num_prompt[:, None]) & (pos < num_tokens[:, None])
        counts = jnp.zeros((R, vocab_size), jnp.int32).at[rows, token_ids].add(
            is_output.astype(jnp.int32))
        prompt_mask = _mark(R, vocab_size, token_ids, num_prompt[:, None])
    return bias, counts, prompt_mask


densify_jit = jax.jit(densify, static_argnums=0)


class InputBatch:
    """Persistent per-sequence rows: block tables and sampling parameters.

    Args:
      max_num_rows: rows held at most (the runner's `max_num_seqs`, more rows drop the ones
        the current step does not use).
      max_blocks_per_seq: block table columns.
      vocab_size: V.
      eos_token_ids: the tokens min_tokens masks (with each request's stop_token_ids).
      sharding: the dense sampling arrays' sharding (tensor parallelism's replicated one), or
        None: the default device.
    """

    def __init__(self, max_num_rows: int, max_blocks_per_seq: int, vocab_size: int,
                 eos_token_ids=frozenset(), sharding=None):
        self.sharding = sharding  # where the dense arrays go (None: the default device)
        self.max_num_rows, self.vocab_size = max_num_rows, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.free_rows = list(range(max_num_rows - 1, -1, -1))
        self.block_tables = np.zeros((max_num_rows, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros((max_num_rows,), np.int32)  # block table lengths
        self.num_computed = np.zeros((max_num_rows,), np.int32)  # at the last sync
        # Sampling parameters; row `max_num_rows` holds the padding samples' values.
        n = max_num_rows + 1
        self.f = {name: np.zeros((n,), np.float32) for name in _FLOAT_FIELDS}
        for name in ("top_p", "repetition_penalty"):
            self.f[name][:] = 1.0
        self.top_k = np.zeros((n,), np.int32)
        self.seeds = np.zeros((n, 2), np.uint32)
        self.processed = np.zeros((n,), bool)
        # Per row: (bias ids, values), allowed ids, min_tokens stop ids, penalties' prompt ids.
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_num_rows
        self.allowed: list[np.ndarray | None] = [None] * max_num_rows
        self.stop_ids: list[np.ndarray | None] = [None] * max_num_rows
        self.prompt_ids: list[np.ndarray | None] = [None] * max_num_rows
        self._version = 0  # bumped when a row is added or dropped
        self._static_key, self._static = None, None  # `_static_metadata`'s last rows

    @property
    def num_rows(self) -> int:
        return len(self.row_of)

    def remove(self, seq_ids) -> None:
        """Drops the rows of `seq_ids` (those not held are ignored)."""
        for seq_id in seq_ids:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self.free_rows.append(row)
                self._version += 1

    def _add(self, seq: Sequence, keep: set[int]) -> int:
        if not self.free_rows:  # drop every row the step does not use
            self.remove([s for s in list(self.row_of) if s not in keep])
        if not self.free_rows:
            raise ValueError(f"a step of more than {self.max_num_rows} sequences")
        row = self.row_of[seq.seq_id] = self.free_rows.pop()
        self._version += 1  # the rows' parameters changed: `_static_metadata` recomputes
        p = seq.params
        for name in _FLOAT_FIELDS:
            self.f[name][row] = getattr(p, name)
        self.top_k[row] = p.top_k
        if p.is_greedy:  # argmax of the whole row: no truncation, whatever the batch needs
            self.top_k[row], self.f["top_p"][row], self.f["min_p"][row] = 0, 1.0, 0.0
        self.seeds[row] = (seq.seed & 0xFFFFFFFF, seq.seed >> 32)
        self.processed[row] = p.logprobs_mode == "processed"
        self.bias[row] = ((np.fromiter(p.logit_bias.keys(), np.int32, len(p.logit_bias)),
                           np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias)))
                          if p.logit_bias else None)
        self.allowed[row] = (None if p.allowed_token_ids is None
                             else np.asarray(p.allowed_token_ids, np.int32))
        self.stop_ids[row] = np.asarray(list(p.stop_token_ids) + (
            [] if p.ignore_eos else self.eos_token_ids), np.int32) if p.min_tokens else None
        self.prompt_ids[row] = None
        self.num_blocks[row] = self.num_computed[row] = 0
        return row

    def sync(self, seqs: list[Sequence], block_size: int) -> np.ndarray:
        """i32[len(seqs)] the rows of the step's sequences, adding the new ones and copying
        each block table from the block its new tokens land in (the blocks before it do not
        change while the sequence runs; one that went back, as a preempted sequence does, is
        copied whole)."""
        rows = np.empty((len(seqs),), np.int32)
        keep = None
        for i, seq in enumerate(seqs):
            row = self.row_of.get(seq.seq_id)
            if row is None:
                keep = keep or {s.seq_id for s in seqs}
                row = self._add(seq, keep)
            computed, table = seq.num_computed_tokens, seq.block_table
            lo = (0 if computed < self.num_computed[row]
                  else min(computed // block_size, int(self.num_blocks[row])))
            hi = min(len(table), self.block_tables.shape[1])
            if lo < hi:  # most decode steps add no block and change none
                self.block_tables[row, lo:hi] = table[lo:hi]
            self.num_blocks[row], self.num_computed[row] = hi, computed
            rows[i] = row
        return rows

    def sampling_metadata(self, samples: list[tuple[int, Sequence, int, list[int]]]
                          ) -> SamplingMetadata:
        """`SamplingMetadata` for `samples` (logits row, seq, j, proposals) of sequences
        `sync` has added, padded to R = next power of two; see
        `ModelRunner.prepare_sampling`."""
        rows = self._rows_of(samples)
        n, R, V = len(samples), len(rows), self.vocab_size
        static = self._static_metadata(rows)
        seeds = static["seeds"]
        output_index = np.zeros((R,), np.int32)
        output_index[:n] = [seq.num_output_tokens + len(pr) for _, seq, _, pr in samples]
        for i, (_, seq, j, _) in enumerate(samples):
            if j:  # completion j of a row drawing several (never changes the kept seeds)
                seeds = seeds.copy() if seeds is static["seeds"] else seeds
                seed = completion_seed(seq.seed, j)
                seeds[i] = (seed & 0xFFFFFFFF, seed >> 32)
        f, use_penalties = static["f"], static["use_penalties"]
        bias, counts, prompt_mask = (self._dense(samples, rows[:n], R, use_penalties)
                                     if static["uses_dense"] else (None, None, None))
        bitmask = None
        if any(seq.matcher is not None for _, seq, _, _ in samples):
            bitmask = allocate_bitmask(R, V)
            for i, (_, seq, _, _) in enumerate(samples):
                if seq.matcher is not None:
                    fill_bitmask(seq.matcher, bitmask, i)
        return SamplingMetadata(
            temperature=f["temperature"], top_k=static["top_k"], top_p=f["top_p"],
            min_p=f["min_p"] if static["use_min_p"] else None, seeds=seeds,
            output_index=output_index, logit_bias=bias, token_bitmask=bitmask,
            output_counts=counts, prompt_mask=prompt_mask,
            repetition_penalty=f["repetition_penalty"] if use_penalties else None,
            frequency_penalty=f["frequency_penalty"] if use_penalties else None,
            presence_penalty=f["presence_penalty"] if use_penalties else None,
            processed_logprobs=static["processed"], num_candidates=static["num_candidates"])

    def _rows_of(self, samples: list[tuple[int, Sequence, int, list[int]]]) -> np.ndarray:
        """i32[R]: each sample's row, padded to R = next power of two with `max_num_rows`."""
        rows = np.full((next_power_of_2(len(samples)),), self.max_num_rows, np.int32)
        rows[:len(samples)] = [self.row_of[seq.seq_id] for _, seq, _, _ in samples]
        return rows

    def _static_metadata(self, rows: np.ndarray) -> dict:
        """What a step's metadata takes from its rows' parameters alone: the same while the
        same rows sample (most decode steps), so kept from the last step until a row changes."""
        key = (self._version, rows.tobytes())
        if self._static_key == key:
            return self._static
        f = {name: a[rows] for name, a in self.f.items()}
        top_k, processed = self.top_k[rows], self.processed[rows]
        # Greedy rows hold top_k 0 and top_p 1 (`_add`): they truncate nothing.
        truncating = (top_k > 0) & (top_k < self.vocab_size)
        need = max(int(top_k[truncating].max(initial=0)),
                   TOP_P_CANDIDATES if (~truncating & (f["top_p"] < 1)).any() else 0)
        use_penalties = bool((f["repetition_penalty"] != 1).any()
                             or f["frequency_penalty"].any() or f["presence_penalty"].any())
        used = [r for r in rows.tolist() if r < self.max_num_rows]
        uses_dense = use_penalties or any(
            self.bias[r] is not None or self.allowed[r] is not None
            or self.stop_ids[r] is not None for r in used)
        self._static_key, self._static = key, dict(
            f=f, top_k=top_k, seeds=self.seeds[rows],
            processed=processed if processed.any() else None, use_min_p=bool(f["min_p"].any()),
            use_penalties=use_penalties, uses_dense=uses_dense,
            num_candidates=0 if need == 0 else min(self.vocab_size, next_power_of_2(need)))
        return self._static

    def _dense(self, samples, rows: np.ndarray, R: int, use_penalties: bool):
        """(logit_bias, output_counts, prompt_mask) on the device, or None each where no
        sample uses it."""
        stops = [self.stop_ids[r] if seq.num_output_tokens < seq.params.min_tokens else None
                 for (_, seq, _, _), r in zip(samples, rows)]
        use_bias = any(self.bias[r] is not None or self.allowed[r] is not None for r in rows) \
            or any(s is not None for s in stops)
        if not use_bias and not use_penalties:
            return None, None, None
        empty = np.zeros((0,), np.int32)
        pad = [empty] * (R - len(rows))
        args = [None] * 9
        if use_bias:
            bias = [self.bias[r] or (empty, empty) for r in rows]
            args[0] = _pad_ids([b[0] for b in bias] + pad)
            args[1] = np.zeros(args[0].shape, np.float32)
            for i, (_, values) in enumerate(bias):
                args[1][i, :len(values)] = values
            if any(self.allowed[r] is not None for r in rows):
                allowed = [empty if self.allowed[r] is None else self.allowed[r] for r in rows]
                args[2] = _pad_ids(allowed + pad)
                args[3] = np.array([len(a) for a in allowed + pad], np.int32)
            if any(s is not None for s in stops):
                stops = [empty if s is None else s for s in stops]
                args[4] = _pad_ids(stops + pad)
                args[5] = np.array([len(s) for s in stops + pad], np.int32)
        if use_penalties:
            tokens = []
            for (_, seq, _, _), r in zip(samples, rows):
                if self.prompt_ids[r] is None:
                    self.prompt_ids[r] = np.asarray(seq.token_ids[:seq.num_prompt_tokens],
                                                    np.int32)
                tokens.append((self.prompt_ids[r], seq.output_token_ids))
            args[6] = _pad_ids([np.concatenate([p, np.asarray(o, np.int32)])
                                for p, o in tokens] + pad)
            args[7] = np.array([len(p) for p, _ in tokens] + [0] * len(pad), np.int32)
            args[8] = np.array([len(p) + len(o) for p, o in tokens] + [0] * len(pad),
                               np.int32)
        dense = densify_jit(self.vocab_size, *args)
        return dense if self.sharding is None else jax.device_put(dense, self.sharding)
