"""Attention backends: one object per way of running paged attention over a packed step.

Every backend reads the same step layout (vLLM v1's flattened batch, tpu-inference's
`AttentionMetadata`): the step's T new tokens lie on one axis, decodes and prompt chunks alike,
sequence s owning tokens `query_start_loc[s] : query_start_loc[s] + query_lens[s]` at positions
`num_computed_tokens[s] ..`. Each backend builds the rest of its metadata from the scheduled
step (how it reads the cached blocks), owns its shape buckets, and writes new K/V its own way:

  "cpu"               the C++ kernel (`cpu_attention`) reads cached blocks in place, listed in
                      a flat block list of a length fixed per T; all layers' new K/V are written
                      in one scatter after the forward pass. float32 and 8-bit pools; other
                      dtypes run the "xla" code on the same metadata.
  "xla"               pure jnp (`reference.paged_attention_xla_packed`): each token gathers its
                      sequence's pages through the block table; each layer writes its new K/V
                      first. The reference, and the fallback where no C++ compiler is found;
                      it reads `max_blocks_per_seq` pages per token.
  "pallas"            the Pallas kernels (Triton on GPU): each layer writes its new K/V first;
                      decode-only steps run `paged_attention`, others `ragged_paged_attention`.
  "pallas-interpret"  the same under the Pallas interpreter (CPU tests).

`make_attention_backend` is the one place a backend is chosen. The model calls
`backend.attention(q, k, v, kv_cache, layer, metadata, spec)` with its layer's `AttentionSpec`.

Tensor parallelism: given a `jax.sharding.Mesh`, a backend runs its attention under
`jax.shard_map` over the mesh's `MODEL_AXIS`, each device on its own heads: q, k and v sharded
on their head axes, the pool on its KV-head axis (`KV_CACHE_SPEC`), the metadata replicated.
Attention needs no communication: a KV head and the query heads that read it live on one device.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxpaged.pallas_kernels import cpu_attention
from jaxpaged.pallas_kernels.paged_attention import paged_attention
from jaxpaged.pallas_kernels.ragged_paged_attention import ragged_paged_attention
from jaxpaged.pallas_kernels.reference import (PAD_SLOT_ID, QuantizedKVCache, dequantize_kv,
                                              paged_attention_xla_packed, quantize_kv, write_kv)

# The mesh axes (tpu-inference's names): tensor parallelism shards heads, the MLP's hidden
# units and the vocabulary over MODEL_AXIS; DATA_AXIS is kept for data parallelism (size 1).
DATA_AXIS, MODEL_AXIS = "data", "model"
HEADS_SPEC = P(None, MODEL_AXIS, None)  # q f[T, N, H], k and v f[T, K, H]: by head
KV_CACHE_SPEC = P(None, None, MODEL_AXIS)  # the pool f[L, 2, K, P, S, H]: by KV head


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, as every backend applies it (static under jit).

    scale: logit scale (usually head_dim ** -0.5; Gemma 2: query_pre_attn_scalar ** -0.5).
    sliding_window: a token attends only to its last `sliding_window` positions, itself
      included (Mistral, Gemma 2 local layers); None: the whole context.
    soft_cap: logits become soft_cap * tanh(logits / soft_cap) (Gemma 2); None: no cap.
    """

    scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.soft_cap is not None and self.soft_cap <= 0:
            raise ValueError(f"soft_cap must be > 0 or None, got {self.soft_cap}")


