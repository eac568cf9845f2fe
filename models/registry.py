"""The model registry: Hugging Face `architectures` names to the families that run them.

A family is one file in `models/` with a model class that carries its config class
(`config_class`), its checkpoint name map (`NAME_MAP`) and the widths of its stacked parameters
(`part_widths`); adding one is that file and one line here. The engine loads every model
through `load_config` and `load_model`, and never names a family.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

from flax import nnx
from jax.sharding import Mesh

from jaxpaged.models import orbax_checkpoint
from jaxpaged.models.loader import assemble, load_weights, plan_load, single_device_mesh
from jaxpaged.pallas_kernels.backends import AttentionBackend

# HF architecture name -> (module in jaxpaged.models, class name)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "GraniteMoeForCausalLM": ("granitemoe", "GraniteMoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)


def _hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(model_dir)!r} has no config.json; expected a Hugging Face "
                         "model folder")
    return json.loads(path.read_text())


def model_class(hf_config: dict) -> type[nnx.Module]:
    """The registered class of the first of `hf_config["architectures"]` that is registered.

    Raises:
      ValueError: none is; the message lists the supported architectures.
    """
    architectures = hf_config.get("architectures") or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            module, cls = MODEL_REGISTRY[name]
            return getattr(importlib.import_module(f"jaxpaged.models.{module}"), cls)
    raise ValueError(f"architectures {architectures} are not supported; "
                     f"supported: {list(SUPPORTED_ARCHITECTURES)}")


def load_config(model_dir: str | Path):
    """The family's config of `model_dir/config.json` (meets `base.ModelConfig`).

    Raises:
      ValueError: no config.json, an unsupported architecture, or a config value the family
        does not implement (named).
    """
    hf_config = _hf_config(model_dir)
    return model_class(hf_config).config_class.from_hf_dict(hf_config)


def load_model(model_dir: str | Path, config, dtype,
               attention_backend: AttentionBackend | str = "xla", mesh: Mesh | None = None,
               readers: dict | None = None) -> nnx.Module:
    """The family's model for `model_dir`, with its weights laid out on `mesh` (None: one
    device): from its safetensors (`loader.load_weights`), or from the orbax checkpoint that
    `jaxpaged convert` wrote there (`models.orbax_checkpoint`), or from `readers` (HF name ->
    tensor reader, see `loader.load_weights`).

    Raises:
      ValueError: the weights do not match the config, or cannot be read (the tensor named).
    """
    model_cls = model_class(_hf_config(model_dir))
    if readers is not None or not orbax_checkpoint.is_orbax(model_dir):
        return load_weights(model_cls, model_dir, config, dtype, attention_backend, mesh,
                            readers)
    plan = plan_load(model_cls, config, attention_backend, dtype)
    mesh = mesh or single_device_mesh()
    arrays = orbax_checkpoint.restore_pieces(model_dir, plan, mesh, dtype)
    return nnx.merge(plan.graphdef, assemble(plan, arrays, config, mesh, dtype))


def convert_to_orbax(model_dir: str | Path, out_dir: str | Path) -> None:
    """Writes the weights of the Hugging Face folder `model_dir` as an orbax checkpoint in
    `out_dir/params` (`models.orbax_checkpoint`), and copies its other files (config,
    tokenizer, generation config) beside it, so that `out_dir` loads as a model.

    Raises:
      ValueError: see `load_config` and `loader.match_checkpoint`.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = load_config(model_dir)
    model_cls = model_class(_hf_config(model_dir))
    plan = plan_load(model_cls, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    orbax_checkpoint.save_orbax(model_cls, config, model_dir, plan, out_dir)
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.startswith("model.safetensors") \
                and path.suffix != ".safetensors":
            shutil.copy2(path, out_dir / path.name)
