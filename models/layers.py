"""Layers that model families share: RMSNorm, rotary embeddings, the stacked-projection
attention over the paged pool, the gated MLP, and a pre-norm decoder layer.

The Llama forms follow `transformers.models.llama.modeling_llama`; options cover the variants
that families differ by: biases on q/k/v (Qwen2), a per-head RMSNorm on q and k (Qwen3, Gemma
3), Gemma's `(1 + w)` RMSNorm computed in float32 (`Gemma2RMSNorm`), four norms per layer
(`Gemma2DecoderLayer`), the tanh-approximated GELU (`gelu_pytorch_tanh`), and rotary embeddings
on part of each head (Phi-3's `partial_rotary_factor`). Projections are stacked as vLLM stacks
them: q/k/v in one `qkv_proj`, gate/up in one `gate_up_proj` (see `models.loader`).

Tensor parallelism (Megatron-LM's split, as tpu-inference and JetStream declare it): each
parameter carries its partition spec over the mesh axis "model" (`nnx.with_partitioning`):
q/k/v and gate/up are column-parallel (`COLUMN`, split on their output axis), o and down
row-parallel (`ROW`, split on their input axis), so each layer's attention and MLP end in one
all-reduce each; norms are replicated. A stacked parameter holds its parts shard by shard: with
`tensor_parallel_size` tp, its output axis is tp blocks, block s being part 0's s-th slice, then
part 1's, ... (the loader writes it so), so that each device's block is a whole `qkv_proj` of its
own heads. With tp = 1 that is the plain concatenation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.models.base import DenseBatch, ModelInput
from jaxpaged.models.lora import project
from jaxpaged.pallas_kernels import few_row_matmul as few_rows
from jaxpaged.pallas_kernels.backends import MODEL_AXIS, AttentionBackend, AttentionSpec
from jaxpaged.pallas_kernels.plan import KernelPlan

COLUMN = (None, MODEL_AXIS)  # f[in, out] split on out
ROW = (MODEL_AXIS, None)  # f[in, out] split on in


class RMSNorm(nnx.Module):
    """`LlamaRMSNorm`: normalizes in float32, scales by w in the input dtype. With
    `unit_offset` (`Gemma2RMSNorm`, `Gemma3RMSNorm`): scales by (1 + w) in float32, w stored
    as in the checkpoint (0 is the identity)."""

    def __init__(self, dim: int, eps: float, *, dtype, unit_offset: bool = False):
        self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), dtype))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


class Linear(nnx.Linear):
    """`nnx.Linear` (the same parameters and results) whose matmul of a few rows runs the CPU
    few-row kernel (`pallas_kernels.few_row_matmul`) where it is built with `few_row_kernel`
    (the model's `KernelPlan.few_row_matmul`)."""

    def __init__(self, *args, few_row_kernel: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.few_row_kernel = few_row_kernel

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        if not (self.few_row_kernel and few_rows.fits(x, kernel)):
            return super().__call__(x)
        y = few_rows.few_row_matmul(x, kernel)
        return y if self.bias is None else y + self.bias[...]


class Embed(nnx.Embed):
    """`nnx.Embed` whose `attend` (a tied LM head, `x @ embedding.T`) of a few rows runs the CPU
    few-row kernel where it is built with `few_row_kernel`."""

    def __init__(self, *args, few_row_kernel: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.few_row_kernel = few_row_kernel

    def attend(self, x: jax.Array) -> jax.Array:
        table = self.embedding[...]
        if not (self.few_row_kernel and few_rows.fits(x, table, transposed=True)):
            return super().attend(x)
        return few_rows.few_row_matmul(x, table, transposed=True)


def linear(d_in: int, d_out: int, dtype, rngs: nnx.Rngs, bias: bool = False,
           partition: tuple = (None, None), kernels: KernelPlan = KernelPlan()) -> Linear:
    """A `Linear` kernel f[d_in, d_out] (and bias f[d_out]) with its partition spec, on the
    few-row kernel where `kernels` says."""
    return Linear(
        d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
        few_row_kernel=kernels.few_row_matmul,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), partition),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), partition[1:]))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x: f[T, heads, H] by angles cos, sin: f32[T, R] (HF `rotate_half` style) on its
    first R <= H features (R < H: Phi-3's partial rotary embedding); the rest pass through."""
    R = cos.shape[-1]
    x_rot, x_pass = x[..., :R], x[..., R:]
    x1, x2 = jnp.split(x_rot, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    out = x_rot * cos + rotated * sin
    return out if R == x.shape[-1] else jnp.concatenate([out, x_pass], axis=-1)


class Attention(nnx.Module):
    """Grouped-query attention over the paged pool, as `spec` says (scale, sliding window,
    soft-cap) through `backend`. With `qk_norm`, q and k go through a per-head RMSNorm
    (weight f[H]) before RoPE (`Qwen3Attention`); with `qk_norm="full"`, through one RMSNorm
    over all heads each (f[N * H], f[K * H]: `OlmoeAttention`). `qkv_proj_lora` /
    `o_proj_lora`: adapter slots (`models.lora`), set by `enable_lora`."""

    qkv_proj_lora = o_proj_lora = None

    def __init__(self, config, *, dtype, backend: AttentionBackend, spec: AttentionSpec,
                 rngs: nnx.Rngs, qk_norm: bool = False, unit_offset: bool = False):
        D, N, K, H = (config.hidden_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        self.tp = config.tensor_parallel_size
        self.backend, self.spec = backend, spec
        # HF's q_proj, k_proj and v_proj side by side (see `models.loader`): one matmul
        # instead of three, which XLA's CPU GEMMs run faster at the step's small token counts.
        self.qkv_proj = linear(D, (N + 2 * K) * H, dtype, rngs, bias=config.qkv_bias,
                               partition=COLUMN, kernels=config.kernels)
        self.o_proj = linear(N * H, D, dtype, rngs, partition=ROW, kernels=config.kernels)
        # "full": one RMSNorm over all of q's heads and one over k's (OLMoE), else per head.
        self.full_qk_norm = qk_norm == "full"
        norm = lambda width: RMSNorm(width, config.rms_norm_eps, dtype=dtype,
                                     unit_offset=unit_offset)
        q_width, k_width = (N * H, K * H) if self.full_qk_norm else (H, H)
        self.q_norm = norm(q_width) if qk_norm else None
        self.k_norm = norm(k_width) if qk_norm else None
        # q, k and v clamped to [-clip_qkv, clip_qkv] after the norms (OLMoE's `clip_qkv`).
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def __call__(self, x, cos, sin, kv_cache, layer: int, batch: ModelInput):
        # x: [T, D]; kv_cache: [L, 2, K, P, S, H] the whole pool, this layer's at `layer`.
        T, _ = x.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        Ns, Ks = N // self.tp, K // self.tp  # heads per shard
        slots = getattr(batch, "lora_slots", None)  # a step's adapters (not a dense forward's)
        qkv = project(self.qkv_proj, self.qkv_proj_lora, x, slots)
        qkv = qkv.reshape(T, self.tp, (Ns + 2 * Ks) * H)  # by shard (module doc)
        q, k, v = jnp.split(qkv, [Ns * H, (Ns + Ks) * H], axis=-1)
        if self.full_qk_norm:
            q, k = self.q_norm(q.reshape(T, N * H)), self.k_norm(k.reshape(T, K * H))
        q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
        if self.q_norm is not None and not self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(x, -self.clip_qkv, self.clip_qkv) for x in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(batch, DenseBatch):  # a dense forward: no pool
            out = dense_attention(q, k, v, batch, self.spec)
            return self.o_proj(out.reshape(T, N * H)), kv_cache, None
        out, kv_cache, new_kv = self.backend.attention(
            q, k, v, kv_cache, layer, batch.attention, self.spec)
        out = project(self.o_proj, self.o_proj_lora, out.reshape(T, N * H), slots)
        return out, kv_cache, new_kv


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, batch: DenseBatch,
                    spec: AttentionSpec) -> jax.Array:
    """Causal grouped-query attention over a padded batch, as the paged backends compute it
    (`pallas_kernels.reference.paged_attention_xla_packed`: scale, soft-cap, sliding window
    over positions, softmax in float32).

    Args:
      q: f[B * T, N, H]; k, v: f[B * T, K, H], rows of `batch.mask` flattened.
      batch: the padded batch's mask and positions.
      spec: the layer's attention.

    Returns:
      f[B * T, N, H] in q's dtype, 0 at padding.
    """
    B, T = batch.mask.shape
    _, N, H = q.shape
    K = k.shape[1]
    q = q.reshape(B, T, K, N // K, H)
    k, v = k.reshape(B, T, K, H), v.reshape(B, T, K, H)
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) * spec.scale
    if spec.soft_cap is not None:
        s = spec.soft_cap * jnp.tanh(s / spec.soft_cap)
    index = jnp.arange(T)
    valid = (index[None, :, None] >= index[None, None, :]) & batch.mask[:, None, :]  # [B, q, s]
    if spec.sliding_window is not None:
        pos = batch.positions
        valid &= pos[:, :, None] - pos[:, None, :] < spec.sliding_window
    p = jax.nn.softmax(jnp.where(valid[:, None, None], s, -1e30), axis=-1)
    out = jnp.einsum("bkgqs,bskh->bqkgh", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    out = jnp.where(batch.mask[:, :, None, None, None], out, 0.0)
    return out.reshape(B * T, N, H).astype(q.dtype)


ACTIVATIONS = {  # HF `hidden_act` / `hidden_activation` names
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)), gate and up as one stacked matrix (`LlamaMLP`,
    `Gemma2MLP`), F = `intermediate_size` (default the config's); `*_lora`: adapter slots, as
    `Attention`'s."""

    gate_up_proj_lora = down_proj_lora = None

    def __init__(self, config, *, dtype, rngs: nnx.Rngs, intermediate_size: int | None = None):
        D, F = config.hidden_size, intermediate_size or config.intermediate_size
        # HF's gate_proj, then up_proj, by shard (module doc)
        self.gate_up_proj = linear(D, 2 * F, dtype, rngs, partition=COLUMN,
                                   kernels=config.kernels)
        self.down_proj = linear(F, D, dtype, rngs, partition=ROW, kernels=config.kernels)
        self.act = ACTIVATIONS[config.hidden_act]
        self.tp = config.tensor_parallel_size

    def __call__(self, x, slots: jax.Array | None = None):
        gate_up = project(self.gate_up_proj, self.gate_up_proj_lora, x, slots)
        gate, up = jnp.split(gate_up.reshape(*x.shape[:-1], self.tp, -1), 2, axis=-1)
        h = (self.act(gate) * up).reshape(gate_up.shape[:-1] + (-1,))
        return project(self.down_proj, self.down_proj_lora, h, slots)


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residuals (`LlamaDecoderLayer`). With
    `sandwich_norms` the attention's and the MLP's outputs are normalized too before their
    residual adds (`Gemma2DecoderLayer`: `post_attention_layernorm` then normalizes the
    attention output, and `pre_feedforward_layernorm` / `post_feedforward_layernorm` wrap the
    MLP). `mlp`: the layer's MLP where the family chooses one per layer (Mixture-of-Experts)."""

    def __init__(self, config, *, dtype, backend: AttentionBackend, spec: AttentionSpec,
                 rngs: nnx.Rngs, qk_norm: bool = False, unit_offset: bool = False,
                 sandwich_norms: bool = False, mlp: nnx.Module | None = None):
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                               unit_offset=unit_offset)
        self.input_layernorm = norm()
        self.self_attn = Attention(config, dtype=dtype, backend=backend, spec=spec, rngs=rngs,
                                   qk_norm=qk_norm, unit_offset=unit_offset)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if sandwich_norms else None
        self.post_feedforward_layernorm = norm() if sandwich_norms else None
        # The layer's MLP: `mlp(x, lora_slots) -> f[T, D]` (a family's per-layer choice, as
        # `models.moe.SparseMoeBlock`), by default the gated one.
        self.mlp = mlp if mlp is not None else GatedMLP(config, dtype=dtype, rngs=rngs)
        # Each block's output times this before its residual add (Granite), or None.
        self.residual_multiplier = getattr(config, "residual_multiplier", None)

    def __call__(self, x, cos, sin, kv_cache, layer: int, batch: ModelInput):
        attn, kv_cache, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache,
                                                layer, batch)
        slots = getattr(batch, "lora_slots", None)
        if self.pre_feedforward_layernorm is None:
            scale = ((lambda h: h) if self.residual_multiplier is None
                     else (lambda h: h * self.residual_multiplier))
            x = x + scale(attn)
            return x + scale(self.mlp(self.post_attention_layernorm(x), slots)), kv_cache, new_kv
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x), slots)
        return x + self.post_feedforward_layernorm(h), kv_cache, new_kv
