"""int8 quantization of a loaded model: weight-only (`LLM(quantization="int8")`), with int8
activations too (`LLM(quantization="w8a8")`), or in GGUF's Q8_0 blocks
(`LLM(quantization="q8_0")`).

Every linear layer's kernel `f[K, N]` becomes `weight: i8[N, K]` (output rows by input
features, as Hugging Face and GGUF store them; packed for the C++ kernel by "w8a8" on a CPU
with VNNI) and `scale: f32[N]` ("q8_0": `f32[N, K // 32]`): with "int8" and "w8a8"
symmetric, per output channel, `scale = max|w[n]| / 127`
(`pallas_kernels.quantized_matmul.quantize_int8`, the scheme of vLLM's and TensorRT-LLM's
weight-only int8). The matmul reads the int8 weights
(`int8_matmul`: the C++ kernel on CPU); activations, norms, biases and the KV cache keep their
dtype. With `embeddings=True` the token embedding (and so a tied LM head) is quantized the same
way, one scale per vocabulary row: the embedding is a fifth of a 135M model's weights.

"w8a8" keeps the same int8 weights and also quantizes each layer's input per token, on the fly
(`w8a8_matmul`): the product is summed in int32, which the CPU's VNNI instructions do at four
times float32's multiply-adds per instruction. The tied LM head (`QuantizedEmbed.attend`) does
the same. On the CPU kernels of a CPU with VNNI the weights are packed at load time
(`pack_int8`) and each product is one C++ call at every step size (quantizing, the int8 GEMM and
the scaling); its integer sums are exact, so a token's outputs do not depend on the rest of its
step.

"q8_0" keeps one scale per 32 weights along K, as GGUF's Q8_0 does (`class Q8_0`): on a
Q8_0 file the weights are the file's, not re-quantized per channel, at some cost in speed for
steps of many tokens (`bench/results/quantized-matmul.json`).

A Mixture-of-Experts block's stacked experts (`models.moe.SparseMoeBlock`) become int8 with
symmetric scales per expert and output channel (`quantize_experts_int8`: `i8[E, D, 2F]` with
`f32[E, 2F]`, `i8[E, F, D]` with `f32[E, D]`) under every scheme: weight-only, as "int8" (with
"w8a8" the activations stay float in the experts; with "q8_0" the experts take per-channel
scales, not Q8_0 blocks, whose batched gathers the expert paths do not have). The router and the
shared expert's gate stay float, as vLLM keeps them; the shared expert's own linear layers are
quantized as any other.

Under tensor parallelism the weights keep their layer's split (column-parallel on N,
row-parallel on K) and the matmul runs as jnp, partitioned by XLA; the C++ kernel serves one
device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.models.moe import SparseMoeBlock
from jaxpaged.pallas_kernels import cpu_attention
from jaxpaged.pallas_kernels.backends import MODEL_AXIS
from jaxpaged.pallas_kernels.quantized_matmul import (Q8_0_BLOCK, int8_matmul, pack_int8,
                                                      q8_0_matmul, quantize_int8, quantize_q8_0,
                                                      unpack_rows, w8a8_matmul)


def _param(value, spec: tuple) -> nnx.Param:
    with nnx.use_eager_sharding(False):
        return nnx.Param(value, out_sharding=spec)


def _matmul(x: jax.Array, w: jax.Array, scale: jax.Array, wsum, activations: str,
            use_kernel: bool) -> jax.Array:
    """f32[..., N]: x times the int8 weights, x kept in float ("float") or quantized per token
    ("int8", W8A8; weights packed for the C++ kernel where `wsum` is given); "q8_0" /
    "q8_0-auto": Q8_0 blocks (`scale: f32[N, K // 32]`), `q8_0_matmul`'s "q8_0" / "auto"."""
    if activations.startswith("q8_0"):
        return q8_0_matmul(x, w, scale, use_kernel=use_kernel,
                           activations="auto" if activations == "q8_0-auto" else "q8_0")
    if activations == "int8":
        return w8a8_matmul(x, w, scale, None if wsum is None else wsum[...])
    return int8_matmul(x, w, scale, use_kernel=use_kernel)