@dataclasses.dataclass(frozen=True)
class StepLimits:
    """What a backend needs to pad a step: the pool and the scheduler's limits."""

    block_size: int  # tokens per KV block
    num_blocks: int  # blocks in the pool
    max_seq_slots: int  # sequence slots of the largest step: `max_num_seqs`, padded
    max_blocks_per_seq: int  # blocks of a `max_model_len` sequence

    def num_seqs_bucket(self, T: int) -> int:
        """Sequence slots of a step of T tokens (its logits rows): tied to T, so a step's
        shapes vary in T alone."""
        return min(T, self.max_seq_slots)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """One packed step's attention inputs (int32 NumPy or jax arrays), S = sequence slots.

    Sequence slots past the real ones have `query_lens == 0`, `query_start_loc` equal to the
    real token count, and no blocks; tokens past the last sequence have `slot_mapping ==
    PAD_SLOT_ID`. A backend fills either `block_tables` (xla, Pallas) or the flat block list
    (cpu), never both.
    """

    slot_mapping: jax.Array  # i32[T] flat pool slot (`block * S + offset`) of each new token
    query_start_loc: jax.Array  # i32[S + 1] first token of each sequence
    num_computed_tokens: jax.Array  # i32[S] tokens of each sequence already in the pool
    query_lens: jax.Array  # i32[S] new tokens of each sequence
    # i32[S, max_blocks_per_seq] each sequence's blocks, cached and new tokens' (0 past them)
    block_tables: jax.Array | None = None
    context_blocks: jax.Array | None = None  # i32[NB] every sequence's cached blocks in order
    context_rows: jax.Array | None = None  # i32[NB] sequence of each (S for padding entries)
    context_lens: jax.Array | None = None  # i32[NB] cached tokens in each (0 for padding)
    # Static: every sequence has one new token (the Pallas backends run the decode kernel).
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def seq_lens(self) -> jax.Array:
        """i32[S] tokens of each sequence with its new ones."""
        return self.num_computed_tokens + self.query_lens


