"""Loads checkpoints into the NNX models, by each family's declarative name map (`NAME_MAP` on
the model class), each device reading only its own shard.

Each entry maps a HF parameter name (with `{i}` standing for the layer index) to the path of our
parameter, says whether the matrix is transposed (HF `nn.Linear.weight` is `[out, in]`, NNX
`Linear.kernel` is `[in, out]`), and which part of a stacked parameter it is: q, k and v go side
by side along the output axis of one `qkv_proj`, gate and up of one `gate_up_proj` (vLLM's
`stacked_params_mapping`). A HF tensor that is already stacked (Phi-3's `qkv_proj`) is read as
its parts. Loading fails if a checkpoint key is left unused, a parameter (or part) is left
unfilled, or a shape differs.

Loading goes in two steps. First every *piece* (a whole parameter, or one part of a stacked
one, in our orientation) becomes a `jax.Array` laid out by the parameter's partition spec
(`models.layers`): each device gets its slice, read from the file (safetensors' `get_slice`)
or restored by orbax (`jaxpaged.checkpoint`); a per-KV-head part that tensor parallelism
repeats (`LlamaConfig.for_tensor_parallel`) is replicated, being small. Then one jitted
`shard_map` assembles each device's parameters from its pieces with no communication: stacked
parts side by side shard by shard, each device's copy of its KV head sliced out.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors import safe_open

from jaxpaged.pallas_kernels.backends import DATA_AXIS, MODEL_AXIS, AttentionBackend


# Keys some checkpoints carry that the model does not use (precomputed RoPE buffers).
IGNORED_KEYS = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)


def _compile(name_map):
    return [(re.compile(re.escape(hf).replace(r"\{i\}", r"(\d+)") + "$"), ours, t, part)
            for hf, ours, t, part in name_map]


def read_safetensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of `model_dir/*.safetensors` as NumPy arrays, by HF name."""
    tensors = {}
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def _safetensors_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(model_dir)!r} has no *.safetensors weights")
    return files


