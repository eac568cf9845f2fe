"""Loads Hugging Face safetensors checkpoints into the NNX models, by each family's declarative
name map (`NAME_MAP` on the model class).

Each entry maps a HF parameter name (with `{i}` standing for the layer index) to the path of our
parameter, says whether the matrix is transposed (HF `nn.Linear.weight` is `[out, in]`, NNX
`Linear.kernel` is `[in, out]`), and which part of a stacked parameter it is: q, k and v go side
by side along the output axis of one `qkv_proj`, gate and up of one `gate_up_proj` (vLLM's
`stacked_params_mapping`). Loading fails if a checkpoint key is left unused, a parameter (or
part) is left unfilled, or a shape differs.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxpaged.pallas_kernels.backends import AttentionBackend


# Keys some checkpoints carry that the model does not use (precomputed RoPE buffers).
IGNORED_KEYS = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)


def _compile(name_map):
    return [(re.compile(re.escape(hf).replace(r"\{i\}", r"(\d+)") + "$"), ours, t, part)
            for hf, ours, t, part in name_map]


def read_safetensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of `model_dir/*.safetensors` as NumPy arrays, by HF name."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(model_dir)!r} has no *.safetensors weights")
    tensors = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def _param_paths(state: nnx.State) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
            for path, _ in leaves]


def load_weights(model_cls: type[nnx.Module], model_dir: str | Path, config, dtype,
                 attention_backend: AttentionBackend | str = "xla") -> nnx.Module:
    """Builds a `model_cls` (a registered family) with weights from `model_dir`, cast to `dtype`,
    by the class's `NAME_MAP` and `part_widths(config)`.

    `attention_backend` is a backend object or one of
    `pallas_kernels.backends.ATTENTION_BACKENDS`.

    Raises:
      ValueError: a checkpoint key matches no entry of the name map, a parameter (or a part of a
        stacked one) gets no tensor (or a layer is missing), or a tensor's shape differs from the
        parameter's.
    """
    abstract = nnx.eval_shape(lambda: model_cls(
        config, dtype=dtype, attention_backend=attention_backend, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    paths = _param_paths(abstract_state)
    expected = dict(zip(paths, jax.tree_util.tree_leaves(abstract_state)))

    parts_of: dict[str, list[str]] = {}  # stacked parameter -> its parts' HF names, in order
    for hf, ours, _, part in model_cls.NAME_MAP:
        if part:
            parts_of.setdefault(ours, [""] * part[1])[part[0]] = hf
    found: dict[str, dict[int, np.ndarray]] = {}  # our path -> {part: tensor}
    unused = []
    patterns = _compile(model_cls.NAME_MAP)
    for key, tensor in read_safetensors(model_dir).items():
        for pattern, ours, transpose, part in patterns:
            m = pattern.match(key)
            if m:
                break
        else:
            if not any(p.fullmatch(key) for p in IGNORED_KEYS):
                unused.append(key)
            continue
        ours = ours.format(i=int(m.group(1))) if m.groups() else ours
        if ours not in expected:  # a layer past the config's, or lm_head beside tied embeddings
            if ours == "lm_head.kernel" and config.tie_word_embeddings:
                continue
            unused.append(key)
            continue
        found.setdefault(ours, {})[part[0] if part else 0] = tensor.T if transpose else tensor
    if unused:
        raise ValueError(f"checkpoint keys not used by the model: {unused[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}")

    widths = model_cls.part_widths(config)
    leaves = []
    for path in paths:
        template = re.sub(r"^layers\.\d+\.", "layers.{i}.", path)
        hf_parts = parts_of.get(template, [None])
        got = found.get(path, {})
        want = expected[path]
        layer = re.match(r"layers\.(\d+)\.", path)
        for j, hf in enumerate(hf_parts):
            name = hf and hf.format(i=layer.group(1) if layer else None)
            if j not in got:
                raise ValueError(f"parameter {path} has no tensor in the checkpoint"
                                 + (f" for its part {name}" if name else ""))
            part_shape = (want.shape if hf is None
                          else (*want.shape[:-1], widths[template.split(".", 2)[-1]][j]))
            if tuple(got[j].shape) != tuple(part_shape):
                raise ValueError(f"parameter {path}{f' (part {name})' if name else ''}: "
                                 f"checkpoint shape {got[j].shape}, model expects {part_shape}")
        tensor = got[0] if hf_parts == [None] else np.concatenate(
            [got[j] for j in range(len(hf_parts))], axis=-1)
        leaves.append(jnp.asarray(tensor, dtype=dtype))
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract_state), leaves)
    return nnx.merge(graphdef, state)
