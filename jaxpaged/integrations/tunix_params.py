"""tunix's parameter trees mapped onto the engine's, on the device (`JaxpagedRollout`).

tunix 0.1.7's models (`tunix.models.llama3`, `qwen2`, `qwen3`, `gemma3`) name and shape their
parameters their own way: `layers.0.attn.q_proj.w: f[D, N, H]` (an einsum weight),
`layers.0.attn.o_proj.w: f[N, H, D]`, `layers.0.mlp.gate_proj.kernel: f[D, F]`, Gemma 3's
`attn.q_einsum.w: f[N, D, H]` and `attn.kv_einsum.w: f[2, K, D, H]`, `embedder.input_embedding`,
`final_norm.w` or `.scale`. Each name is mapped to the Hugging Face tensor it was loaded from
(the inverse of tunix's own `params.py` loaders, as tunix maps its models onto vLLM's in
`tunix/models/*/mapping_vllm_jax.py`) and reshaped to the engine's orientation (kernels
`f[in, out]`); the family's name map (`NAME_MAP`) then places it in the engine's tree, where
the checkpoint loader's `assembler` stacks q/k/v and gate/up and repeats KV heads for tensor
parallelism. Everything runs in one jitted function per tree layout: tunix syncs weights
under `jax.transfer_guard(..."disallow_explicit")`, so nothing may go through the host.

qwix's LoRA parameters (`nnx.LoRAParam`) are named after the weight they adapt,
`<weight>_lora_a: f[<contracted dims>, r]` and `<weight>_lora_b: f[r, <output dims>]`
(`qwix/_src/providers/lora.py`); they map onto PEFT's `lora_A.weight: f[r, in]` and
`lora_B.weight: f[out, r]` of the same Hugging Face module (Gemma 3's fused `kv_einsum` gives
k and v one shared A).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.models.loader import _compile, _match_name, assembler, flat_params, plan_load
from jaxpaged.models.loader import single_device_mesh

_ATTN = "model.layers.{i}.self_attn"


def _in_heads(w):  # f[D, N, H] -> f[D, N * H]
    return w.reshape(w.shape[0], -1)


def _heads_in(w):  # f[N, H, D] -> f[N * H, D]
    return w.reshape(-1, w.shape[-1])


def _n_in_h(w):  # f[N, D, H] -> f[D, N * H]
    return jnp.swapaxes(w, 0, 1).reshape(w.shape[1], -1)


def _same(w):
    return w


# tunix path (a regular expression, `(\d+)` the layer) -> the Hugging Face tensors it holds:
# (name, index into the tunix weight's first axis or None, layout to the engine's orientation).
TUNIX_NAMES: tuple[tuple[str, tuple[tuple[str, int | None, Callable], ...]], ...] = (
    (r"embedder\.input_embedding", (("model.embed_tokens.weight", None, _same),)),
    (r"lm_head\.w", (("lm_head.weight", None, _same),)),
    (r"final_norm\.(?:w|scale)", (("model.norm.weight", None, _same),)),
    (r"layers\.(\d+)\.(?:input_layernorm\.w|pre_attention_norm\.scale)",
     (("model.layers.{i}.input_layernorm.weight", None, _same),)),
    (r"layers\.(\d+)\.(?:post_attention_layernorm\.w|post_attention_norm\.scale)",
     (("model.layers.{i}.post_attention_layernorm.weight", None, _same),)),
    (r"layers\.(\d+)\.pre_ffw_norm\.scale",
     (("model.layers.{i}.pre_feedforward_layernorm.weight", None, _same),)),
    (r"layers\.(\d+)\.post_ffw_norm\.scale",
     (("model.layers.{i}.post_feedforward_layernorm.weight", None, _same),)),
    (r"layers\.(\d+)\.attn\.(q|k|v)_proj\.w", ((_ATTN + ".{0}_proj.weight", None, _in_heads),)),
    (r"layers\.(\d+)\.attn\.(q|k|v)_bias", ((_ATTN + ".{0}_proj.bias", None, _same),)),
    (r"layers\.(\d+)\.attn\.(q|k)_norm\.w", ((_ATTN + ".{0}_norm.weight", None, _same),)),
    (r"layers\.(\d+)\.attn\._query_norm\.scale", ((_ATTN + ".q_norm.weight", None, _same),)),
    (r"layers\.(\d+)\.attn\._key_norm\.scale", ((_ATTN + ".k_norm.weight", None, _same),)),
    (r"layers\.(\d+)\.attn\.(?:o_proj|attn_vec_einsum)\.w",
     ((_ATTN + ".o_proj.weight", None, _heads_in),)),
    (r"layers\.(\d+)\.attn\.q_einsum\.w", ((_ATTN + ".q_proj.weight", None, _n_in_h),)),
    (r"layers\.(\d+)\.attn\.kv_einsum\.w", ((_ATTN + ".k_proj.weight", 0, _n_in_h),
                                             (_ATTN + ".v_proj.weight", 1, _n_in_h))),
    (r"layers\.(\d+)\.attn\.qkv_einsum\.w", ((_ATTN + ".q_proj.weight", 0, _n_in_h),
                                              (_ATTN + ".k_proj.weight", 1, _n_in_h),
                                              (_ATTN + ".v_proj.weight", 2, _n_in_h))),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.kernel",
     (("model.layers.{i}.mlp.{0}_proj.weight", None, _same),)),
)
_PATTERNS = [(re.compile(pattern + "$"), targets) for pattern, targets in TUNIX_NAMES]


def hf_tensors(path: str) -> tuple[tuple[str, int | None, Callable], ...]:
    """The Hugging Face tensors (name, index, layout) that tunix parameter `path` holds.

    Raises:
      ValueError: a path no tunix Llama 3, Qwen 2, Qwen 3 or Gemma 3 parameter has (named).
    """
    for pattern, targets in _PATTERNS:
        m = pattern.match(path)
        if m:
            layer, *groups = m.groups() if path.startswith("layers.") else (None, *m.groups())
            return tuple((name.format(*groups, i=layer), index, layout)
                         for name, index, layout in targets)
    raise ValueError(f"tunix parameter {path!r} is not one the engine can map (tunix's Llama 3,"
                     " Qwen 2, Qwen 3 and Gemma 3 models)")


def tunix_paths(state) -> dict[str, jax.Array]:
    """path -> array of an `nnx.State` (or nested dict) of a tunix model, `nnx.List` indices
    included ("layers.0.attn.q_proj.w")."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    keys = (jax.tree_util.DictKey, jax.tree_util.SequenceKey)  # not a Variable's `.value`
    return {".".join(str(getattr(k, "key", getattr(k, "idx", None))) for k in path
                     if isinstance(k, keys)): x
            for path, x in leaves}


