"""Import of a llama.cpp GGUF file into a standard Hugging Face model folder.

Supported GGUF architectures (`general.architecture`) and what they become:
`llama` (Llama, and Mistral, which GGUF files also call llama), `qwen2`, `qwen3`, `gemma2`,
`gemma3` (HF `Gemma3ForCausalLM`, model_type `gemma3_text`) and `phi3`.

The folder is what transformers' own GGUF loading gives (`from_pretrained(dir, gguf_file=...)`,
see `transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`), built from the same torch-free
tables and functions, because that loader needs torch and the engine's runtime may not have it:
- config.json: the metadata renamed by transformers' `GGUF_CONFIG_MAPPING` (plus
  `GGUF_CONFIG_DEFAULTS_MAPPING`), built with `transformers.AutoConfig.for_model`;
- tokenizer: `transformers`' `convert_gguf_tokenizer` (byte-level BPE, sentencepiece, Gemma's
  and Phi-3's variants), special tokens and chat template from the file;
- model.safetensors: every tensor dequantized to float32 with `gguf.quants.dequantize` (K-quants
  included), renamed to the HF names of the engine family's `NAME_MAP` through `gguf`'s tensor
  name map, with llama.cpp's per-architecture changes undone: llama's q/k rows permuted for its
  RoPE layout, and Gemma's norm weights stored as 1 + w. Phi-3 keeps its fused `qkv_proj` and
  `gate_up_proj`, as HF's Phi-3 has them.

Where this differs from transformers' loader, it is stricter or reads more of the file:
- a tensor with no HF name (such as llama 3's `rope_freqs` or Phi-3 longrope's `rope_factors_*`,
  or RoPE scaling in the metadata), which transformers would silently drop, raises ValueError;
- qwen3's `attention.key_length` and gemma2's logit soft-caps are read (transformers' table
  leaves them at the config class's defaults, which equal the released models');
- float32 metadata values are written as their shortest decimal (1e-05, not 9.999999747e-06).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# GGUF `general.architecture` -> (HF model_type, HF architecture)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
# transformers reads a `llama` file named exactly "mistral" as Mistral (`load_gguf_checkpoint`).
_MISTRAL = ("mistral", "MistralForCausalLM")

# Metadata keys read beyond transformers' `GGUF_CONFIG_MAPPING` (see the module docstring).
_EXTRA_CONFIG_KEYS = {
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
}
_UNIT_OFFSET_NORMS = ("gemma2", "gemma3")  # norm weights stored as 1 + w
_PERMUTED_QK = ("llama",)  # q/k rows permuted for llama.cpp's RoPE


def read_metadata(reader) -> dict:
    """All key/value metadata of a `gguf.GGUFReader` as Python values; float32 values as their
    shortest decimal."""
    from gguf import GGUFValueType

    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        meta[name] = value
    return meta


def check_architecture(meta: dict) -> str:
    """The file's GGUF architecture. Raises ValueError naming it if it is not supported."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{list(SUPPORTED_GGUF_ARCHITECTURES)}")
    return arch


def hf_config(meta: dict, tensor_names):
    """The HF config (`transformers.PretrainedConfig`) of a file with this metadata and tensors.

    Raises:
      ValueError: an unsupported architecture, or RoPE scaling stated in the metadata.
    """
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = check_architecture(meta)
    model_type, architecture = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and meta.get("general.name") == "mistral":
        model_type, architecture = _MISTRAL
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF RoPE scaling {scaling!r} ({arch}.rope.scaling.*) is not supported")
    renames = {arch: {**GGUF_CONFIG_MAPPING[arch], **_EXTRA_CONFIG_KEYS.get(arch, {})},
               "tokenizer": GGUF_CONFIG_MAPPING["tokenizer"]}
    fields = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}))
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        name = renames.get(prefix, {}).get(rest)
        if name is not None:
            fields[name] = value
    fields.setdefault("vocab_size", len(meta["tokenizer.ggml.tokens"]))
    fields["tie_word_embeddings"] = "output.weight" not in set(tensor_names)
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [architecture]
    return config


