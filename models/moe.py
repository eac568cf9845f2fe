"""Mixture-of-Experts MLPs: top-k routing as each family defines it, and the routed experts run
dropless (every token reaches each of its k experts, whatever the batch holds) by one of four
paths that give the same results.

Routing (`Routing`, `route`) follows the Hugging Face routers:
  - softmax over all experts, then the top k, renormalized to sum to 1 or not
    (`MixtralTopKRouter`: always; `Qwen2MoeTopKRouter`, Qwen3-MoE and `OlmoeTopKRouter`: when
    the config's `norm_topk_prob`);
  - or the top k of the logits, then a softmax over those k (`GraniteMoeTopKRouter`).
The router's logits and probabilities are float32, as HF computes them.

The experts (`experts_forward`), each `down(act(gate(x)) * up(x))`, with `gate_up: f[E, D, 2F]`
(gate then up on the output axis) and `down: f[E, F, D]`:
  - "dense": every expert on every token, weighted by a [T, E] matrix that is 0 off each
    token's k experts: E / k times the work, each expert read once; the reference in tests,
    and on CPU the fastest for steps of a few dozen tokens.
  - "gathered": each token's k experts' matrices gathered per token ([T, k, D, 2F]), for steps
    of a few tokens (decode), which read only the experts they use.
  - "grouped": the T * k (token, expert) pairs sorted by expert and laid out in tiles of
    `GROUP_TILE` rows, each tile one expert's (MegaBlocks' block-sparse layout, Gale et al.
    2022, section 5: no capacity factor, no dropped token; at most one partly filled tile per
    expert), then batched matmuls over `GROUP_CHUNK` tiles at a time with each tile's expert's
    matrices (copied: the chunks bound that copy to GROUP_CHUNK experts whatever the step).
  - "kernel": the C++ kernel on CPU (`pallas_kernels.moe_experts`): the pairs grouped by
    expert, each expert's rows through its matrices read in place, no copy; the fastest at
    every step size where it runs (one CPU device, float32 activations, SiLU, D and F
    multiples of 64), so a model whose kernel plan names it (`KernelPlan.moe_experts`) takes it whatever the
    step's size.
Otherwise `experts_forward` picks among the jnp paths by the step's static size (`choose_path`).

Quantized experts (`models.quantization`) keep `gate_up: i8[E, D, 2F]` and `down: i8[E, F, D]`
with symmetric scales per expert and output channel (`scales`: `f32[E, 2F]`, `f32[E, D]`): each
path gathers or reads the int8 matrices, widens them to the activations' dtype in the matmul and
scales its output (`(x @ q) * s`, which is `x @ (q * s)` up to rounding, s being per column).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpaged.models.layers import ACTIVATIONS, GatedMLP, linear
from jaxpaged.pallas_kernels import moe_experts as experts_kernel
from jaxpaged.pallas_kernels.backends import MODEL_AXIS

# The path by step size (`choose_path`), from `bench/moe_paths.py` on a 2-core Zen 4
# (bench/results/moe-paths.json; XLA's paths, which copy the expert matrices they gather):
# steps of at most GATHER_MAX_PAIRS (token, expert) pairs gather their experts; then, while
# tokens x experts is at most DENSE_MAX_ROWS, every expert on every token (one read of each
# expert, no copy) beats sorting; larger steps sort the pairs into per-expert tiles.
GATHER_MAX_PAIRS = 16
DENSE_MAX_ROWS = 4096
GROUP_TILE = 32  # rows of one expert's tile on the grouped path
GROUP_CHUNK = 16  # tiles the grouped path multiplies at once
JNP_PATHS = ("dense", "gathered", "grouped")  # any shapes, shards and activation
PATHS = (*JNP_PATHS, "kernel")


@dataclasses.dataclass(frozen=True)
class Routing:
    """A family's top-k router (see the module docstring)."""

    top_k: int  # experts per token
    softmax_first: bool = True  # softmax over all experts, then top-k (False: top-k, softmax)
    renormalize: bool = True  # the k softmax-first weights divided by their sum


