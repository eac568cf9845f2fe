"""Layers that model families share: RMSNorm, rotary embeddings, the stacked-projection
attention over the paged pool, the gated MLP, and a pre-norm decoder layer.

The Llama forms follow `transformers.models.llama.modeling_llama`; options cover the variants
that families differ by (a per-head RMSNorm on q and k, as Qwen3 has). Projections are stacked
as vLLM stacks them: q/k/v in one `qkv_proj`, gate/up in one `gate_up_proj` (see
`models.loader`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.models.base import ModelInput
from jaxpaged.pallas_kernels.backends import AttentionBackend, AttentionSpec


class RMSNorm(nnx.Module):
    """`LlamaRMSNorm`: normalizes in float32, scales in the input dtype."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def linear(d_in: int, d_out: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x: f[T, heads, H] by angles cos, sin: f32[T, H] (HF `rotate_half` style)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions: i32[T], inv_freq: f32[H // 2] -> cos, sin: f32[T, H] (float32 as HF)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class Attention(nnx.Module):
    """Grouped-query attention over the paged pool, as `spec` says (scale, sliding window,
    soft-cap) through `backend`. With `qk_norm`, q and k go through a per-head RMSNorm
    (weight f[H]) before RoPE (`Qwen3Attention`)."""

    def __init__(self, config, *, dtype, backend: AttentionBackend, spec: AttentionSpec,
                 rngs: nnx.Rngs, qk_norm: bool = False):
        D, N, K, H = (config.hidden_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        self.backend, self.spec = backend, spec
        # HF's q_proj, k_proj and v_proj side by side (see `models.loader`): one matmul
        # instead of three, which XLA's CPU GEMMs run faster at the step's small token counts.
        self.qkv_proj = linear(D, (N + 2 * K) * H, dtype, rngs)
        self.o_proj = linear(N * H, D, dtype, rngs)
        self.q_norm = RMSNorm(H, config.rms_norm_eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(H, config.rms_norm_eps, dtype=dtype) if qk_norm else None

    def __call__(self, x, cos, sin, kv_cache, layer: int, batch: ModelInput):
        # x: [T, D]; kv_cache: [L, 2, K, P, S, H] the whole pool, this layer's at `layer`.
        T, _ = x.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = jnp.split(self.qkv_proj(x), [N * H, (N + K) * H], axis=-1)
        q, k = q.reshape(T, N, H), k.reshape(T, K, H)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache, new_kv = self.backend.attention(
            q, k, v.reshape(T, K, H), kv_cache, layer, batch.attention, self.spec)
        return self.o_proj(out.reshape(T, N * H)), kv_cache, new_kv


class GatedMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one stacked matrix (`LlamaMLP`)."""

    def __init__(self, config, *, dtype, rngs: nnx.Rngs):
        D, F = config.hidden_size, config.intermediate_size
        self.gate_up_proj = linear(D, 2 * F, dtype, rngs)  # HF's gate_proj, then up_proj
        self.down_proj = linear(F, D, dtype, rngs)

    def __call__(self, x):
        gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residuals (`LlamaDecoderLayer`)."""

    def __init__(self, config, *, dtype, backend: AttentionBackend, spec: AttentionSpec,
                 rngs: nnx.Rngs, qk_norm: bool = False):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(config, dtype=dtype, backend=backend, spec=spec, rngs=rngs,
                                   qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                dtype=dtype)
        self.mlp = GatedMLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv_cache, layer: int, batch: ModelInput):
        attn, kv_cache, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache,
                                                layer, batch)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv_cache, new_kv
