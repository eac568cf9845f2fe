"""Orbax checkpoints of the models' weights: written once from a Hugging Face folder
(`save_orbax`), restored straight into a mesh's shardings (`restore_pieces`).

The checkpoint holds the model's *pieces* (`models.loader`): each parameter, and each part of a
stacked parameter (q, k and v of `qkv_proj`, ...) apart, in our orientation (`[in, out]`) and
the source's dtype, under its parameter path (`{"layers": {"0": {"self_attn": {"qkv_proj":
{"kernel": {"0": q, "1": k, "2": v}}}}}}`). That layout does not depend on how the model is
split: restoring for tensor parallelism gives orbax each piece's sharding, each device reads
its own slice from the files, and `loader.assemble` puts each device's parameters together.

Layout on disk: `OUT/params/` (orbax's `StandardCheckpointer`), with `config.json`, the tokenizer
and `generation_config.json` beside it in `OUT/`.
"""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import Mesh, NamedSharding

from jaxpaged.models.loader import (LoadPlan, Piece, match_checkpoint, open_safetensors,
                                    read_pieces, stack_experts)

PARAMS_DIR = "params"  # the orbax checkpoint inside a converted model folder


def is_orbax(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds an orbax checkpoint (`OUT/params/`) rather than safetensors."""
    return (Path(model_dir) / PARAMS_DIR / "_METADATA").is_file()


def _tree_path(piece: Piece) -> list[str]:
    """The piece's path in the checkpoint's tree: its key's parts (a stacked parameter's part,
    `name#part`, is one level below the parameter)."""
    return piece.key.replace("#", ".").split(".")


def _lookup(tree, piece: Piece):
    """The piece's node in a nested dict, or None if it has none."""
    for name in _tree_path(piece):
        tree = tree.get(name) if isinstance(tree, dict) else None
    return tree


def _nest(pieces: list[Piece], leaf) -> dict:
    tree: dict = {}
    for piece in pieces:
        *parents, last = _tree_path(piece)
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = leaf(piece)
    return tree


def _ocp():
    import orbax.checkpoint as ocp  # imported on use: it takes a second
    return ocp


def save_orbax(model_cls, config, hf_dir: str | Path, plan: LoadPlan, out_dir: str | Path
               ) -> None:
    """Writes the pieces of `plan` (for a one-device config) from the safetensors of `hf_dir`,
    in their dtype, to `out_dir/params`.

    Raises:
      ValueError: the safetensors do not match the model (`loader.match_checkpoint`).
    """
    readers = stack_experts(open_safetensors(hf_dir), model_cls)
    shapes = {key: tuple(reader.get_shape()) for key, reader in readers.items()}
    sources = match_checkpoint(model_cls, config, plan, shapes)
    arrays = read_pieces(readers, plan, sources, mesh=None)
    checkpointer = _ocp().StandardCheckpointer()
    checkpointer.save(Path(out_dir).absolute() / PARAMS_DIR,
                      _nest(plan.pieces, lambda piece: arrays[piece.key]))
    checkpointer.wait_until_finished()


def restore_pieces(model_dir: str | Path, plan: LoadPlan, mesh: Mesh, dtype
                   ) -> dict[str, jax.Array]:
    """Each piece of `plan` from the orbax checkpoint of `model_dir`, cast to `dtype` and laid
    out by its spec on `mesh`, each device reading its own slice.

    Raises:
      ValueError: a piece is missing or has another shape than the config implies, or cannot be
        read (a truncated or damaged checkpoint); the message names it.
    """
    path = Path(model_dir).absolute() / PARAMS_DIR
    checkpointer = _ocp().StandardCheckpointer()
    stored = checkpointer.metadata(path).item_metadata.tree
    for piece in plan.pieces:
        node = _lookup(stored, piece)
        if node is None:
            raise ValueError(f"orbax checkpoint {str(path)!r} has no tensor {piece.key}")
        if tuple(node.shape) != piece.shape:
            raise ValueError(f"orbax checkpoint {str(path)!r}: tensor {piece.key} has shape "
                             f"{tuple(node.shape)}, the config implies {piece.shape}")

    def target(pieces):
        return _nest(pieces, lambda piece: jax.ShapeDtypeStruct(
            piece.shape, dtype, sharding=NamedSharding(mesh, piece.spec)))

    try:
        restored = checkpointer.restore(path, target(plan.pieces))
    except Exception as error:  # find the tensor that cannot be read, one by one
        for piece in plan.pieces:
            try:
                _restore_subset(path, target([piece]))
            except Exception as piece_error:
                raise ValueError(f"orbax checkpoint {str(path)!r}: tensor {piece.key} cannot "
                                 f"be read ({type(piece_error).__name__}: "
                                 f"{str(piece_error)[:300]})") from error
        raise ValueError(f"orbax checkpoint {str(path)!r} cannot be read: {error}") from error
    return {piece.key: _lookup(restored, piece) for piece in plan.pieces}


def _restore_subset(path: Path, target: dict) -> dict:
    """Restores only the tensors of `target` (a subtree of the checkpoint's)."""
    ocp = _ocp()
    return ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