def route(logits: jax.Array, routing: Routing) -> tuple[jax.Array, jax.Array]:
    """(f32[T, k] weights, i32[T, k] expert ids, most likely first) of router logits [T, E].
    Ties go to the lower expert id (`lax.top_k`, as `torch.topk` on CPU)."""
    logits = logits.astype(jnp.float32)
    if not routing.softmax_first:
        top, ids = jax.lax.top_k(logits, routing.top_k)
        return jax.nn.softmax(top, axis=-1), ids
    top, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), routing.top_k)
    if routing.renormalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, ids


# The list each MoE layer appends its expert ids to while `recording_routes` is active.
_ROUTES: contextvars.ContextVar[list | None] = contextvars.ContextVar("routes", default=None)


@contextlib.contextmanager
def recording_routes():
    """Within it, every `SparseMoeBlock` the model runs appends its i32[T, k] expert ids (most
    likely first) to the list it yields, in layer order: a trace-time side channel that leaves
    the models' signatures alone. `stacked_routes` turns the list into one array."""
    routes = []
    token = _ROUTES.set(routes)
    try:
        yield routes
    finally:
        _ROUTES.reset(token)


def stacked_routes(routes: list[jax.Array]) -> jax.Array | None:
    """i16[L_moe, T, k] of the ids `recording_routes` collected (None: a model without MoE);
    int16 halves what the host reads (`worker.routed_experts` refuses more experts)."""
    return jnp.stack(routes).astype(jnp.int16) if routes else None


def _split_gate_up(h: jax.Array, tp: int) -> tuple[jax.Array, jax.Array]:
    """(gate, up) of h: f[..., 2F], laid out by shard over tp devices (`models.layers`: each
    device's block is its gate columns, then its up columns)."""
    gate, up = jnp.split(h.reshape(*h.shape[:-1], tp, -1), 2, axis=-1)
    return gate.reshape(*h.shape[:-1], -1), up.reshape(*h.shape[:-1], -1)


def _matmul(spec: str, a: jax.Array, w: jax.Array, scale) -> jax.Array:
    """einsum(spec, a, w) in a's dtype; w int8 (scale given: its per output column scales,
    broadcast to the product's shape) or float (scale None)."""
    if scale is None:
        return jnp.einsum(spec, a, w)
    return (jnp.einsum(spec, a, w.astype(a.dtype)) * scale).astype(a.dtype)


def _expert_mlp(x, gate_up, down, act, tp: int = 1, scales=None):
    """`down(act(gate) * up)` for rows x: f[..., D] and matrices batched alike (scales: theirs,
    batched alike, or None)."""
    gate_up_scale, down_scale = scales or (None, None)
    gate, up = _split_gate_up(_matmul("...d,...df->...f", x, gate_up, gate_up_scale), tp)
    return _matmul("...f,...fd->...d", act(gate) * up, down, down_scale)


def _take(scales, index):
    """The scales of the experts `index` picks, or None."""
    return None if scales is None else tuple(s[index] for s in scales)


def experts_dense(x, weights, ids, gate_up, down, act, tp: int = 1, scales=None):
    """Every expert on every token: f[T, D] (arguments as `experts_forward`'s)."""
    E = gate_up.shape[0]
    dense = jnp.zeros((x.shape[0], E), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], ids].add(weights)
    gate_up_scale, down_scale = _take(scales, (slice(None), None)) or (None, None)  # [E, 1, N]
    gate, up = _split_gate_up(_matmul("td,edf->etf", x, gate_up, gate_up_scale), tp)
    out = _matmul("etf,efd->etd", act(gate) * up, down, down_scale)
    return jnp.einsum("etd,te->td", out, dense.astype(out.dtype))


def experts_gathered(x, weights, ids, gate_up, down, act, tp: int = 1, scales=None):
    """Each token's k experts' matrices gathered: f[T, D] (arguments as `experts_forward`'s)."""
    out = _expert_mlp(x[:, None, :], gate_up[ids], down[ids], act, tp,
                      _take(scales, ids))  # [T, k, D]
    return jnp.einsum("tkd,tk->td", out, weights.astype(out.dtype))


