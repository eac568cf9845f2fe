"""The checkpoint loader: HF tensors land in the stacked qkv/gate_up parameters in order, and a
missing or misshapen part is an error that names it."""

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxpaged.models import load_config, load_model
from jaxpaged.models.loader import read_safetensors


def test_stacked_parameters_hold_the_hf_tensors_side_by_side(tiny_model_dir):
    model = load_model(tiny_model_dir, load_config(tiny_model_dir), jnp.float32)
    hf = read_safetensors(tiny_model_dir)
    layer = model.layers[1]
    np.testing.assert_array_equal(
        np.asarray(layer.self_attn.qkv_proj.kernel[...]),
        np.concatenate([hf[f"model.layers.1.self_attn.{p}_proj.weight"].T for p in "qkv"], -1))
    np.testing.assert_array_equal(
        np.asarray(layer.mlp.gate_up_proj.kernel[...]),
        np.concatenate([hf[f"model.layers.1.mlp.{p}_proj.weight"].T for p in ("gate", "up")], -1))


def _edited_copy(tiny_model_dir, tmp_path, edit):
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    tensors = read_safetensors(tiny_model_dir)
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
     r"layers.1.self_attn.qkv_proj.kernel has no tensor .* model.layers.1.self_attn.k_proj"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight":
                         t["model.layers.0.mlp.up_proj.weight"][:-1]}),
     r"layers.0.mlp.gate_up_proj.kernel \(part model.layers.0.mlp.up_proj.weight\)"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                         t["model.layers.0.self_attn.q_proj.weight"][:-4],
                         "model.layers.0.self_attn.v_proj.weight":
                         np.concatenate([t["model.layers.0.self_attn.v_proj.weight"]] * 2)}),
     r"part model.layers.0.self_attn.q_proj.weight"),
])
def test_a_missing_or_misshapen_part_is_named(tiny_model_dir, tmp_path, edit, message):
    model_dir = _edited_copy(tiny_model_dir, tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_model(model_dir, load_config(model_dir), jnp.float32)