class TunixParams:
    """Maps a tunix model's `nnx.Param` state onto an engine's parameter tree
    (`LLM.get_params()`'s layout), jitted once per tree layout.

    Args:
      engine: the `LLMEngine` (its family, config, dtype and mesh are read).

    Raises:
      ValueError (when called): the engine's weights are quantized; a tunix parameter with
        no place in the engine, or an engine parameter no tunix parameter fills (named).
    """

    def __init__(self, engine):
        weights = engine.weights
        self.engine = engine
        self.model_cls, self.config, self.dtype = (weights.model_cls, weights.model_config,
                                                   weights.dtype)
        self.quantization = weights.quantization
        self.mesh = engine.runner.mesh or single_device_mesh()
        self.plan = plan_load(self.model_cls, self.config, dtype=self.dtype)
        self._jitted: dict[tuple, Callable] = {}

    def __call__(self, state) -> dict[str, jax.Array]:
        """The engine's parameters (flat, by path, adapter slots kept as served) with the
        weights of tunix state `state` (an `nnx.State` of `nnx.Param`s, on any devices)."""
        if self.quantization is not None:
            raise ValueError(f"update_params: a tunix model's weights are float and this "
                             f"engine's are quantized ({self.quantization!r})")
        named = tunix_paths(state)
        key = tuple((p, x.shape, x.dtype) for p, x in named.items())
        if key not in self._jitted:
            self._jitted[key] = jax.jit(self._build(named))
        # Onto the engine's mesh first (a copy between devices, none through the host): the
        # actor's arrays carry tunix's mesh, whose axes the engine's layout does not know.
        replicated = NamedSharding(self.mesh, P())
        leaves = self._jitted[key](jax.device_put(list(named.values()), replicated))
        current = flat_params(self.engine.get_params())
        return {**current, **dict(zip(self.plan.params, leaves))}

    def _build(self, named: dict) -> Callable:
        """The function from the tunix leaves (in `named`'s order) to the plan's parameters."""
        patterns = _compile(self.model_cls.NAME_MAP)
        where: dict[str, tuple[int, int | None, Callable]] = {}  # piece key -> its source
        for n, path in enumerate(named):
            for hf_name, index, layout in hf_tensors(path):
                try:
                    match = _match_name(patterns, hf_name, self.config, self.plan.params)
                except KeyError:
                    raise ValueError(f"tunix parameter {path!r} ({hf_name}) has no place in "
                                     f"this engine's {self.model_cls.__name__}") from None
                if match is not None:
                    ours, _, part = match
                    where[ours if part is None else f"{ours}#{part[0]}"] = (n, index, layout)
        missing = [piece.key for piece in self.plan.pieces if piece.key not in where]
        if missing:
            raise ValueError(f"update_params: the tunix state fills no {missing[:4]} of the "
                             "engine's parameters")
        assemble = assembler(self.plan, self.config, self.mesh, self.dtype)

        def fn(leaves):
            pieces = []
            for _, _, param_pieces in self.plan.params.values():
                row = []
                for piece in param_pieces:
                    n, index, layout = where[piece.key]
                    x = leaves[n] if index is None else leaves[n][index]
                    row.append(layout(x).astype(self.dtype))
                pieces.append(row)
            return assemble(pieces)
        return fn


