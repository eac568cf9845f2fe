"""Llama-family decoder in Flax NNX (Llama 2/3, SmolLM2) over the paged KV pool.

Matches `transformers.models.llama.modeling_llama.LlamaForCausalLM`: pre-norm decoder layers with
RMSNorm, rotary position embeddings (rotate-half convention), grouped-query attention and a SwiGLU
MLP; tied or untied output embeddings. The layers are separate modules (`layers[i]`, HF's tree)
run by a Python loop, so each layer's matmuls read its weights where they lie. A `lax.scan` over
stacked weights compiles in less time (XLA compiles each layer here), but on CPU XLA copies each
layer's weight slice before its matmuls, which cost about 7% of a 32-sequence decode step.

The forward pass reads cached K/V from the pool through block tables, attends over the cached and
new tokens. With the C++ "cpu" kernel the new tokens' K/V of all layers are written in one
scatter at the end (`pallas_kernels.write_kv`); the "xla" and Pallas backends write each layer's
before reading the pool (see `pallas_kernels.attention`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged import pallas_kernels
from jaxpaged.models.config import LlamaConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelInput:
    """One step's batch, padded to bucket sizes by the host (all int32 NumPy or jax arrays).

    Row b holds `query_lens[b]` new tokens; slots past it (and rows past the real batch) are
    padding with `query_lens == 0` and `slot_mapping == PAD_SLOT_ID`. The rows' cached blocks
    come either as padded `block_tables` (the Pallas kernels) or, when `context_blocks` is set,
    as one flat list (the XLA path, `pallas_kernels.paged_attention_xla_flat`; `block_tables`
    is then `[B, 0]`).
    """

    input_ids: jax.Array  # i32[B, Q] new token ids
    positions: jax.Array  # i32[B, Q] their positions in the sequence
    slot_mapping: jax.Array  # i32[B, Q] flat pool slot each new token's K/V is written to
    block_tables: jax.Array  # i32[B, M] blocks of each row's cached (Pallas: and new) tokens
    num_computed_tokens: jax.Array  # i32[B] tokens of the row already in the pool
    query_lens: jax.Array  # i32[B] new tokens in the row (0 for padding rows)
    context_blocks: jax.Array | None = None  # i32[NB] every row's cached blocks, row by row
    context_rows: jax.Array | None = None  # i32[NB] row of each (B for padding entries)
    context_lens: jax.Array | None = None  # i32[NB] cached tokens in each (0 for padding)
    # Packed layout (the "cpu" backend): i32[S + 1] first token of each of S sequences in the
    # one row of T tokens (B = 1, Q = T); the per-row arrays above are then per sequence.
    query_start_loc: jax.Array | None = None


class RMSNorm(nnx.Module):
    """`LlamaRMSNorm`: normalizes in float32, scales in the input dtype."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def _linear(d_in: int, d_out: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x: f[B, Q, heads, H] by angles cos, sin: f32[B, Q, H] (HF `rotate_half` style)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class LlamaAttention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs):
        D, N, K, H = (config.hidden_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        self.attention_backend = attention_backend
        # HF's q_proj, k_proj and v_proj side by side (see `loader.LLAMA_NAME_MAP`): one matmul
        # instead of three, which XLA's CPU GEMMs run faster at the step's small token counts.
        self.qkv_proj = _linear(D, (N + 2 * K) * H, dtype, rngs)
        self.o_proj = _linear(N * H, D, dtype, rngs)

    def __call__(self, x, cos, sin, kv_cache, layer: int, batch: ModelInput):
        # x: [B, Q, D]; kv_cache: [L, 2, K, P, S, H] the whole pool, this layer's at `layer`.
        B, Q, _ = x.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = jnp.split(self.qkv_proj(x), [N * H, (N + K) * H], axis=-1)
        q = apply_rope(q.reshape(B, Q, N, H), cos, sin)
        k = apply_rope(k.reshape(B, Q, K, H), cos, sin)
        v = v.reshape(B, Q, K, H)
        context = (None if batch.context_blocks is None else
                   (batch.context_blocks, batch.context_rows, batch.context_lens))
        out, kv_cache, new_kv = pallas_kernels.attention(
            self.attention_backend, q, k, v, kv_cache, layer, batch.slot_mapping,
            batch.block_tables, batch.num_computed_tokens, batch.query_lens, scale=H ** -0.5,
            context=context, query_start_loc=batch.query_start_loc)
        return self.o_proj(out.reshape(B, Q, N * H)), kv_cache, new_kv


class LlamaMLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        D, F = config.hidden_size, config.intermediate_size
        self.gate_up_proj = _linear(D, 2 * F, dtype, rngs)  # HF's gate_proj, then up_proj
        self.down_proj = _linear(F, D, dtype, rngs)

    def __call__(self, x):
        gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(jax.nn.silu(gate) * up)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(config, dtype=dtype, attention_backend=attention_backend,
                                        rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                dtype=dtype)
        self.mlp = LlamaMLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv_cache, layer: int, batch: ModelInput):
        attn, kv_cache, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache,
                                                layer, batch)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv_cache, new_kv


