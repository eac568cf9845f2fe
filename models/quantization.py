"""int8 quantization of a loaded model: weight-only (`LLM(quantization="int8")`) or with int8
activations too (`LLM(quantization="w8a8")`).

Every linear layer's kernel `f[K, N]` becomes `weight: i8[N, K]` (output rows by input
features, as Hugging Face and GGUF store them) and `scale: f32[N]`: symmetric, per output
channel, `scale = max|w[n]| / 127` (`pallas_kernels.quantized_matmul.quantize_int8`, the scheme
of vLLM's and TensorRT-LLM's weight-only int8). The matmul reads the int8 weights
(`int8_matmul`: the C++ kernel on CPU); activations, norms, biases and the KV cache keep their
dtype. With `embeddings=True` the token embedding (and so a tied LM head) is quantized the same
way, one scale per vocabulary row: the embedding is a fifth of a 135M model's weights.

"w8a8" keeps the same int8 weights and also quantizes each layer's input per token, on the fly
(`w8a8_matmul`): the product is summed in int32, which the CPU's VNNI instructions do at four
times float32's multiply-adds per instruction. The tied LM head (`QuantizedEmbed.attend`) does
the same. Steps of one or two tokens on the CPU kernels stay weight-only, which is faster
there (the weights are read once either way, and the activations need no quantizing), except
in batch-invariant mode: W8A8's integer sums are exact, so a token's outputs then do not
depend on the rest of its step.

Under tensor parallelism the weights keep their layer's split (column-parallel on N,
row-parallel on K) and the matmul runs as jnp, partitioned by XLA; the C++ kernel serves one
device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.pallas_kernels.backends import MODEL_AXIS
from jaxpaged.pallas_kernels.quantized_matmul import (W8A8_KERNEL_MAX_ROWS, int8_matmul,
                                                      quantize_int8, w8a8_matmul)

def _param(value, spec: tuple) -> nnx.Param:
    with nnx.use_eager_sharding(False):
        return nnx.Param(value, out_sharding=spec)


def _matmul(x: jax.Array, w: jax.Array, scale: jax.Array, activations: str,
            use_kernel: bool) -> jax.Array:
    """f32[..., N]: x times the int8 weights, x kept in float ("float") or quantized per token
    ("int8", W8A8); "auto": W8A8, except steps of up to `W8A8_KERNEL_MAX_ROWS` tokens on the C++
    kernels, which read the weights once whatever the activations and are faster weight-only
    (no activation quantization to pay for)."""
    rows = math.prod(x.shape[:-1])
    if activations == "int8" or (activations == "auto"
                                 and not (use_kernel and rows <= W8A8_KERNEL_MAX_ROWS)):
        return w8a8_matmul(x, w, scale, use_kernel=use_kernel)
    return int8_matmul(x, w, scale, use_kernel=use_kernel)


class QuantizedLinear(nnx.Module):
    """A linear layer with int8 weights: `y = (x @ weight.T) * scale + bias`, in x's dtype.

    weight: i8[N, K] laid out by `spec` over the mesh; scale: f32[N] by its first axis; bias:
    f[N] or None (kept as it was). `activations`: "float" (weight-only), "int8" (x quantized
    per token, W8A8) or "auto" (W8A8 but for steps of one or two tokens on the CPU kernels,
    `_matmul`).
    """

    def __init__(self, weight: jax.Array, scale: jax.Array, bias, *, spec: tuple,
                 use_kernel: bool = False, activations: str = "float"):
        self.weight = _param(weight, spec)
        self.scale = _param(scale, spec[:1])
        self.bias = bias
        self.use_kernel = use_kernel
        self.activations = activations

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _matmul(x, self.weight[...], self.scale[...], self.activations, self.use_kernel)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class QuantizedEmbed(nnx.Module):
    """A token embedding with int8 rows: `__call__(ids)` looks up `weight[ids] * scale[ids]`,
    `attend(x)` is the tied LM head `x @ (weight * scale).T`; both in `dtype`.

    weight: i8[V, D]; scale: f32[V]; split on V over the mesh, as `nnx.Embed` is.
    `activations`: as `QuantizedLinear`'s, for `attend`.
    """

    def __init__(self, weight: jax.Array, scale: jax.Array, dtype, *, use_kernel: bool = False,
                 activations: str = "float"):
        self.weight = _param(weight, (MODEL_AXIS, None))
        self.scale = _param(scale, (MODEL_AXIS,))
        self.dtype = dtype
        self.use_kernel = use_kernel
        self.activations = activations

    def __call__(self, ids: jax.Array) -> jax.Array:
        rows = self.weight[...][ids].astype(jnp.float32) * self.scale[...][ids][..., None]
        return rows.astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        return _matmul(x, self.weight[...], self.scale[...], self.activations,
                       self.use_kernel).astype(self.dtype)


def _quantized(w: jax.Array, spec: tuple, mesh):
    """quantize_int8(w) laid out like w's layer: weight by `spec`, scale by its first axis."""
    if mesh is None:
        return jax.jit(quantize_int8)(w)
    shardings = (NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(spec[0])))
    return jax.jit(quantize_int8, out_shardings=shardings)(w)