class QuantizedLinear(nnx.Module):
    """A linear layer with int8 weights: `y = (x @ weight.T) * scale + bias`, in x's dtype.

    weight: i8[N, K] laid out by `spec` over the mesh, or for the C++ W8A8 kernel (one device)
    packed by `pack_int8` (i8[ceil(N/16), ceil(K/4), 16, 4], with `wsum: i32[16 ceil(N/16)]`);
    scale: f32[N] by its first axis, or with "q8_0" f32[N, K // 32] (one per block of 32 along
    K) as the weight; bias: f[N] or None (kept as it was); `in_features`, `out_features`: K
    and N, whatever the layout (K given for a packed weight). `activations`: "float"
    (weight-only), "int8" (x quantized per token, W8A8), or with GGUF Q8_0 blocks "q8_0" (x
    quantized per block of 32) or "q8_0-auto" (so only for steps of a few tokens on the CPU
    kernel, x in float32 for the rest).
    """

    def __init__(self, weight: jax.Array, scale: jax.Array, bias, *, spec: tuple,
                 in_features: int | None = None, use_kernel: bool = False,
                 activations: str = "float", wsum=None):
        self.in_features = weight.shape[1] if in_features is None else in_features
        self.out_features = scale.shape[0]
        self.weight = _param(weight, spec if weight.ndim == 2 else (None,) * weight.ndim)
        self.scale = _param(scale, spec[:scale.ndim])
        self.wsum = None if wsum is None else _param(wsum, (None,))
        self.bias = bias
        self.use_kernel = use_kernel
        self.activations = activations

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _matmul(x, self.weight[...], self.scale[...], self.wsum, self.activations,
                    self.use_kernel)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class QuantizedEmbed(nnx.Module):
    """A token embedding with int8 rows: `__call__(ids)` looks up `weight[ids] * scale[ids]`,
    `attend(x)` is the tied LM head `x @ (weight * scale).T`; both in `dtype`.

    weight: i8[V, D], or packed as `QuantizedLinear`'s (`features` = D, given for a packed
    weight; rows looked up in place, `unpack_rows`); scale: f32[V], or with "q8_0"
    f32[V, D // 32]; split on V over the mesh, as `nnx.Embed` is. `activations`: as
    `QuantizedLinear`'s, for `attend`.
    """

    def __init__(self, weight: jax.Array, scale: jax.Array, dtype, *,
                 features: int | None = None, use_kernel: bool = False,
                 activations: str = "float", wsum=None):
        self.weight = _param(weight, (MODEL_AXIS, None) if weight.ndim == 2
                             else (None,) * weight.ndim)
        self.scale = _param(scale, (MODEL_AXIS, None)[:scale.ndim])
        self.wsum = None if wsum is None else _param(wsum, (None,))
        self.features = weight.shape[1] if features is None else features
        self.dtype = dtype
        self.use_kernel = use_kernel
        self.activations = activations

    def __call__(self, ids: jax.Array) -> jax.Array:
        scale = self.scale[...][ids]
        if scale.ndim > ids.ndim:  # Q8_0: a scale per block of the row
            scale = jnp.repeat(scale, Q8_0_BLOCK, axis=-1)
        else:
            scale = scale[..., None]
        w = self.weight[...]
        rows = w[ids] if w.ndim == 2 else unpack_rows(w, ids, self.features)
        return (rows.astype(jnp.float32) * scale).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        return _matmul(x, self.weight[...], self.scale[...], self.wsum, self.activations,
                       self.use_kernel).astype(self.dtype)


def _quantized(quantize, w: jax.Array, spec: tuple, mesh, scale_spec: tuple | None = None):
    """quantize(w) (`quantize_int8`, `quantize_q8_0` or `quantize_experts_int8`) laid out like
    w's layer: weight by `spec`, scale by `scale_spec` (None: as many of spec's axes as the scale
    has)."""
    if mesh is None:
        return jax.jit(quantize)(w)
    if scale_spec is None:
        scale_spec = spec[:jax.eval_shape(quantize, w)[1].ndim]
    shardings = (NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(*scale_spec)))
    return jax.jit(quantize, out_shardings=shardings)(w)


def quantize_experts_int8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stacked experts f[E, K, N] (input by output features) -> (i8[E, K, N], f32[E, N]):
    `quantize_int8` of each expert's transposed matrix, one scale per expert and output
    channel, so `w[e, :, n] ~= q[e, :, n] * scale[e, n]`."""
    q, scale = jax.vmap(quantize_int8)(jnp.swapaxes(w, 1, 2))
    return jnp.swapaxes(q, 1, 2), scale


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

    def experts(self, block: SparseMoeBlock) -> None:
        """Quantizes `block`'s stacked experts in place (`SparseMoeBlock.set_int8_experts`), or
        leaves them float (this base: float)."""


class Int8WeightOnly(QuantizationMethod):
    """Symmetric per-output-channel int8 weights (`QuantizedLinear`, `QuantizedEmbed`)."""

    quantize = staticmethod(quantize_int8)  # f[N, K] -> (i8[N, K], its scales)

    @property
    def activations(self) -> str:
        """How the layers take their input (`QuantizedLinear`)."""
        return "float"

    def layout(self, weight: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(the weight as the layer keeps it, its `wsum` or None): i8[N, K] as quantized."""
        return weight, None

    def linear(self, layer: nnx.Linear) -> QuantizedLinear:
        spec = layer.kernel.get_metadata().get("out_sharding") or (None, None)
        weight_spec = spec[::-1]  # the kernel f[K, N] transposed
        weight, scale = _quantized(self.quantize, layer.kernel[...].T, weight_spec, self.mesh)
        in_features = weight.shape[1]
        weight, wsum = self.layout(weight)
        return QuantizedLinear(weight, scale, layer.bias, spec=weight_spec, wsum=wsum,
                               in_features=in_features,
                               use_kernel=self.use_kernel, activations=self.activations)

    def embed(self, layer: nnx.Embed) -> QuantizedEmbed:
        weight, scale = _quantized(self.quantize, layer.embedding[...], (MODEL_AXIS, None),
                                   self.mesh)
        features = weight.shape[1]
        weight, wsum = self.layout(weight)
        return QuantizedEmbed(weight, scale, layer.dtype, features=features, wsum=wsum,
                              use_kernel=self.use_kernel, activations=self.activations)

    def experts(self, block: SparseMoeBlock) -> None:
        """int8 experts per expert and output channel (`quantize_experts_int8`), weight-only
        whatever the scheme's linear layers do (module doc), each scale split as its matrix's
        output axis."""
        quantized = []
        for param in (block.experts_gate_up, block.experts_down):
            spec = param.get_metadata().get("out_sharding") or (None,) * 3
            quantized += _quantized(quantize_experts_int8, param[...], spec, self.mesh,
                                    scale_spec=spec[:1] + spec[2:])
        block.set_int8_experts(*quantized)