def experts_grouped(x, weights, ids, gate_up, down, act, tp: int = 1, scales=None,
                    tile: int = GROUP_TILE):
    """The (token, expert) pairs sorted by expert into tiles of `tile` rows: f[T, D]
    (arguments as `experts_forward`'s)."""
    T, D = x.shape
    E, k = gate_up.shape[0], ids.shape[1]
    n = T * k
    # Each expert used leaves less than one tile unfilled, and at most min(n, E) are used.
    num_tiles = -(-n // tile) + min(n, E)
    flat = ids.reshape(n)
    order = jnp.argsort(flat, stable=True)  # pairs by expert, each expert's by token
    expert = flat[order]
    counts = jnp.bincount(flat, length=E)
    tiles = -(-counts // tile)  # tiles of each expert
    first_row = (jnp.cumsum(tiles) - tiles) * tile
    first_pair = jnp.cumsum(counts) - counts
    row = first_row[expert] + jnp.arange(n) - first_pair[expert]  # each sorted pair's row
    token = order // k
    rows = jnp.zeros((num_tiles * tile, D), x.dtype).at[row].set(x[token])
    # Tile t belongs to the expert whose tiles cover it; tiles past the last hold zeros.
    tile_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(tiles), jnp.arange(num_tiles),
                                               side="right"), E - 1)
    # GROUP_CHUNK tiles at a time, so that the experts' matrices copied for the tiles take at
    # most that many experts' memory whatever the step's size.
    num_chunks = -(-num_tiles // GROUP_CHUNK)
    chunk = -(-num_tiles // num_chunks)
    pad = num_chunks * chunk - num_tiles
    rows = jnp.pad(rows, ((0, pad * tile), (0, 0))).reshape(num_chunks, chunk, tile, D)
    experts = jnp.pad(tile_expert, (0, pad)).reshape(num_chunks, chunk)

    def run_chunk(c):  # one chunk's tiles [chunk, tile, D] by their experts [chunk]
        rows, ids = c
        return _expert_mlp(rows, gate_up[ids][:, None], down[ids][:, None], act, tp,
                           _take(scales, (ids, None)))

    out = jax.lax.map(run_chunk, (rows, experts)).reshape(-1, D)[:num_tiles * tile]
    pair_weight = weights.reshape(n)[order].astype(out.dtype)
    return jnp.zeros((T, D), out.dtype).at[token].add(out[row] * pair_weight[:, None])


def choose_path(num_tokens: int, top_k: int, num_experts: int) -> str:
    """The path `experts_forward` takes for a step of `num_tokens` tokens (static; see
    `GATHER_MAX_PAIRS`)."""
    if num_tokens * top_k <= GATHER_MAX_PAIRS:
        return "gathered"
    return "dense" if num_tokens * num_experts <= DENSE_MAX_ROWS else "grouped"


def experts_forward(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array,
                    down: jax.Array, act, path: str | None = None, tp: int = 1,
                    scales: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The routed experts' weighted sum for each token.

    Args:
      x: f[T, D] tokens.
      weights, ids: f32[T, k], i32[T, k] from `route`.
      gate_up: f[E, D, 2F] each expert's gate then up projection; down: f[E, F, D]; or
        int8 (i8[E, D, 2F], i8[E, F, D]) with `scales`.
      act: the activation (`models.layers.ACTIVATIONS`).
      path: one of `PATHS` ("kernel": `pallas_kernels.moe_experts`, where it `fits`, which
        the caller checks); None: `choose_path`.
      tp: the shards gate_up's columns are laid out by (tensor parallelism, `models.layers`).
      scales: int8 experts' (f32[E, 2F], f32[E, D]), per expert and output channel
        (`models.quantization`); None: float experts.

    Returns:
      f[T, D] in the matmuls' dtype.

    Raises:
      ValueError: an unknown path.
    """
    path = path or choose_path(x.shape[0], ids.shape[1], gate_up.shape[0])
    if path not in PATHS:
        raise ValueError(f"MoE path {path!r} is not one of {PATHS}")
    if path == "kernel":
        return experts_kernel.moe_experts(x, weights, ids, gate_up, down, scales)
    fn = {"dense": experts_dense, "gathered": experts_gathered, "grouped": experts_grouped}
    return fn[path](x, weights, ids, gate_up, down, act, tp, scales)


def experts_parallel(mesh, x, weights, ids, gate_up, down, act, path: str | None = None,
                     scales=None):
    """`experts_forward` with the experts (and their `scales`, if int8) split whole over the
    mesh's model axis (expert parallelism: device s holds experts s * E / tp ..): each device
    runs the pairs of its own experts (the others' with weight 0) on the replicated tokens, and
    one all-reduce sums the devices' outputs."""
    path = path or choose_path(x.shape[0], ids.shape[1], gate_up.shape[0])

    def local(x, weights, ids, gate_up, down, scales):
        E = gate_up.shape[0]
        own = ids - jax.lax.axis_index(MODEL_AXIS) * E
        mine = (own >= 0) & (own < E)
        out = experts_forward(x, jnp.where(mine, weights, 0), jnp.clip(own, 0, E - 1),
                              gate_up, down, act, path, scales=scales)
        return jax.lax.psum(out, MODEL_AXIS)

    experts = P(MODEL_AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), experts, experts, experts),
                         out_specs=P())(x, weights, ids, gate_up, down, scales)


# The checkpoint layout Qwen2/3-MoE and OLMoE share: the router `mlp.gate`, each expert's
# `mlp.experts.{j}.{gate,up,down}_proj`, stacked by expert on load (`EXPERT_TENSORS`); and
# `RUNTIME_EXPERTS_NAME_MAP`, transformers 5's own modules' (gate and up fused, experts stacked:
# what a trainer's `state_dict()` passes to `load_weights`).
_MLP = "model.layers.{i}.mlp"
RUNTIME_EXPERTS_NAME_MAP = (
    (f"{_MLP}.experts.gate_up_proj", "layers.{i}.mlp.experts_gate_up", True, None),
    (f"{_MLP}.experts.down_proj", "layers.{i}.mlp.experts_down", True, None),
)
EXPERTS_NAME_MAP = (
    (f"{_MLP}.gate.weight", "layers.{i}.mlp.router.kernel", True, None),
    (f"{_MLP}.experts.gate_proj", "layers.{i}.mlp.experts_gate_up", True, (0, 2)),
    (f"{_MLP}.experts.up_proj", "layers.{i}.mlp.experts_gate_up", True, (1, 2)),
    *RUNTIME_EXPERTS_NAME_MAP,  # its down_proj is also the stacked checkpoint's name
)
EXPERT_TENSORS = tuple((f"{_MLP}.experts.{{j}}.{p}.weight", f"{_MLP}.experts.{p}")
                       for p in ("gate_proj", "up_proj", "down_proj"))


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """A family config's Mixture-of-Experts part (its `moe` field), read from config.json."""

    num_experts: int  # E
    intermediate_size: int  # F of each routed expert
    routing: Routing
    shared_intermediate_size: int = 0  # F of the shared expert (Qwen2-MoE); 0: none
    # Which layers are sparse (Qwen2/3-MoE's `decoder_sparse_step` and `mlp_only_layers`): layer
    # i is when (i + 1) % sparse_step == 0 and i is not in mlp_only_layers; the rest are dense.
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # How the experts lie on the mesh's model axis (`for_tensor_parallel`): each expert's
    # hidden units split over the devices (False), or whole experts, E / tp per device (True).
    expert_parallel: bool = False

    def __post_init__(self):
        E, k = self.num_experts, self.routing.top_k
        if not (isinstance(E, int) and isinstance(k, int) and 1 <= k <= E):
            raise ValueError(f"num_experts_per_tok={k!r} and the number of experts {E!r}: need "
                             "1 <= num_experts_per_tok <= experts")
        if not isinstance(self.sparse_step, int) or self.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be an int >= 1, got "
                             f"{self.sparse_step!r}")

    def for_tensor_parallel(self, tp: int, expert_parallel: bool) -> "MoeSpec":
        """This spec on tp devices (see `expert_parallel`).

        Raises:
          ValueError: tp does not divide the experts (expert parallel), or their or the
            shared expert's hidden units.
        """
        need = ([("experts", self.num_experts)] if expert_parallel
                else [("experts' intermediate size", self.intermediate_size)])
        need.append(("shared expert's intermediate size", self.shared_intermediate_size))
        for name, value in need:
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the {name} "
                                 f"({value})" + ("" if expert_parallel else
                                                 "; enable_expert_parallel splits whole experts"))
        return dataclasses.replace(self, expert_parallel=expert_parallel)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) has this MoE MLP (else a dense one)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """What a Mixture-of-Experts family's config adds to its base config (listed first among
    its bases): `moe`, read from config.json by the family's `read_moe(d, config)`."""

    moe: MoeSpec = MoeSpec(8, 1, Routing(2))  # set from config.json by `from_hf_dict`

    @classmethod
    def from_hf_dict(cls, d: dict):
        config = super().from_hf_dict(d)
        return dataclasses.replace(config, moe=cls.read_moe(d, config))

    @staticmethod
    def read_moe(d: dict, config) -> MoeSpec:
        """The MoE part of config.json `d` (`config`: the rest, read)."""
        raise NotImplementedError