class AttentionBackend:
    """A way of running paged attention; subclasses set `name` and override what differs."""

    name: ClassVar[str]
    # True: each layer writes its new K/V before reading the pool; False: `attention` returns
    # them and the model writes all layers' in one scatter (`write_all_kv`).
    writes_kv_per_layer: ClassVar[bool] = True
    # The device mesh of tensor parallelism (`attention` under `shard_map`); None: one device.
    mesh: Mesh | None = None

    @classmethod
    def create(cls, dtype, batch_invariant: bool) -> AttentionBackend:
        """The backend for a pool of `dtype` (its codes' dtype for an 8-bit pool). A backend
        that is batch-invariant only in some mode turns it on with `batch_invariant`.

        Raises:
          ValueError: this backend cannot run here (naming why).
        """
        return cls()

    def variants(self, T: int, limits: StepLimits) -> list[bool]:
        """The `decode_only` values a step of T tokens can take (each one compiled shape)."""
        return [False]

    def build(self, limits: StepLimits, T: int,
              seqs: list[tuple[list[int], int, int]], decode_only: bool | None = None
              ) -> AttentionMetadata:
        """The metadata of a step of T tokens (padded) whose sequences are
        `(block_table, num_computed_tokens, num_new_tokens)`, packed in that order; with no
        sequences, a padding-only step (it writes nothing) of variant `decode_only`."""
        tables = np.zeros((len(seqs), limits.max_blocks_per_seq), np.int32)
        for i, (table, _, _) in enumerate(seqs):
            table = table[:limits.max_blocks_per_seq]  # blocks past max_model_len go unread
            tables[i, :len(table)] = table
        return self.build_from_arrays(
            limits, T, tables, np.array([c for _, c, _ in seqs], np.int32),
            np.array([q for _, _, q in seqs], np.int32), decode_only)

    def build_from_arrays(self, limits: StepLimits, T: int, block_tables: np.ndarray,
                          num_computed_tokens: np.ndarray, query_lens: np.ndarray,
                          decode_only: bool | None = None) -> AttentionMetadata:
        """`build` from arrays (the runner's persistent input batch), n real sequences.

        Args:
          block_tables: i32[n, max_blocks_per_seq] each sequence's blocks; entries past the
            blocks of its cached and new tokens are ignored.
          num_computed_tokens: i32[n] tokens of each sequence already in the pool.
          query_lens: i32[n] new tokens of each sequence (their sum at most T).
          decode_only: the variant; None: decided from `query_lens`.
        """
        S, B, n = limits.block_size, limits.num_seqs_bucket(T), len(query_lens)
        assert n <= B, (n, T)
        total = int(query_lens.sum())
        starts = np.cumsum(query_lens) - query_lens
        token_row = np.repeat(np.arange(n), query_lens)
        pos = num_computed_tokens[token_row] + np.arange(total) - starts[token_row]
        slot_mapping = np.full((T,), PAD_SLOT_ID, np.int32)
        slot_mapping[:total] = block_tables[token_row, pos // S] * S + pos % S
        num_computed, lens = np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        num_computed[:n], lens[:n] = num_computed_tokens, query_lens
        query_start_loc = np.full((B + 1,), total, np.int32)
        query_start_loc[:n] = starts
        if decode_only is None:  # only backends with a decode-only variant tell them apart
            decode_only = (n > 0 and bool((query_lens == 1).all())
                           and True in self.variants(T, limits))
        return AttentionMetadata(slot_mapping, query_start_loc, num_computed, lens,
                                 decode_only=decode_only,
                                 **self._blocks(limits, T, B, block_tables,
                                                num_computed_tokens, query_lens))

    def _blocks(self, limits: StepLimits, T: int, B: int, block_tables: np.ndarray,
                num_computed_tokens: np.ndarray, query_lens: np.ndarray
                ) -> dict[str, np.ndarray]:
        """How this backend reads the sequences' blocks: `block_tables` over cached and new
        tokens, `max_blocks_per_seq` columns (the xla and Pallas backends)."""
        S, n = limits.block_size, len(query_lens)
        num_blocks = -(-(num_computed_tokens + query_lens) // S)
        tables = np.zeros((B, limits.max_blocks_per_seq), np.int32)
        tables[:n] = np.where(np.arange(tables.shape[1]) < num_blocks[:, None],
                              block_tables, 0)
        return {"block_tables": tables}

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
                  layer: int, md: AttentionMetadata, spec: AttentionSpec):
        """One layer's causal paged attention over a packed step.

        Args:
          q: f[T, N, H]; k, v: f[T, K, H] the new tokens' projections (RoPE applied).
          kv_cache: f[L, 2, K, P, S, H] the whole pool; `layer` (a Python int) is this layer's.
          md: the step's `AttentionMetadata` from this backend's `build`.
          spec: the layer's `AttentionSpec`.

        Returns:
          (out f[T, N, H], kv_cache, new_kv): new_kv is None when the layer's K/V are already
          in the returned pool (`writes_kv_per_layer`), else (k, v) to write after all layers.
          Rows of padding tokens hold finite garbage or 0.
        """
        if self.mesh is None:
            return self._attention(q, k, v, kv_cache, layer, md, spec)
        kv_spec = None if self.writes_kv_per_layer else (HEADS_SPEC, HEADS_SPEC)
        return jax.shard_map(
            lambda q, k, v, c, md: self._attention(q, k, v, c, layer, md, spec), mesh=self.mesh,
            in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, KV_CACHE_SPEC, P()),
            out_specs=(HEADS_SPEC, KV_CACHE_SPEC, kv_spec))(q, k, v, kv_cache, md)

    def _attention(self, q, k, v, kv_cache, layer: int, md: AttentionMetadata,
                   spec: AttentionSpec):
        """`attention` on one device's heads (all of them without a mesh)."""
        raise NotImplementedError

    def write_all_kv(self, kv_cache: jax.Array, k: jax.Array, v: jax.Array,
                     md: AttentionMetadata) -> jax.Array:
        """Writes every layer's new K/V, k and v f[L, T, K, H], into the pool at
        `md.slot_mapping` (backends without `writes_kv_per_layer`), each device its own heads."""
        if self.mesh is None:
            return write_kv(kv_cache, k, v, md.slot_mapping)
        heads = P(None, None, MODEL_AXIS)
        return jax.shard_map(write_kv, mesh=self.mesh,
                             in_specs=(KV_CACHE_SPEC, heads, heads, P()),
                             out_specs=KV_CACHE_SPEC)(kv_cache, k, v, md.slot_mapping)

    @staticmethod
    def _write(kv_cache, k, v, md: AttentionMetadata, layer: int):
        # Written before the layer reads the pool: each layer's write depends (through the
        # hidden state) on the previous layer's reads, so XLA orders them without copying.
        return write_kv(kv_cache, k[None], v[None], md.slot_mapping, layer=layer)