class W8A8(Int8WeightOnly):
    """`Int8WeightOnly`'s weights, and each layer's input quantized per token (`w8a8_matmul`) at
    every step size. On the C++ kernels of a CPU with AVX-512 VNNI the weights are packed for
    the W8A8 GEMM (`pack_int8`); elsewhere they stay i8[N, K] for XLA's int8 dot, which gives
    the same bits (the kernel's portable loop would be slower than XLA's dot)."""

    activations = "int8"

    def layout(self, weight: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        if not (self.use_kernel and cpu_attention.w8a8_isa() == "avx512-vnni"):
            return weight, None
        return jax.jit(pack_int8)(weight)


class Q8_0(Int8WeightOnly):
    """GGUF Q8_0: int8 weights with one scale per 32 values along K (`q8_0_matmul`); on a Q8_0
    GGUF file, the file's own blocks (`quantized_matmul` module doc). Steps of a few tokens on
    the C++ kernel quantize the activations the same way (llama.cpp's Q8_0 product), larger
    ones multiply them in float32 ("q8_0-auto"); in batch-invariant mode every step takes the
    Q8_0 product ("q8_0")."""

    quantize = staticmethod(quantize_q8_0)

    @property
    def activations(self) -> str:
        return "q8_0" if self.batch_invariant else "q8_0-auto"


# The schemes `LLM(quantization=...)` accepts, by name (None: the float weights as loaded).
QUANTIZATION_METHODS: dict[str, type[QuantizationMethod]] = {"int8": Int8WeightOnly,
                                                             "w8a8": W8A8, "q8_0": Q8_0}


def check_quantization(method: str | None) -> None:
    """Raises ValueError unless `method` is None or a registered scheme's name."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {method!r} is not one of "
                         f"{(None, *QUANTIZATION_METHODS)}")


def quantize_model(model: nnx.Module, method: str | None, *, embeddings: bool = True,
                   mesh=None, use_kernel: bool = False,
                   batch_invariant: bool = False) -> nnx.Module:
    """Replaces `model`'s `nnx.Linear` layers (and with `embeddings` its `nnx.Embed`) by
    `method`'s quantized ones (`QUANTIZATION_METHODS`), and makes each MoE block's experts int8
    (`QuantizationMethod.experts`; the blocks' router and shared expert gate stay float), in
    place, and returns it; the float weights are then free. `method` None: no change.
    `use_kernel`: the quantized layers run the C++ matmul (one CPU device; the caller asks the
    platform). `batch_invariant`: the engine's mode (a scheme may compute a row one way only).

    Raises:
      ValueError: an unknown `method`, or a layer it cannot hold (named; Q8_0: input features
        not a multiple of 32).
    """
    check_quantization(method)
    if method is None:
        return model
    scheme = QUANTIZATION_METHODS[method](mesh=mesh, use_kernel=use_kernel and mesh is None,
                                          batch_invariant=batch_invariant)
    nodes = list(nnx.iter_graph(model))
    keep = {id(gate) for _, node in nodes if isinstance(node, SparseMoeBlock)
            for gate in node.gates()}
    for path, node in nodes:
        try:
            if isinstance(node, SparseMoeBlock):
                scheme.experts(node)
                continue
            if isinstance(node, nnx.Linear) and id(node) not in keep:
                new = scheme.linear(node)
            elif isinstance(node, nnx.Embed) and embeddings:
                new = scheme.embed(node)
            else:
                continue
        except ValueError as e:  # a layer the scheme cannot hold (Q8_0: K % 32)
            raise ValueError(f"quantization {method!r} of {'.'.join(map(str, path))}: {e}") \
                from e
        if new is not None:
            _replace(model, path, new)
    return model


def _replace(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
    """Sets the node at `path` in `model`'s graph to `new`."""
    parent = model
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)


def activation_modes(model: nnx.Module) -> str:
    """How each quantized layer takes its input, in graph order ("float", "int8", "q8_0", ...;
    `QuantizedLinear`): the same parameters, another program (the step cache's key)."""
    return ",".join(node.activations for _, node in nnx.iter_graph(model)
                    if isinstance(node, (QuantizedLinear, QuantizedEmbed)))


def weight_bytes(params) -> int:
    """Bytes of every array in a parameter tree (all shards of a sharded one)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))