def hf_tokenizer(meta: dict):
    """The file's tokenizer as a `PreTrainedTokenizerFast`, built as transformers builds it from
    a GGUF (`get_gguf_tokenizer`, which needs torch, then `convert_gguf_tokenizer`)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # as `get_gguf_tokenizer`
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = meta.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = None if i is None else tokenizer["tokens"][i]
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _family_names(architecture: str) -> list[str]:
    """HF tensor name patterns (`{i}`: layer) of the engine family that runs `architecture`."""
    from jaxpaged.models.registry import model_class

    return [hf for hf, *_ in model_class({"architectures": [architecture]}).NAME_MAP]


class GGUFTensor:
    """One tensor of a GGUF file as the loader reads a safetensors slice (`get_shape()`,
    `reader[index]`), under its HF name: dequantized to float32 when read (`gguf.quants.
    dequantize`), llama.cpp's layout changes undone (module doc). Nothing is kept after a
    read, so a model built from these holds only its own copy of each weight."""

    def __init__(self, tensor, arch: str, config):
        self.tensor, self.arch, self.config = tensor, arch, config

    def get_shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensor.shape.tolist()))

    def __getitem__(self, index) -> np.ndarray:
        return self.read()[index]

    def read(self) -> np.ndarray:
        import gguf

        t, config = self.tensor, self.config
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(self.get_shape())
        if self.arch in _PERMUTED_QK and (".attn_q." in t.name or ".attn_k." in t.name):
            # undo llama.cpp's row permutation (`LlamaModel.permute` in convert_hf_to_gguf.py)
            n = (config.num_attention_heads if ".attn_q." in t.name
                 else config.num_key_value_heads)
            w = w.reshape(n, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if self.arch in _UNIT_OFFSET_NORMS and "norm.weight" in t.name:
            w = w - 1
        return np.ascontiguousarray(w)


def hf_tensor_readers(reader, arch: str, config) -> dict[str, GGUFTensor]:
    """Every tensor of the file as a `GGUFTensor`, keyed by its HF name.

    Raises:
      ValueError: a tensor has no HF name in the family (its data would be dropped).
    """
    import gguf

    n_layers = config.num_hidden_layers
    gguf_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(gguf_arch, n_layers)
    hf_names = {}  # GGUF name -> HF name
    for pattern in _family_names(config.architectures[0]):
        base, suffix = pattern.rsplit(".", 1)
        for i in range(n_layers) if "{i}" in pattern else [None]:
            gguf_name = name_map.get_name(base.format(i=i))
            if gguf_name is not None:
                hf_names[f"{gguf_name}.{suffix}"] = f"{base.format(i=i)}.{suffix}"
    readers = {}
    for t in reader.tensors:
        if t.name not in hf_names:
            raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face name in "
                             f"{config.architectures[0]}; importing it is not supported")
        readers[hf_names[t.name]] = GGUFTensor(t, arch, config)
    return readers


def hf_tensors(reader, arch: str, config, progress: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of the file, dequantized to float32 and keyed by its HF name.

    Raises:
      ValueError: a tensor has no HF name in the family (its data would be dropped).
    """
    from tqdm import tqdm

    readers = hf_tensor_readers(reader, arch, config)
    return {name: r.read() for name, r in tqdm(readers.items(), desc="dequantizing",
                                               unit="tensor", disable=not progress)}


# In a folder made for serving a GGUF file directly (`write_gguf_metadata`): where the file is.
GGUF_SOURCE_FILE = "gguf_source.json"


def write_gguf_metadata(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Writes config, generation config and tokenizer of the GGUF file into `out_dir`, and in
    `GGUF_SOURCE_FILE` the file's absolute path: a model folder whose weights are read from
    the GGUF itself (`open_gguf_weights`), with no float copy on disk.

    Raises:
      ValueError: see `import_gguf`.
    """
    import json

    from transformers import GenerationConfig

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    meta, config, _ = _open(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    hf_tokenizer(meta).save_pretrained(out_dir)
    (out_dir / GGUF_SOURCE_FILE).write_text(json.dumps({"path": str(gguf_path)}))


def gguf_source(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF file a `write_gguf_metadata` folder serves, or None for another folder."""
    import json

    path = Path(model_dir) / GGUF_SOURCE_FILE
    return Path(json.loads(path.read_text())["path"]) if path.is_file() else None


def open_gguf_weights(gguf_path: str | os.PathLike, config=None) -> dict[str, GGUFTensor]:
    """The file's tensors by HF name (`hf_tensor_readers`), for `models.loader.load_weights`.

    `config`: the model's HF config (anything with `architectures`, `num_hidden_layers`,
    `num_attention_heads` and `num_key_value_heads`: the `config.json` that
    `write_gguf_metadata` wrote, as a namespace); None builds it from the file's metadata,
    which imports transformers (and torch where it is installed).
    """
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    arch = check_architecture(meta)
    if config is None:
        config = hf_config(meta, [t.name for t in reader.tensors])
    return hf_tensor_readers(reader, arch, config)


def _open(gguf_path):
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    check_architecture(meta)
    return meta, hf_config(meta, [t.name for t in reader.tensors]), reader


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                progress: bool = True) -> None:
    """Writes config, generation config, tokenizer and float32 safetensors into `out_dir`
    (created if missing).

    Raises:
      ValueError: the file's architecture, tokenizer model or one of its tensors is not
        supported (the message names it; for the architecture, it lists the supported ones).
    """
    import gguf
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    arch = check_architecture(meta)
    config = hf_config(meta, [t.name for t in reader.tensors])
    tokenizer = hf_tokenizer(meta)
    tensors = hf_tensors(reader, arch, config, progress=progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # readable like the other files
