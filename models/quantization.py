"""Weight-only int8 quantization of a loaded model (`LLM(quantization="int8")`).

Every linear layer's kernel `f[K, N]` becomes `weight: i8[N, K]` (output rows by input
features, as Hugging Face and GGUF store them) and `scale: f32[N]`: symmetric, per output
channel, `scale = max|w[n]| / 127` (`pallas_kernels.quantized_matmul.quantize_int8`, the scheme
of vLLM's and TensorRT-LLM's weight-only int8). The matmul reads the int8 weights
(`int8_matmul`: the C++ kernel on CPU); activations, norms, biases and the KV cache keep their
dtype. With `embeddings=True` the token embedding (and so a tied LM head) is quantized the same
way, one scale per vocabulary row: the embedding is a fifth of a 135M model's weights.

Under tensor parallelism the weights keep their layer's split (column-parallel on N,
row-parallel on K) and the matmul runs as jnp, partitioned by XLA; the C++ kernel serves one
device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.pallas_kernels.backends import MODEL_AXIS
from jaxpaged.pallas_kernels.quantized_matmul import int8_matmul, quantize_int8

QUANTIZATION_METHODS = (None, "int8")


def _param(value, spec: tuple) -> nnx.Param:
    with nnx.use_eager_sharding(False):
        return nnx.Param(value, out_sharding=spec)


class QuantizedLinear(nnx.Module):
    """A linear layer with int8 weights: `y = (x @ weight.T) * scale + bias`, in x's dtype.

    weight: i8[N, K] laid out by `spec` over the mesh; scale: f32[N] by its first axis; bias:
    f[N] or None (kept as it was).
    """

    def __init__(self, weight: jax.Array, scale: jax.Array, bias, *, spec: tuple,
                 use_kernel: bool | None):
        self.weight = _param(weight, spec)
        self.scale = _param(scale, spec[:1])
        self.bias = bias
        self.use_kernel = use_kernel

    def __call__(self, x: jax.Array) -> jax.Array:
        y = int8_matmul(x, self.weight[...], self.scale[...], use_kernel=self.use_kernel)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class QuantizedEmbed(nnx.Module):
    """A token embedding with int8 rows: `__call__(ids)` looks up `weight[ids] * scale[ids]`,
    `attend(x)` is the tied LM head `x @ (weight * scale).T`; both in `dtype`.

    weight: i8[V, D]; scale: f32[V]; split on V over the mesh, as `nnx.Embed` is.
    """

    def __init__(self, weight: jax.Array, scale: jax.Array, dtype, *, use_kernel: bool | None):
        self.weight = _param(weight, (MODEL_AXIS, None))
        self.scale = _param(scale, (MODEL_AXIS,))
        self.dtype = dtype
        self.use_kernel = use_kernel

    def __call__(self, ids: jax.Array) -> jax.Array:
        rows = self.weight[...][ids].astype(jnp.float32) * self.scale[...][ids][..., None]
        return rows.astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        return int8_matmul(x, self.weight[...], self.scale[...],
                           use_kernel=self.use_kernel).astype(self.dtype)


def _quantized(w: jax.Array, spec: tuple, mesh):
    """quantize_int8(w) laid out like w's layer: weight by `spec`, scale by its first axis."""
    if mesh is None:
        return jax.jit(quantize_int8)(w)
    shardings = (NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(spec[0])))
    return jax.jit(quantize_int8, out_shardings=shardings)(w)


def quantize_model(model: nnx.Module, method: str | None, *, embeddings: bool = True,
                   mesh=None) -> nnx.Module:
    """Replaces `model`'s `nnx.Linear` layers (and with `embeddings` its `nnx.Embed`) by
    int8 ones, in place, and returns it; the float weights are then free. `method` None: no
    change.

    Raises:
      ValueError: an unknown `method`.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {method!r} is not one of {QUANTIZATION_METHODS}")
    if method is None:
        return model
    use_kernel = None if mesh is None else False
    for path, node in list(nnx.iter_graph(model)):
        if isinstance(node, nnx.Linear):
            spec = node.kernel.get_metadata().get("out_sharding") or (None, None)
            weight_spec = spec[::-1]  # the kernel f[K, N] transposed
            weight, scale = _quantized(node.kernel[...].T, weight_spec, mesh)
            new = QuantizedLinear(weight, scale, node.bias, spec=weight_spec,
                                  use_kernel=use_kernel)
        elif isinstance(node, nnx.Embed) and embeddings:
            weight, scale = _quantized(node.embedding[...], (MODEL_AXIS, None), mesh)
            new = QuantizedEmbed(weight, scale, node.dtype, use_kernel=use_kernel)
        else:
            continue
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, path[-1], new)
    return model


def weight_bytes(params) -> int:
    """Bytes of every array in a parameter tree (all shards of a sharded one)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))