class LlamaForCausalLM(nnx.Module):
    """The model; `__call__(kv_cache, batch) -> (logits, kv_cache)` is one engine step.

    Parameters follow HF's module tree: `layers.{i}.self_attn.o_proj.kernel: f[N*H, D]` holds
    HF's `model.layers.{i}.self_attn.o_proj.weight` transposed (see `models.loader`), except that
    q/k/v and gate/up are stacked along the output axis, as vLLM stacks them:
    `self_attn.qkv_proj.kernel: f[D, (N + 2K) * H]` and `mlp.gate_up_proj.kernel: f[D, 2F]`.
    """

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs):
        self.config = config
        self.attention_backend = pallas_kernels.resolve_attention_backend(attention_backend)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([
            LlamaDecoderLayer(config, dtype=dtype, attention_backend=self.attention_backend,
                              rngs=rngs)
            for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if config.tie_word_embeddings
                        else _linear(config.hidden_size, config.vocab_size, dtype, rngs))

    def __call__(self, kv_cache: jax.Array, batch: ModelInput,
                 all_positions: bool = False) -> tuple[jax.Array, jax.Array]:
        """Runs one step.

        Args:
          kv_cache: f[L, 2, K, P, S, H] the paged KV pool (layout in `pallas_kernels.reference`).
          batch: the step's `ModelInput`, padded to B rows of Q tokens.
          all_positions: static; return logits at every new token (prompt logprobs).

        Returns:
          (logits, kv_cache): f32[B, V] next-token logits at each row's last new token (packed:
          f32[S, V] at each sequence's last token; or f32[B, Q, V] at every new token), and the
          pool with the new tokens' K/V written.
        """
        B, Q = batch.input_ids.shape
        x = self.embed_tokens(batch.input_ids)  # [B, Q, D]
        # Computed once: without the barrier XLA fuses cos/sin into every layer's RoPE and
        # evaluates them again for each head.
        cos, sin = jax.lax.optimization_barrier(
            rope_cos_sin(batch.positions, self.config.rope_inv_freq()))

        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, kv_cache, new_kv = layer(x, cos, sin, kv_cache, i, batch)
            if new_kv is not None:  # else the layer already wrote its K/V (xla, Pallas)
                new_k.append(new_kv[0].reshape(B * Q, *new_kv[0].shape[2:]))
                new_v.append(new_kv[1].reshape(B * Q, *new_kv[1].shape[2:]))
        if new_k:  # every layer's new K/V, f[L, B * Q, K, H], in one scatter
            kv_cache = pallas_kernels.write_kv(kv_cache, jnp.stack(new_k), jnp.stack(new_v),
                                               batch.slot_mapping.reshape(B * Q))

        if all_positions:
            return self.compute_logits(self.norm(x)), kv_cache
        # Each row's (packed: each sequence's) last new token; padded rows start at b * Q.
        starts = (jnp.arange(B) * Q if batch.query_start_loc is None
                  else batch.query_start_loc[:-1])
        last = jnp.minimum(starts + jnp.maximum(batch.query_lens - 1, 0), B * Q - 1)
        x = self.norm(x.reshape(B * Q, -1)[last])  # [B or S, D]
        return self.compute_logits(x), kv_cache

    def compute_logits(self, x: jax.Array) -> jax.Array:
        """f[..., D] final hidden states -> f32[..., V] logits."""
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions: i32[B, Q], inv_freq: f32[H // 2] -> cos, sin: f32[B, Q, H] (float32 as HF)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def forward(graphdef: nnx.GraphDef, params: nnx.State, kv_cache: jax.Array,
            batch: ModelInput, all_positions: bool = False) -> tuple[jax.Array, jax.Array]:
    """The pure step function: `jax.jit(partial(forward, graphdef), donate_argnums=1)`.

    Args:
      graphdef, params: `nnx.split(model)` of a `LlamaForCausalLM`.
      kv_cache: f[L, 2, K, P, S, H] the pool; donated, so the write is in place.
      batch: `ModelInput`.
      all_positions: static; logits at every new token, f32[B, Q, V].

    Returns:
      (f32[B, V] logits at each row's last new token (f32[S, V] per sequence when packed),
      updated kv_cache).
    """
    return nnx.merge(graphdef, params)(kv_cache, batch, all_positions)