def layer_pages(kv_cache, layer: int) -> tuple[jax.Array, jax.Array, dict]:
    """One layer's (k_pages, v_pages, scales): f[K, P, S, H] each, and for an 8-bit pool its
    codes with `{"k_scales", "v_scales"}` f32[K, P, S] (else {})."""
    if isinstance(kv_cache, QuantizedKVCache):
        k, v, ks, vs = kv_cache.layer(layer)
        return k, v, {"k_scales": ks, "v_scales": vs}
    return kv_cache[layer, 0], kv_cache[layer, 1], {}


class XlaBackend(AttentionBackend):
    name = "xla"

    def _attention(self, q, k, v, kv_cache, layer, md, spec):
        kv_cache = self._write(kv_cache, k, v, md, layer)
        k_pages, v_pages, scales = layer_pages(kv_cache, layer)
        out = paged_attention_xla_packed(
            q, k_pages, v_pages, md.block_tables, md.seq_lens,
            md.query_start_loc, scale=spec.scale, sliding_window=spec.sliding_window,
            soft_cap=spec.soft_cap, **scales)
        return out, kv_cache, None


class PallasBackend(AttentionBackend):
    name = "pallas"
    interpret: ClassVar[bool] = False

    def variants(self, T, limits):
        return [False, True] if T <= limits.num_seqs_bucket(T) else [False]

    def _attention(self, q, k, v, kv_cache, layer, md, spec):
        kv_cache = self._write(kv_cache, k, v, md, layer)
        k_pages, v_pages, scales = layer_pages(kv_cache, layer)
        kw = dict(scale=spec.scale, soft_cap=spec.soft_cap, sliding_window=spec.sliding_window,
                  interpret=self.interpret, **scales)
        if md.decode_only:
            # Sequence s's one token is token s (`build_from_arrays`), and a padding row's
            # context is 0 (its output 0): q and the output are the B sequence rows' as they
            # lie, cut or padded to T, with no gather or scatter.
            T, B = q.shape[0], md.seq_lens.shape[0]
            rows = jnp.pad(q, ((0, max(0, B - T)), (0, 0), (0, 0)))[:B]
            out = paged_attention(rows, k_pages, v_pages, md.block_tables, md.seq_lens, **kw)
            return jnp.pad(out, ((0, max(0, T - B)), (0, 0), (0, 0)))[:T], kv_cache, None
        num_seqs = jnp.sum(md.query_lens > 0, dtype=jnp.int32)
        out = ragged_paged_attention(q, k_pages, v_pages, md.block_tables, md.seq_lens,
                                     md.query_start_loc, num_seqs, **kw)
        # The kernel leaves the padding tokens' rows unwritten.
        real = jnp.arange(q.shape[0]) < md.query_start_loc[-1]
        return jnp.where(real[:, None, None], out, 0), kv_cache, None


class PallasInterpretBackend(PallasBackend):
    name = "pallas-interpret"
    interpret = True