class MoeModel:
    """What a Mixture-of-Experts family adds to `LlamaForCausalLM` (listed first among its
    bases): each sparse layer's `SparseMoeBlock` from `config.moe`, and the widths of the
    experts' stacked gate / up."""

    def make_mlp(self, config, layer: int, dtype, rngs: nnx.Rngs):
        spec = config.moe
        if not spec.is_sparse(layer):
            return None
        return SparseMoeBlock(config, dtype=dtype, rngs=rngs, routing=spec.routing,
                              num_experts=spec.num_experts,
                              intermediate_size=spec.intermediate_size,
                              shared_intermediate_size=spec.shared_intermediate_size,
                              expert_parallel=spec.expert_parallel, mesh=self.backend.mesh)

    @classmethod
    def part_widths(cls, config) -> dict[str, tuple[int, ...]]:
        spec = config.moe
        widths = {**super().part_widths(config),
                  "mlp.experts_gate_up": (spec.intermediate_size,) * 2}
        if spec.shared_intermediate_size:
            widths["mlp.shared_expert.gate_up_proj.kernel"] = (
                spec.shared_intermediate_size,) * 2
        return widths


class SparseMoeBlock(nnx.Module):
    """A layer's MoE MLP: the router (`router.kernel: f[D, E]`, a bias where the family has
    one), the E routed experts stacked (`experts_gate_up: f[E, D, 2F]`, gate then up;
    `experts_down: f[E, F, D]`), and a shared expert every token takes where the config has one
    (`Qwen2MoeSparseMoeBlock.shared_expert`, scaled by `sigmoid(shared_expert_gate(x))`).
    Quantized (`set_int8_experts`), the experts are int8 with `experts_gate_up_scale:
    f32[E, 2F]` and `experts_down_scale: f32[E, D]` (None while float).

    `path`: forces one of `PATHS` (tests, benchmarks); None: the C++ kernel where the config's
    kernel plan names it (`config.kernels.moe_experts`, kept as `moe_kernel`) and it fits,
    else `choose_path` by step size.
    """

    path: str | None = None

    def __init__(self, config, *, dtype, rngs: nnx.Rngs, routing: Routing, num_experts: int,
                 intermediate_size: int, shared_intermediate_size: int = 0,
                 router_bias: bool = False, expert_parallel: bool = False, mesh=None):
        D, E, F = config.hidden_size, num_experts, intermediate_size
        self.routing = routing
        self.moe_kernel = config.kernels.moe_experts
        self.tp = config.tensor_parallel_size
        # Expert parallelism's mesh (whole experts per device), or None: each expert's hidden
        # units split over the model axis, as a dense MLP's (`models.layers`).
        self.mesh = mesh if expert_parallel and self.tp > 1 else None
        self.router = linear(D, E, dtype, rngs, bias=router_bias, kernels=config.kernels)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        spec = ((MODEL_AXIS, None, None), (MODEL_AXIS, None, None)) if expert_parallel else (
            (None, None, MODEL_AXIS), (None, MODEL_AXIS, None))
        self.experts_gate_up = nnx.Param(nnx.with_partitioning(init, spec[0])(
            rngs.params(), (E, D, 2 * F), dtype))
        self.experts_down = nnx.Param(nnx.with_partitioning(init, spec[1])(
            rngs.params(), (E, F, D), dtype))
        self.experts_gate_up_scale = nnx.data(None)  # f32 scales of int8 experts
        self.experts_down_scale = nnx.data(None)
        self.act = ACTIVATIONS[config.hidden_act]
        self.activation = config.hidden_act
        shared = shared_intermediate_size > 0
        self.shared_expert = (GatedMLP(config, dtype=dtype, rngs=rngs,
                                       intermediate_size=shared_intermediate_size)
                              if shared else None)
        self.shared_expert_gate = (linear(D, 1, dtype, rngs, kernels=config.kernels)
                                   if shared else None)

    def gates(self) -> tuple[nnx.Module, ...]:
        """The layers that route or gate (the router, the shared expert's gate): quantization
        leaves them float, as vLLM does."""
        return tuple(g for g in (self.router, self.shared_expert_gate) if g is not None)

    def set_int8_experts(self, gate_up: jax.Array, gate_up_scale: jax.Array, down: jax.Array,
                         down_scale: jax.Array) -> None:
        """Replaces the float experts by int8 ones, laid out as the float were (their partition
        specs; each scale's, the matrix's without its input axis).

        Args:
          gate_up: i8[E, D, 2F] and gate_up_scale: f32[E, 2F]; down: i8[E, F, D] and
            down_scale: f32[E, D] (`experts_gate_up ~= gate_up * gate_up_scale[:, None]`).

        Raises:
          ValueError: shapes or dtypes that do not match the float experts'.
        """
        E, D, F2 = self.experts_gate_up.shape
        want = {"gate_up": (gate_up, (E, D, F2)), "gate_up_scale": (gate_up_scale, (E, F2)),
                "down": (down, (E, F2 // 2, D)), "down_scale": (down_scale, (E, D))}
        for name, (a, shape) in want.items():
            dtype = jnp.float32 if name.endswith("scale") else jnp.int8
            if a.shape != shape or a.dtype != dtype:
                raise ValueError(f"int8 experts: {name} must be {jnp.dtype(dtype).name}"
                                 f"{list(shape)}, got {a.dtype}{list(a.shape)}")
        specs = [p.get_metadata().get("out_sharding") or (None,) * 3
                 for p in (self.experts_gate_up, self.experts_down)]
        with nnx.use_eager_sharding(False):
            self.experts_gate_up = nnx.Param(gate_up, out_sharding=specs[0])
            self.experts_gate_up_scale = nnx.Param(gate_up_scale,
                                                   out_sharding=specs[0][:1] + specs[0][2:])
            self.experts_down = nnx.Param(down, out_sharding=specs[1])
            self.experts_down_scale = nnx.Param(down_scale,
                                                out_sharding=specs[1][:1] + specs[1][2:])

    def __call__(self, x: jax.Array, slots: jax.Array | None = None) -> jax.Array:
        """x: f[T, D] -> f[T, D]; `slots` (LoRA) are not taken by MoE layers."""
        weights, ids = route(self.router(x), self.routing)
        if (recorded := _ROUTES.get()) is not None:
            recorded.append(ids)
        gate_up, down = self.experts_gate_up[...], self.experts_down[...]
        scales = None if self.experts_gate_up_scale is None else (
            self.experts_gate_up_scale[...], self.experts_down_scale[...])
        if self.mesh is not None:
            out = experts_parallel(self.mesh, x, weights, ids, gate_up, down, self.act,
                                   self.path, scales)
        else:
            path = self.path
            if path is None and self.moe_kernel and experts_kernel.fits(
                    x, gate_up, down, self.activation, self.tp):
                path = "kernel"
            out = experts_forward(x, weights, ids, gate_up, down, self.act, path, self.tp,
                                  scales)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.astype(x.dtype)

