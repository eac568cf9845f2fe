"""LoRA adapters on the projections, many in one step (Hu et al. 2021, "LoRA", section 4.1;
batched as S-LoRA and Punica do, Sheng et al. 2023, section 4).

A projection `y = x @ W` under adapter a becomes `y = x @ W + s_a * (x @ A_a) @ B_a`, with
`A_a: f[in, r]`, `B_a: f[r, out]` and `s_a = alpha / r` (`alpha / sqrt(r)` with rsLoRA). The
engine keeps `max_loras` adapters on the device at once, each in a slot, and every token of a
packed step carries its sequence's slot (`ModelInput.lora_slots`; 0: no adapter). `LoRA` holds
every slot's weights of one projection, zero-padded to `max_lora_rank` with `s_a` folded into
B, and adds each token's own adapter's product (`pallas_kernels.lora_matmul`): on one CPU
device in float32, by the C++ kernel that groups the tokens by slot and runs each group through
its own adapter; elsewhere in two matmuls over all slots, `x @ A` for every slot at once, masked
to the token's slot (a one-hot), then `@ B`. Shapes never depend on which adapters are loaded,
so loading or replacing one recompiles nothing.

A stacked projection (q/k/v in `qkv_proj`, gate/up in `gate_up_proj`, `models.layers`) has one
A and one B per part: the parts' A side by side on the rank axis (they read the same input) and
each part's B apart, so the product costs what the unstacked projections' would. The parts'
outputs are laid out as the stacked kernel's (shard by shard under tensor parallelism). The
weights carry partition specs as their base layer's: a column-parallel projection's B split on
its output axis, a row-parallel one's A on its input axis (XLA adds the all-reduce that the
base layer's already needs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.pallas_kernels import lora_matmul
from jaxpaged.pallas_kernels.backends import MODEL_AXIS

# The projections an adapter may target, by the attribute of the layer that holds them, and
# whether each is column- (True) or row-parallel under tensor parallelism (`models.layers`).
TARGETS = {"qkv_proj": True, "o_proj": False, "gate_up_proj": True, "down_proj": False}


class LoRAWeight(nnx.Variable):
    """Adapter slots' weights: written by the engine (`LoRAManager`), never trained here."""


@dataclasses.dataclass(frozen=True)
class LoRASite:
    """One projection that adapters can change: `path` (of the projection in the model, e.g.
    "layers.3.self_attn.qkv_proj"), its input size and its parts' output sizes as the model
    holds them (global, a repeated KV head counted each time)."""

    path: str
    in_features: int
    part_widths: tuple[int, ...]
    column_parallel: bool


class LoRA(nnx.Module):
    """Every slot's adapter of one projection.

    lora_a: f[max_loras, in, parts * max_lora_rank]; lora_b: one f[max_loras, max_lora_rank,
    out_p] per part p. Slot s of the engine (1..max_loras) is index s - 1. The products run
    on the CPU kernel (`pallas_kernels.lora_matmul`: each token's own adapter only) where it is
    built with `lora_kernel` (the model's `KernelPlan.lora_matmul`), else as a one-hot over
    the slots.
    """

    def __init__(self, site: LoRASite, *, max_loras: int, max_lora_rank: int, dtype,
                 tensor_parallel_size: int, mesh=None, lora_kernel: bool = False):
        self.max_loras, self.rank = max_loras, max_lora_rank
        self.lora_kernel = lora_kernel
        self.tp = tensor_parallel_size
        num_parts = len(site.part_widths)
        a_spec = (None, None, None) if site.column_parallel else (None, MODEL_AXIS, None)
        b_spec = (None, None, MODEL_AXIS) if site.column_parallel else (None, None, None)
        self.lora_a = _zeros((max_loras, site.in_features, num_parts * max_lora_rank), dtype,
                             a_spec, mesh)
        self.lora_b = nnx.List([_zeros((max_loras, max_lora_rank, width), dtype, b_spec, mesh)
                                for width in site.part_widths])

    def __call__(self, x: jax.Array, slots: jax.Array) -> jax.Array:
        """The adapters' change to the projection of x: f[T, in] with i32[T] slots -> f[T, out]
        in x's dtype (0 for tokens of slot 0)."""
        a, bs = self.lora_a[...], [b[...] for b in self.lora_b]
        if self.lora_kernel and self.tp == 1 and lora_matmul.fits(x, a, bs):
            return lora_matmul.lora_matmul(x, slots, a, bs)
        return lora_matmul.lora_matmul_reference(x, slots, a, bs, num_shards=self.tp)


def _zeros(shape: tuple, dtype, spec: tuple, mesh) -> LoRAWeight:
    if mesh is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = jax.jit(lambda: jnp.zeros(shape, dtype),
                        out_shardings=NamedSharding(mesh, P(*spec)))()
    with nnx.use_eager_sharding(False):
        return LoRAWeight(value, out_sharding=spec)


def lora_sites(model: nnx.Module) -> list[LoRASite]:
    """The projections of `model` that adapters can change (`TARGETS` in each decoder layer),
    with their parts as the loader stacks them (`model.part_widths`, KV heads repeated as
    `config.kv_head_replicas` says)."""
    config = model.config
    widths = type(model).part_widths(config)
    replicas = config.kv_head_replicas
    kv_parts = type(model).KV_HEAD_PARTS
    sites = []
    for i, layer in enumerate(model.layers):
        for owner_name in ("self_attn", "mlp"):
            owner = getattr(layer, owner_name)
            for attr in TARGETS:
                base = getattr(owner, attr, None)
                if base is None:
                    continue
                below = f"{owner_name}.{attr}.kernel"
                in_features, out = _base_shape(base)
                parts = widths.get(below, (out,))
                repeated = kv_parts.get(below, ()) if replicas > 1 else ()
                parts = tuple(w * replicas if j in repeated else w for j, w in enumerate(parts))
                assert sum(parts) == out, (below, parts, out)
                sites.append(LoRASite(f"layers.{i}.{owner_name}.{attr}", in_features, parts,
                                      TARGETS[attr]))
    return sites


def _base_shape(base: nnx.Module) -> tuple[int, int]:
    """(in, out) of a float (`kernel: f[in, out]`) or int8 (`QuantizedLinear`) layer."""
    if hasattr(base, "kernel"):
        return tuple(base.kernel.shape)
    return base.in_features, base.out_features


def enable_lora(model: nnx.Module, *, max_loras: int, max_lora_rank: int, dtype,
                mesh=None) -> list[LoRASite]:
    """Gives each projection of `model` its adapter slots (`LoRA`, zeros: every slot is the
    base model until the engine writes one), in place; returns the sites. The base layers keep
    their paths, so checkpoints and `update_params` see the same tree plus `*_lora`."""
    sites = lora_sites(model)
    for site in sites:
        *owner_path, attr = site.path.split(".")
        owner = model
        for key in owner_path:
            owner = owner[int(key)] if key.isdigit() else getattr(owner, key)
        setattr(owner, f"{attr}_lora", LoRA(
            site, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype,
            tensor_parallel_size=model.config.tensor_parallel_size, mesh=mesh,
            lora_kernel=model.config.kernels.lora_matmul))
    return sites


def project(base: nnx.Module, lora: LoRA | None, x: jax.Array,
            slots: jax.Array | None) -> jax.Array:
    """`base(x)`, plus each token's adapter where the layer has slots and the step carries
    them (x: f[T, in]; slots: i32[T] or None)."""
    y = base(x)
    if lora is None or slots is None:
        return y
    return y + lora(x, slots)