class QuantizationMethod:
    """A weight quantization scheme: how a loaded float layer becomes a quantized one.

    Built once per model as `cls(mesh=..., use_kernel=..., batch_invariant=...)`: `mesh` is the
    tensor-parallel mesh (None: one device), `use_kernel` whether the platform's C++ matmul
    serves this model, `batch_invariant` whether a row must be computed one way whatever the
    step's size.
    `linear` and `embed` return the layer that replaces theirs, or None to keep it. Register a
    scheme with one line: `QUANTIZATION_METHODS["name"] = MyMethod`.
    """

    def __init__(self, *, mesh=None, use_kernel: bool = False, batch_invariant: bool = False):
        self.mesh = mesh
        self.use_kernel = use_kernel
        self.batch_invariant = batch_invariant

    def linear(self, layer: nnx.Linear) -> nnx.Module | None:
        return None

    def embed(self, layer: nnx.Embed) -> nnx.Module | None:
        return None


class Int8WeightOnly(QuantizationMethod):
    """Symmetric per-output-channel int8 weights (`QuantizedLinear`, `QuantizedEmbed`)."""

    @property
    def activations(self) -> str:
        """How the layers take their input (`QuantizedLinear`)."""
        return "float"

    def linear(self, layer: nnx.Linear) -> QuantizedLinear:
        spec = layer.kernel.get_metadata().get("out_sharding") or (None, None)
        weight_spec = spec[::-1]  # the kernel f[K, N] transposed
        weight, scale = _quantized(layer.kernel[...].T, weight_spec, self.mesh)
        return QuantizedLinear(weight, scale, layer.bias, spec=weight_spec,
                               use_kernel=self.use_kernel, activations=self.activations)

    def embed(self, layer: nnx.Embed) -> QuantizedEmbed:
        weight, scale = _quantized(layer.embedding[...], (MODEL_AXIS, None), self.mesh)
        return QuantizedEmbed(weight, scale, layer.dtype, use_kernel=self.use_kernel,
                              activations=self.activations)


class W8A8(Int8WeightOnly):
    """`Int8WeightOnly`'s weights, and each layer's input quantized per token (`w8a8_matmul`);
    weight-only for steps of one or two tokens on the CPU kernels ("auto"), except in
    batch-invariant mode, where every step is W8A8."""

    @property
    def activations(self) -> str:
        return "int8" if self.batch_invariant else "auto"


# The schemes `LLM(quantization=...)` accepts, by name (None: the float weights as loaded).
QUANTIZATION_METHODS: dict[str, type[QuantizationMethod]] = {"int8": Int8WeightOnly,
                                                             "w8a8": W8A8}


def check_quantization(method: str | None) -> None:
    """Raises ValueError unless `method` is None or a registered scheme's name."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {method!r} is not one of "
                         f"{(None, *QUANTIZATION_METHODS)}")


def quantize_model(model: nnx.Module, method: str | None, *, embeddings: bool = True,
                   mesh=None, use_kernel: bool = False,
                   batch_invariant: bool = False) -> nnx.Module:
    """Replaces `model`'s `nnx.Linear` layers (and with `embeddings` its `nnx.Embed`) by
    `method`'s quantized ones (`QUANTIZATION_METHODS`), in place, and returns it; the float
    weights are then free. `method` None: no change. `use_kernel`: the quantized layers run the
    C++ matmul (one CPU device; the caller asks the platform). `batch_invariant`: the engine's
    mode (a scheme may compute a row one way only).

    Raises:
      ValueError: an unknown `method`.
    """
    check_quantization(method)
    if method is None:
        return model
    scheme = QUANTIZATION_METHODS[method](mesh=mesh, use_kernel=use_kernel and mesh is None,
                                          batch_invariant=batch_invariant)
    for path, node in list(nnx.iter_graph(model)):
        if isinstance(node, nnx.Linear):
            new = scheme.linear(node)
        elif isinstance(node, nnx.Embed) and embeddings:
            new = scheme.embed(node)
        else:
            continue
        if new is None:
            continue
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, path[-1], new)
    return model


def activation_modes(model: nnx.Module) -> str:
    """How each quantized layer takes its input, in graph order ("float", "int8", "auto";
    `QuantizedLinear`): the same parameters, another program (the step cache's key)."""
    return ",".join(node.activations for _, node in nnx.iter_graph(model)
                    if isinstance(node, (QuantizedLinear, QuantizedEmbed)))


def weight_bytes(params) -> int:
    """Bytes of every array in a parameter tree (all shards of a sharded one)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))
