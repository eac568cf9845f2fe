"""Llama-family decoder in Flax NNX (Llama 2/3, SmolLM2) over the paged KV pool.

Matches `transformers.models.llama.modeling_llama.LlamaForCausalLM`: pre-norm decoder layers with
RMSNorm, rotary position embeddings (rotate-half convention), grouped-query attention and a SwiGLU
MLP; tied or untied output embeddings (the layers in `models.layers`, shared with other
families). The layers are separate modules (`layers[i]`, HF's tree)
run by a Python loop, so each layer's matmuls read its weights where they lie. A `lax.scan` over
stacked weights compiles in less time (XLA compiles each layer here), but on CPU XLA copies each
layer's weight slice before its matmuls, which cost about 7% of a 32-sequence decode step.

A step's tokens come packed on one axis T (`models.base.ModelInput`); the attention backend
(`pallas_kernels.backends`) reads the cached K/V from the pool and writes the new ones, each
layer's before reading (xla, Pallas) or all layers' in one scatter at the end (the C++ "cpu"
kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.models.base import DenseBatch, ModelInput
from jaxpaged.pallas_kernels.backends import (MODEL_AXIS, AttentionBackend,
                                              make_attention_backend)
from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.layers import COLUMN, DecoderLayer, Embed, RMSNorm, linear
from jaxpaged.models.rope import longrope_use_long, rope_cos_sin

# (HF name, our parameter path, transpose, (part, parts) of a stacked parameter or None)
LLAMA_NAME_MAP: tuple[tuple[str, str, bool, tuple[int, int] | None], ...] = (
    ("model.embed_tokens.weight", "embed_tokens.embedding", False, None),
    ("model.norm.weight", "norm.weight", False, None),
    ("lm_head.weight", "lm_head.kernel", True, None),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.weight", False,
     None),
    ("model.layers.{i}.post_attention_layernorm.weight",
     "layers.{i}.post_attention_layernorm.weight", False, None),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.self_attn.qkv_proj.kernel", True,
     (0, 3)),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.qkv_proj.kernel", True,
     (1, 3)),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.self_attn.qkv_proj.kernel", True,
     (2, 3)),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.self_attn.o_proj.kernel", True,
     None),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_up_proj.kernel", True, (0, 2)),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.gate_up_proj.kernel", True, (1, 2)),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj.kernel", True, None),
)


# The per-head q/k RMSNorms of the families that have them (`QK_NORM`).
QK_NORM_NAME_MAP = tuple(
    (f"model.layers.{{i}}.self_attn.{n}.weight", f"layers.{{i}}.self_attn.{n}.weight", False, None)
    for n in ("q_norm", "k_norm"))


class LlamaForCausalLM(nnx.Module):
    """The model; `__call__(kv_cache, batch) -> (logits, kv_cache)` is one engine step.

    Parameters follow HF's module tree: `layers.{i}.self_attn.o_proj.kernel: f[N*H, D]` holds
    HF's `model.layers.{i}.self_attn.o_proj.weight` transposed (see `models.loader`), except that
    q/k/v and gate/up are stacked along the output axis, as vLLM stacks them:
    `self_attn.qkv_proj.kernel: f[D, (N + 2K) * H]` and `mlp.gate_up_proj.kernel: f[D, 2F]`.
    """

    config_class = LlamaConfig
    NAME_MAP = LLAMA_NAME_MAP
    # What families built on this class change (see `models.layers`):
    QK_NORM = False  # RMSNorm on q and k before RoPE: per head (Qwen3, Gemma 3), "full" (OLMoE)
    UNIT_OFFSET_NORMS = False  # RMSNorms scale by (1 + w) in float32 (Gemma)
    SANDWICH_NORMS = False  # four norms per layer (Gemma)
    EMBED_SCALE = False  # embeddings times sqrt(hidden_size) in the weight dtype (Gemma)
    # The parts of stacked parameters that hold KV heads (repeated under tensor parallelism
    # when there are fewer KV heads than devices; see `LlamaConfig.for_tensor_parallel`).
    KV_HEAD_PARTS = {"self_attn.qkv_proj.kernel": (1, 2), "self_attn.qkv_proj.bias": (1, 2)}

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32,
                 attention_backend: AttentionBackend | str = "xla", rngs: nnx.Rngs):
        self.config = config
        if isinstance(attention_backend, str):
            attention_backend = make_attention_backend(attention_backend, dtype)
        self.backend = attention_backend
        # Parameters carry their partition specs (`models.layers`); the loader places each
        # shard on its device, so nothing is sharded while the model is built.
        with nnx.use_eager_sharding(False):
            self._build(config, dtype, rngs)

    def _build(self, config: LlamaConfig, dtype, rngs: nnx.Rngs) -> None:
        # Vocabulary-parallel: the embedding f[V, D] and the LM head f[D, V] split on V.
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs,
            few_row_kernel=config.kernels.few_row_matmul, embedding_init=nnx.with_partitioning(nnx.initializers.variance_scaling(
                1.0, "fan_in", "normal", out_axis=0), (MODEL_AXIS, None)))
        self.layers = nnx.List([
            DecoderLayer(config, dtype=dtype, backend=self.backend,
                         spec=config.attention_spec(i), rngs=rngs, qk_norm=self.QK_NORM,
                         unit_offset=self.UNIT_OFFSET_NORMS, sandwich_norms=self.SANDWICH_NORMS,
                         mlp=self.make_mlp(config, i, dtype, rngs))
            for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                            unit_offset=self.UNIT_OFFSET_NORMS)
        self.lm_head = (None if config.tie_word_embeddings
                        else linear(config.hidden_size, config.vocab_size, dtype, rngs,
                                    partition=COLUMN, kernels=config.kernels))

    def make_mlp(self, config: LlamaConfig, layer: int, dtype, rngs: nnx.Rngs
                 ) -> nnx.Module | None:
        """Layer `layer`'s MLP, or None for the gated one (`models.layers.GatedMLP`); a
        family whose layers differ (Mixture-of-Experts) overrides it."""
        return None

    def __call__(self, kv_cache: jax.Array, batch: ModelInput,
                 all_positions: bool = False) -> tuple[jax.Array, jax.Array]:
        """Runs one step.

        Args:
          kv_cache: f[L, 2, K, P, S, H] the paged KV pool (layout in `pallas_kernels.reference`).
          batch: the step's packed `ModelInput` of T tokens in S sequence slots.
          all_positions: static; return logits at every token (prompt logprobs).

        Returns:
          (logits, kv_cache): f32[S, V] next-token logits at each sequence's last new token
          (f32[T, V] at every token with `all_positions`), and the pool with the new tokens'
          K/V written.
        """
        md = batch.attention
        T = batch.input_ids.shape[0]
        x = self.embed_tokens(batch.input_ids)  # [T, D]
        x = self.scale_embeddings(x)
        # Computed once per kind of layer: without the barrier XLA fuses cos/sin into every
        # layer's RoPE and evaluates them again for each head.
        ropes = {}
        for kind in {self.config.rope_kind(i) for i in range(len(self.layers))}:
            tables = self.config.rope_tables(kind)
            use_long = (None if batch.rope_seq_lens is None
                        else longrope_use_long(batch.rope_seq_lens, tables))
            ropes[kind] = jax.lax.optimization_barrier(
                rope_cos_sin(batch.positions, tables, use_long))

        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[self.config.rope_kind(i)]
            x, kv_cache, new_kv = layer(x, cos, sin, kv_cache, i, batch)
            if new_kv is not None:  # else the layer already wrote its K/V (xla, Pallas)
                new_k.append(new_kv[0])
                new_v.append(new_kv[1])
        if new_k:  # every layer's new K/V, f[L, T, K, H], in one scatter
            kv_cache = self.backend.write_all_kv(kv_cache, jnp.stack(new_k), jnp.stack(new_v), md)

        if all_positions:
            return self.compute_logits(self.norm(x)), kv_cache
        if batch.logits_indices is not None:
            return self.compute_logits(self.norm(x[batch.logits_indices])), kv_cache  # [R, V]
        last = jnp.minimum(md.query_start_loc[:-1] + jnp.maximum(md.query_lens - 1, 0), T - 1)
        return self.compute_logits(self.norm(x[last])), kv_cache  # [S, V]

    def dense_forward(self, input_ids: jax.Array, attention_mask: jax.Array | None = None
                      ) -> jax.Array:
        """A plain causal forward over a padded batch, no KV pool: the same layers and
        parameters as `__call__`, attention by `models.layers.dense_attention`; differentiable
        (see `models.base.dense_forward`).

        Args:
          input_ids: i32[B, T].
          attention_mask: [B, T], nonzero at real tokens; None: all real.

        Returns:
          f32[B, T, V] logits at every token.
        """
        B, T = input_ids.shape
        return self.compute_logits(self.dense_hidden_states(input_ids, attention_mask)
                                   ).reshape(B, T, -1)

    def dense_hidden_states(self, input_ids: jax.Array,
                            attention_mask: jax.Array | None = None) -> jax.Array:
        """`dense_forward`'s final hidden states, after the final norm (HF's
        `last_hidden_state`): f[B * T, D], row b * T + t for token t of row b."""
        B, T = input_ids.shape
        mask = (jnp.ones((B, T), bool) if attention_mask is None
                else jnp.asarray(attention_mask).astype(bool))
        positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)
        batch = DenseBatch(mask, positions)
        x = self.embed_tokens(input_ids.reshape(B * T))
        x = self.scale_embeddings(x)
        # Longrope: every token's sequence is its whole row, as in one HF forward.
        seq_lens = jnp.broadcast_to(jnp.sum(mask, axis=-1, keepdims=True), (B, T)).reshape(-1)
        ropes = {}
        for kind in {self.config.rope_kind(i) for i in range(len(self.layers))}:
            tables = self.config.rope_tables(kind)
            ropes[kind] = rope_cos_sin(positions.reshape(-1), tables,
                                       longrope_use_long(seq_lens, tables))
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[self.config.rope_kind(i)]
            x, _, _ = layer(x, cos, sin, None, i, batch)
        return self.norm(x)

    def scale_embeddings(self, x: jax.Array) -> jax.Array:
        """The embeddings times sqrt(hidden_size) (`EMBED_SCALE`: Gemma, which rounds the scale
        to the weight dtype first) or times `embedding_multiplier` (Granite)."""
        if self.EMBED_SCALE:
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        if self.config.embedding_multiplier is not None:
            x = x * self.config.embedding_multiplier
        return x

    def compute_logits(self, x: jax.Array) -> jax.Array:
        """f[..., D] final hidden states -> f32[..., V] logits, divided by `logits_scaling`
        (Granite) and soft-capped (Gemma 2's `final_logit_softcapping`) when the config says."""
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        logits = logits.astype(jnp.float32)
        if self.config.logits_scaling is not None:  # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    @staticmethod
    def part_widths(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
        """Output width of each part of the stacked parameters in the checkpoint, by path below
        `layers.{i}` (KV parts with the checkpoint's KV heads, before any repeat)."""
        N, H = config.num_attention_heads, config.head_dim
        K = config.num_key_value_heads // config.kv_head_replicas
        F = config.intermediate_size
        return {"self_attn.qkv_proj.kernel": (N * H, K * H, K * H),
                "self_attn.qkv_proj.bias": (N * H, K * H, K * H),
                "mlp.gate_up_proj.kernel": (F, F)}
