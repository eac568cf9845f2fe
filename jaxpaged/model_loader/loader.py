"""Loading a model folder's weights, whatever serves them: the one path the target model and a
speculative draft model both take."""

from __future__ import annotations

import json
import types
from pathlib import Path

from flax import nnx

from jaxpaged.model_loader import gguf_import
from jaxpaged.models import load_model


def load_model_from_dir(model_dir: Path, model_config, dtype, attention_backend,
                        mesh=None) -> nnx.Module:
    """The model of `model_dir` with its weights: from the GGUF file itself for a folder that
    serves one (`gguf_import.write_gguf_metadata`), else from its safetensors or orbax
    checkpoint (`models.load_model`).

    Args:
      model_dir: a model folder (`model_store.resolve_model`).
      model_config: its `ModelConfig` (`models.load_config`, split for tensor parallelism).
      dtype: the weights' jnp dtype.
      attention_backend: the attention backend object the model's layers call.
      mesh: the device mesh the weights are laid out on (None: one device).

    Raises:
      ValueError: the weights do not match the config, or a tensor cannot be read (named).
    """
    model_dir = Path(model_dir)
    source = gguf_import.gguf_source(model_dir)
    readers = None
    if source is not None:
        hf_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        readers = gguf_import.open_gguf_weights(source, types.SimpleNamespace(**hf_config))
    return load_model(model_dir, model_config, dtype, attention_backend, mesh, readers)