def flat_params(params) -> dict:
    """path ("layers.0.self_attn.qkv_proj.kernel") -> leaf, of an `nnx.State` or of its pure
    nested dict (`nnx.to_pure_dict`), in the tree's order."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)): x
            for path, x in leaves}


def _match_name(patterns, key: str, config, params) -> tuple[str, bool, tuple | None] | None:
    """(our path, transpose, (part, parts) or None) of checkpoint tensor `key` among the
    compiled name map `patterns`; None for a key to skip (an ignored buffer, or the LM head
    beside tied embeddings).

    Raises:
      KeyError: the key names no parameter in `params` (no entry matches, or a layer past the
        config's); the caller words the error.
    """
    for pattern, ours, transpose, part in patterns:
        m = pattern.match(key)
        if m:
            break
    else:
        if any(p.fullmatch(key) for p in IGNORED_KEYS):
            return None
        raise KeyError(key)
    path = ours.format(i=int(m.group(1))) if m.groups() else ours
    if path not in params:
        if path == "lm_head.kernel" and config.tie_word_embeddings:
            return None  # tied: the embedding is the head
        raise KeyError(key)
    return path, transpose, part


def single_device_mesh() -> Mesh:
    """The mesh of one device (the default device) with the same axes as a TP mesh."""
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), (DATA_AXIS, MODEL_AXIS))


@dataclasses.dataclass(frozen=True)
class Piece:
    """A parameter, or one part of a stacked parameter, as the model holds it."""

    path: str  # our parameter's path
    part: int | None  # its part (None: the whole parameter)
    shape: tuple[int, ...]  # in our orientation; for a repeated KV part, the checkpoint's heads
    spec: P  # how it is laid out over the mesh
    hf_name: str | None  # its HF name in the name map (None: a part stacked in the file too)
    # A KV part tensor parallelism repeats (`LlamaConfig.for_tensor_parallel`): replicated
    # whole, each device then slices out its head.
    repeated: bool = False

    @property
    def key(self) -> str:
        """Its name: the path, with `#j` for part j (an orbax checkpoint's key)."""
        return self.path if self.part is None else f"{self.path}#{self.part}"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a safetensors checkpoint holds a piece."""

    key: str  # the tensor's name
    transpose: bool  # the file holds the piece transposed
    offset: int  # first output column in the tensor (a part of a tensor stacked in the file)


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """The model's pieces and where each goes (`plan_load`)."""

    graphdef: nnx.GraphDef
    abstract_state: nnx.State
    params: dict[str, tuple[tuple[int, ...], P, tuple[Piece, ...]]]  # path -> shape, spec, pieces

    @property
    def pieces(self) -> list[Piece]:
        return [piece for _, _, pieces in self.params.values() for piece in pieces]


def plan_load(model_cls: type[nnx.Module], config,
              attention_backend: AttentionBackend | str = "xla", dtype=jnp.float32) -> LoadPlan:
    """The pieces of a `model_cls` for `config`: each parameter, or each part of a stacked one
    (widths from `part_widths(config)`), with its partition spec."""
    abstract = nnx.eval_shape(lambda: model_cls(
        config, dtype=dtype, attention_backend=attention_backend, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    paths = list(flat_params(abstract_state))
    leaves = jax.tree_util.tree_leaves(abstract_state)
    specs = jax.tree_util.tree_leaves(nnx.get_partition_spec(abstract_state),
                                      is_leaf=lambda x: isinstance(x, P))
    parts_of: dict[str, list[str]] = {}  # stacked parameter -> its parts' HF names, in order
    for hf, ours, _, part in model_cls.NAME_MAP:
        if part:
            parts_of.setdefault(ours, [""] * part[1])[part[0]] = hf
    widths = model_cls.part_widths(config)
    params = {}
    for path, leaf, spec in zip(paths, leaves, specs):
        template = re.sub(r"^layers\.\d+\.", "layers.{i}.", path)
        below = template.split(".", 2)[-1]
        layer = re.match(r"layers\.(\d+)\.", path)
        if below not in widths:
            pieces = [Piece(path, None, leaf.shape, spec, None)]
        else:
            hf_names = parts_of.get(template)  # None: stacked in the file too (Phi-3)
            names = ([n.format(i=layer.group(1) if layer else None) for n in hf_names]
                     if hf_names else [None] * len(widths[below]))
            pieces = []
            for j, (name, width) in enumerate(zip(names, widths[below])):
                repeated = (config.kv_head_replicas > 1
                            and j in model_cls.KV_HEAD_PARTS.get(below, ()))
                pieces.append(Piece(path, j, (*leaf.shape[:-1], width),
                                    P() if repeated else spec, name, repeated))
        params[path] = (tuple(leaf.shape), spec, tuple(pieces))
    return LoadPlan(graphdef, abstract_state, params)


def match_checkpoint(model_cls: type[nnx.Module], config, plan: LoadPlan,
                     shapes: dict[str, tuple[int, ...]]) -> dict[str, Source]:
    """Where each piece of `plan` lies among checkpoint tensors `shapes` (HF name -> shape), by
    `Piece.key`.

    Raises:
      ValueError: a checkpoint key matches no entry of the name map, a parameter (or a part of a
        stacked one) gets no tensor (or a layer is missing), or a tensor's shape differs from the
        parameter's.
    """
    found: dict[str, dict[int | None, tuple[str, bool]]] = {}  # path -> part -> (key, transpose)
    unused = []
    patterns = _compile(model_cls.NAME_MAP)
    for key in shapes:
        try:
            match = _match_name(patterns, key, config, plan.params)
        except KeyError:
            unused.append(key)
            continue
        if match is not None:
            ours, transpose, part = match
            found.setdefault(ours, {})[part[0] if part else None] = (key, transpose)
    if unused:
        raise ValueError(f"checkpoint keys not used by the model: {unused[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}")

    sources = {}
    for path, (_, _, pieces) in plan.params.items():
        got = found.get(path, {})
        whole = got.get(None)
        for piece in pieces:
            if piece.part is None or piece.part not in got:
                if whole is None:
                    raise ValueError(f"parameter {path} has no tensor in the checkpoint" + (
                        f" for its part {piece.hf_name}" if piece.hf_name else ""))
                key, transpose = whole  # the whole parameter, or all its parts in one tensor
                offset = sum(p.shape[-1] for p in pieces[:piece.part or 0])
                want = (*piece.shape[:-1], sum(p.shape[-1] for p in pieces))
            else:
                (key, transpose), offset, want = got[piece.part], 0, piece.shape
            if transpose:
                want = _swap_last(want)
            if tuple(shapes[key]) != tuple(want):
                named = f" (part {piece.hf_name or key})" if piece.part is not None else ""
                raise ValueError(f"parameter {path}{named}: checkpoint shape "
                                 f"{tuple(shapes[key])}, model expects {tuple(want)}")
            sources[piece.key] = Source(key, transpose, offset)
    return sources


def open_safetensors(model_dir: str | Path) -> dict:
    """Each tensor's slice reader (`safe_open(...).get_slice`), by name."""
    readers = {}
    for path in _safetensors_files(model_dir):
        f = safe_open(path, framework="numpy")
        for key in f.keys():
            readers[key] = f.get_slice(key)
    return readers


def _read(reader, source: Source, piece: Piece, index: tuple) -> np.ndarray:
    """`index` (slices, our orientation) of `piece` from its checkpoint tensor."""
    index = list(index) + [slice(None)] * (len(piece.shape) - len(index))
    start, stop, _ = index[-1].indices(piece.shape[-1])
    index[-1] = slice(source.offset + start, source.offset + stop)
    if source.transpose:
        return np.swapaxes(np.asarray(reader[_swap_last(tuple(index))]), -1, -2)
    return np.asarray(reader[tuple(index)])


def _swap_last(items: tuple) -> tuple:
    """A shape or an index with its last two axes swapped: a transposed matrix, or each of a
    stack of experts' matrices transposed."""
    return (*items[:-2], items[-1], items[-2])


class StackedReader:
    """One tensor `[E, ...]` made of E checkpoint tensors of one shape (one per expert), read
    expert by expert: `get_shape()` and `[index]` as a safetensors slice reader."""

    def __init__(self, readers: list):
        self.readers = readers
        self.shape = (len(readers), *readers[0].get_shape())
        for reader in readers:
            if tuple(reader.get_shape()) != self.shape[1:]:
                raise ValueError(f"experts' tensors of shapes {tuple(reader.get_shape())} and "
                                 f"{self.shape[1:]} cannot be stacked")

    def get_shape(self) -> tuple[int, ...]:
        """(E, *one expert's tensor's shape)."""
        return self.shape

    def __getitem__(self, index) -> np.ndarray:
        """The experts `index[0]` selects (stacked on axis 0), each sliced by `index[1:]`."""
        index = index if isinstance(index, tuple) else (index,)
        first, rest = (index[0], index[1:]) if index else (slice(None), ())
        return np.stack([np.asarray(self.readers[e][rest] if rest else self.readers[e][:])
                         for e in range(self.shape[0])[first]])


def stack_experts(readers: dict, model_cls: type[nnx.Module], stack=StackedReader) -> dict:
    """`readers` with each layer's per-expert tensors (the family's `EXPERT_TENSORS`: (name
    with `{i}` the layer and `{j}` the expert, the stacked tensor's name with `{i}`)) replaced
    by `stack` of their list, experts 0.. in order (a `StackedReader`; `load_weights` stacks
    arrays); the other tensors as they are.

    Raises:
      ValueError: a layer's experts are not numbered 0 to E - 1.
    """
    rules = [(re.compile(re.escape(each).replace(r"\{i\}", r"(\d+)").replace(
        r"\{j\}", r"(\d+)") + "$"), stacked)
             for each, stacked in getattr(model_cls, "EXPERT_TENSORS", ())]
    if not rules:
        return readers
    out, groups = {}, {}
    for key, reader in readers.items():
        for pattern, stacked in rules:
            m = pattern.match(key)
            if m:
                groups.setdefault(stacked.format(i=m.group(1)), {})[int(m.group(2))] = reader
                break
        else:
            out[key] = reader
    for name, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{name}: experts {sorted(experts)[:8]} are not 0 to "
                             f"{len(experts) - 1}")
        out[name] = stack([experts[e] for e in range(len(experts))])
    return out


def read_pieces(readers: dict, plan: LoadPlan, sources: dict[str, Source], mesh: Mesh | None,
                dtype=None) -> dict[str, jax.Array | np.ndarray]:
    """Each piece of `plan` from the safetensors `readers` (`open_safetensors`), cast to `dtype`
    (None: the file's), laid out by its spec on `mesh`, each device's slice read from the file
    alone (`make_array_from_callback`); with no mesh, whole NumPy arrays."""
    arrays = {}
    for piece in plan.pieces:
        source = sources[piece.key]
        read = functools.partial(_read, readers[source.key], source, piece)
        cast = ((lambda x: x) if dtype is None
                else (lambda x: x.astype(jnp.dtype(dtype), copy=False)))  # no copy if equal
        if mesh is None:
            arrays[piece.key] = cast(read(()))
        else:
            arrays[piece.key] = jax.make_array_from_callback(
                piece.shape, NamedSharding(mesh, piece.spec), lambda i, read=read: cast(read(i)))
    return arrays


def assemble(plan: LoadPlan, arrays: dict[str, jax.Array], config, mesh: Mesh, dtype
             ) -> nnx.State:
    """The model's parameters from its pieces (`read_pieces`, or an orbax restore), each laid out
    by its spec on `mesh`, in one jitted `shard_map` with no communication (module doc)."""
    leaves = jax.jit(assembler(plan, config, mesh, dtype))(
        [[arrays[piece.key] for piece in pieces] for _, _, pieces in plan.params.values()])
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(plan.abstract_state),
                                        leaves)


def assembler(plan: LoadPlan, config, mesh: Mesh, dtype):
    """The traceable function under `assemble`: from each parameter's pieces (a list per
    parameter of `plan.params`, in its order, pieces in our orientation) to the parameters
    (a list in the same order), each laid out by its spec on `mesh`. A caller that computes
    the pieces on the device (`jaxpaged.integrations.tunix_params`) jits both together."""
    replicas, H = config.kv_head_replicas, config.head_dim
    paths = list(plan.params)
    in_specs = [[piece.spec for piece in plan.params[p][2]] for p in paths]

    def local(pieces_by_param):
        out = []
        for path, pieces in zip(paths, pieces_by_param):
            parts = []
            for piece, x in zip(plan.params[path][2], pieces):
                if piece.repeated:  # this device's KV head is head s // replicas
                    head = jax.lax.axis_index(MODEL_AXIS) // replicas
                    x = jax.lax.dynamic_slice_in_dim(x, head * H, H, axis=x.ndim - 1)
                parts.append(x)
            out.append((parts[0] if len(parts) == 1 else jnp.concatenate(parts, -1)
                        ).astype(dtype))
        return out

    return jax.shard_map(local, mesh=mesh, in_specs=(in_specs,),
                         out_specs=[plan.params[p][1] for p in paths])


def load_weights(model_cls: type[nnx.Module], model_dir: str | Path, config, dtype,
                 attention_backend: AttentionBackend | str = "xla",
                 mesh: Mesh | None = None, readers: dict | None = None) -> nnx.Module:
    """Builds a `model_cls` (a registered family) with weights from `model_dir`, cast to `dtype`,
    by the class's `NAME_MAP` and `part_widths(config)`, laid out on `mesh` (None: one device).

    `attention_backend` is a backend object or one of
    `pallas_kernels.backends.ATTENTION_BACKENDS`. `readers`: the tensors to read instead of
    the folder's safetensors, by HF name, each with `get_shape()` and `[index]` (a GGUF file's,
    `jaxpaged.model_loader.gguf_import.open_gguf_weights`).

    Raises:
      ValueError: see `match_checkpoint`.
    """
    if readers is None:
        readers = open_safetensors(model_dir)
    readers = stack_experts(readers, model_cls)
    shapes = {key: tuple(reader.get_shape()) for key, reader in readers.items()}
    plan = plan_load(model_cls, config, attention_backend, dtype)
    sources = match_checkpoint(model_cls, config, plan, shapes)
    mesh = mesh or single_device_mesh()
    state = assemble(plan, read_pieces(readers, plan, sources, mesh, dtype), config, mesh, dtype)
    return nnx.merge(plan.graphdef, state)


def repeat_kv_heads(x: np.ndarray, replicas: int, head_dim: int, xp=np) -> np.ndarray:
    """x: f[..., K * head_dim] with each of its K heads `replicas` times in a row, as tensor
    parallelism lays out a KV part it repeats (`LlamaConfig.for_tensor_parallel`). `xp`:
    `numpy`, or `jax.numpy` for a `jax.Array` (under jit)."""
    heads = x.reshape(*x.shape[:-1], -1, head_dim)
    return xp.repeat(heads, replicas, axis=-2).reshape(*x.shape[:-1], -1)


def params_from_hf_weights(model_cls: type[nnx.Module], config, current: dict[str, jax.Array],
                           weights, dtype) -> dict[str, np.ndarray]:
    """The parameters that `(HF name, array)` pairs change, in the engine's layout: vLLM's
    `load_weights` on top of the parameters the engine holds.

    Each HF tensor goes where the loader would put it (`model_cls.NAME_MAP`, `_match_name`):
    transposed to our orientation, a q/k/v or gate/up part written into its columns of the
    stacked parameter (shard by shard under tensor parallelism, a repeated KV head copied to
    each device's block, as `assemble` lays them out), cast to `dtype`. A subset is allowed: the
    parameters and parts not named keep their values.

    Args:
      model_cls, config: the registered family and its (tensor-parallel) config.
      current: path -> the parameter the engine holds now (global arrays, read back to the host
        only for stacked parameters of which a part changes).
      weights: (HF checkpoint name, float array) pairs, arrays in the checkpoint's orientation
        (NumPy, jax, or anything `np.asarray` reads), or a dict of them. A Mixture-of-Experts
        model takes its experts stacked (transformers 5's `state_dict()` names) or one tensor
        per expert (the hub's; every expert of a layer's projection at once).
      dtype: the engine's parameter dtype.

    Returns:
      path -> f[...] NumPy array of each changed parameter.

    Raises:
      ValueError: a name the model has no parameter for, an array that is not a float array
        NumPy can read, or one of the wrong shape (each named).
    """
    patterns = _compile(model_cls.NAME_MAP)
    widths = model_cls.part_widths(config)
    tp, replicas, H = config.tensor_parallel_size, config.kv_head_replicas, config.head_dim
    changed: dict[str, np.ndarray] = {}
    # Per-expert tensors (the hub's layout) stacked as the loader stacks them.
    try:
        weights = stack_experts(dict(weights.items() if isinstance(weights, dict) else weights),
                                model_cls, stack=lambda xs: np.stack([np.asarray(x) for x in xs]))
    except (TypeError, ValueError, RuntimeError) as e:  # e.g. a torch bfloat16 expert
        raise ValueError(f"load_weights: the experts' tensors cannot be stacked ({e}); pass "
                         "NumPy or jax float arrays, every expert of a layer's projection in "
                         "one call") from e
    for name, array in weights.items():
        try:
            match = _match_name(patterns, name, config, current)
        except KeyError:
            raise ValueError(f"load_weights: {name!r} names no parameter of this "
                             f"{model_cls.__name__} ({config.num_hidden_layers} layers)") from None
        if match is None:
            continue
        path, transpose, part = match
        try:
            x = np.asarray(array)
        except (TypeError, ValueError, RuntimeError) as e:  # e.g. a torch bfloat16 tensor
            raise ValueError(f"load_weights: {name!r} is not an array NumPy reads "
                             f"({type(array).__name__}: {e}); pass NumPy or jax arrays") from e
        if not jnp.issubdtype(x.dtype, jnp.floating):  # bfloat16 included
            raise ValueError(f"load_weights: {name!r} is {x.dtype}, not a float array")
        x = np.swapaxes(x, -1, -2) if transpose and x.ndim > 1 else x  # as `_swap_last`
        shape = tuple(current[path].shape)
        below = re.sub(r"^layers\.\d+\.", "", path)
        parts = widths.get(below)
        # The tensor's expected shape in our orientation: the whole parameter, one part of a
        # stacked one, or all its parts in one tensor (Phi-3's qkv_proj).
        want = (shape if parts is None else
                (*shape[:-1], sum(parts) if part is None else parts[part[0]]))
        if x.shape != want:
            raise ValueError(f"load_weights: {name!r} has shape {np.shape(array)}, the model "
                             f"expects {_swap_last(want) if transpose and len(want) > 1 else want}")
        if parts is None:
            changed[path] = x.astype(dtype)
            continue
        pieces = ([(part[0], x)] if part is not None else
                  list(enumerate(np.split(x, np.cumsum(parts)[:-1], axis=-1))))
        # The stacked parameter's output axis: tp blocks, each the parts' slices side by side
        # (`models.layers`); a repeated KV part holds each head `replicas` times.
        kv_parts = model_cls.KV_HEAD_PARTS.get(below, ()) if replicas > 1 else ()
        local = [(w * replicas if j in kv_parts else w) // tp for j, w in enumerate(parts)]
        if path not in changed:
            changed[path] = np.array(current[path], dtype=dtype)
        blocks = changed[path].reshape(*shape[:-1], tp, sum(local))
        for j, piece in pieces:
            if j in kv_parts:
                piece = repeat_kv_heads(piece, replicas, H)
            start = sum(local[:j])
            blocks[..., start:start + local[j]] = piece.reshape(*shape[:-1], tp, local[j])
    return changed