def peft_lora_tensors(state, rank: int) -> dict[str, jax.Array]:
    """PEFT-named LoRA tensors (`base_model.model.<module>.lora_A.weight: f[r, in]`,
    `lora_B.weight: f[out, r]`) of a qwix `nnx.LoRAParam` state of a tunix model; traceable
    (call it under jit: it only reshapes).

    Raises:
      ValueError: a name that is no LoRA weight of a mappable tunix parameter, or an A
        without its B.
    """
    named = tunix_paths(state)
    out = {}
    for path, a in named.items():
        if not path.endswith("_lora_a"):
            if not path.endswith("_lora_b"):
                raise ValueError(f"tunix LoRA parameter {path!r} is not a qwix lora_a/lora_b")
            continue
        weight = path.removesuffix("_lora_a")
        b = named.get(weight + "_lora_b")
        if b is None:
            raise ValueError(f"tunix LoRA parameter {path!r} has no {weight}_lora_b")
        a_peft = a.reshape(-1, rank).T  # [r, in]
        for hf_name, index, _ in hf_tensors(weight):
            b_part = b if index is None else b[:, index]
            module = "base_model.model." + hf_name.removesuffix(".weight")
            out[module + ".lora_A.weight"] = a_peft
            out[module + ".lora_B.weight"] = b_part.reshape(rank, -1).T  # [out, r]
    return out


def is_qwix_tree(tensors) -> bool:
    """Whether `tensors` is a qwix `nnx.LoRAParam` tree (a leaf named `..._lora_a`) rather
    than PEFT-named arrays."""
    return any(p.endswith("_lora_a") for p in tunix_paths(tensors))


def qwix_lora_tensors(state) -> dict[str, jax.Array]:
    """`peft_lora_tensors` of a qwix `nnx.LoRAParam` state (or its nested dict), its rank read
    from the A weights, on the device (jitted once per rank and tree layout).

    Raises:
      ValueError: as `peft_lora_tensors`, or a tree with no `_lora_a` weight.
    """
    ranks = {x.shape[-1] for p, x in tunix_paths(state).items() if p.endswith("_lora_a")}
    if len(ranks) != 1:
        raise ValueError(f"tensors: a qwix LoRA tree needs `_lora_a` weights of one rank, got "
                         f"ranks {sorted(ranks)}")
    return _jitted_peft_lora_tensors(ranks.pop())(state)


@functools.lru_cache(maxsize=8)
def _jitted_peft_lora_tensors(rank: int):
    return jax.jit(functools.partial(peft_lora_tensors, rank=rank))