class CpuBackend(AttentionBackend):
    """The C++ kernel; `float32=False` (a bfloat16 or float16 pool) runs the "xla" code
    instead. 8-bit pools (`QuantizedKVCache`) count as float32 ones: the kernel decodes them."""

    name = "cpu"

    @classmethod
    def create(cls, dtype, batch_invariant: bool) -> CpuBackend:
        if not cpu_attention.available():
            raise ValueError("attention_backend 'cpu' needs the C++ kernel, which could not be "
                             "built here (see the log); use 'xla'")
        return cls(float32=jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16),
                   invariant=batch_invariant)

    def __init__(self, float32: bool = True, invariant: bool = False):
        self.float32 = float32
        self.invariant = invariant  # the kernel's batch-invariant order (`paged_attention_cpu`)
        self._xla = None if float32 else XlaBackend()
        self.writes_kv_per_layer = not float32

    def _blocks(self, limits, T, B, block_tables, num_computed_tokens, query_lens):
        if not self.float32:
            return super()._blocks(limits, T, B, block_tables, num_computed_tokens, query_lens)
        S = limits.block_size
        num_blocks = -(-num_computed_tokens // S)  # cached blocks of each sequence
        total = int(num_blocks.sum())
        NB = self.num_context_entries(limits, T, total)
        blocks, rows = np.zeros((NB,), np.int32), np.full((NB,), B, np.int32)
        lens = np.zeros((NB,), np.int32)
        row = np.repeat(np.arange(len(num_blocks)), num_blocks)
        col = np.arange(total) - np.repeat(np.cumsum(num_blocks) - num_blocks, num_blocks)
        blocks[:total], rows[:total] = block_tables[row, col], row
        # Every block full but each sequence's last, which holds the rest of its tokens.
        lens[:total] = np.where(col == num_blocks[row] - 1,
                                num_computed_tokens[row] - col * S, S)
        return {"context_blocks": blocks, "context_rows": rows, "context_lens": lens}

    @staticmethod
    def num_context_entries(limits: StepLimits, T: int, num_blocks: int = 0) -> int:
        """Entries of a step's flat block list: as many cached blocks as its sequences can
        hold or the pool holds, whichever is fewer, so the shape depends on T alone (the kernel
        skips padding entries at the cost of reading their row ids). Only shared blocks (forks,
        prefix hits) can take a step's list past the pool's size; such a step gets the most its
        sequences can hold, one more shape for that T, compiled when first met."""
        most = limits.num_seqs_bucket(T) * limits.max_blocks_per_seq
        fixed = min(most, limits.num_blocks)
        return fixed if num_blocks <= fixed else most

    def _attention(self, q, k, v, kv_cache, layer, md, spec):
        if self._xla is not None:
            return self._xla._attention(q, k, v, kv_cache, layer, md, spec)
        k_att, v_att = k, v
        if isinstance(kv_cache, QuantizedKVCache):
            # The step's own tokens are attended to as the pool will hold them (8-bit), as
            # the backends that write before reading see them: then a token's output does not
            # depend on whether an earlier token came in this step or a previous one (chunking,
            # prefix hits, batch invariance).
            k_att, v_att = (dequantize_kv(*quantize_kv(x, kv_cache.dtype), x.dtype)
                            for x in (k, v))
        out, kv_cache = cpu_attention.paged_attention_cpu(
            q, k_att, v_att, kv_cache, layer, md.query_start_loc, md.query_lens,
            md.context_blocks,
            md.context_rows, md.context_lens, scale=spec.scale,
            sliding_window=spec.sliding_window, soft_cap=spec.soft_cap,
            invariant=self.invariant)
        return out.astype(q.dtype), kv_cache, (k, v)


# The backends `attention_backend=` names ("auto" is the platform's choice among them, resolved
# before `make_attention_backend`). Register one with one line: `ATTENTION_BACKENDS[name] = cls`.
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "cpu": CpuBackend, "pallas": PallasBackend, "pallas-interpret": PallasInterpretBackend,
    "xla": XlaBackend}


def make_attention_backend(name: str, dtype=jnp.float32, mesh: Mesh | None = None,
                           batch_invariant: bool = False) -> AttentionBackend:
    """The backend registered as `name` (`ATTENTION_BACKENDS`; "auto" is resolved by the
    engine's platform first: `jaxpaged.platforms`) for the pool's dtype (of its codes for an
    8-bit pool); with `mesh`, sharded over its `MODEL_AXIS`; with `batch_invariant`, in its
    batch-invariant mode where it has one (the C++ kernel's order; xla is invariant as it is).

    Raises:
      ValueError: an unknown name, "auto" (not resolved), or "cpu" where the C++ kernel
        cannot be built.
    """
    if name == "auto":
        raise ValueError("attention_backend 'auto' is resolved by the platform first: "
                         "jaxpaged.platforms.current_platform().attention_backend('auto')")
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend {name!r} is not one of "
                         f"{('auto', *ATTENTION_BACKENDS)}")
    backend = ATTENTION_BACKENDS[name].create(dtype, batch_invariant)
    backend.mesh = mesh
    return backend
