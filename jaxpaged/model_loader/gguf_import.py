"""Import of a llama.cpp GGUF file into a standard Hugging Face model folder.

Supported GGUF architectures (`general.architecture`) and what they become:
`llama` (Llama, and Mistral, which GGUF files also call llama; a llama file with
`llama.expert_count` experts is Mixtral, HF `MixtralForCausalLM`), `qwen2`, `qwen3`, `qwen2moe`
(HF `Qwen2MoeForCausalLM`), `qwen3moe` (HF `Qwen3MoeForCausalLM`), `gemma2`, `gemma3` (HF
`Gemma3ForCausalLM`, model_type `gemma3_text`) and `phi3`.

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
  `gate_up_proj`, as HF's Phi-3 has them. An MoE file's experts, stacked by expert
  (`blk.N.ffn_{gate,up}_exps`: f[E, F, D], `ffn_down_exps`: f[E, D, F]), are written one tensor
  per expert under HF checkpoints' names (`...experts.{j}.w1.weight`, `mlp.experts.{j}.
  gate_proj.weight`: what `save_pretrained` writes, and transformers 5 fuses on load); served
  directly (`open_gguf_weights`) they stay stacked, under the names `loader.stack_experts`
  gives a checkpoint's.

Where this differs from transformers' loader, it is stricter or reads more of the file:
- a tensor with no HF name (such as llama 3's `rope_freqs` or Phi-3 longrope's `rope_factors_*`,
  or RoPE scaling in the metadata), which transformers would silently drop, raises ValueError;
- qwen3's `attention.key_length` and gemma2's logit soft-caps are read (transformers' table
  leaves them at the config class's defaults, which equal the released models'), and so are
  the Qwen MoE files' `expert_feed_forward_length` (`moe_intermediate_size`) and qwen2moe's
  `expert_shared_feed_forward_length` (`shared_expert_intermediate_size`);
- a llama file with experts becomes Mixtral (`expert_count` -> `num_local_experts`,
  `expert_used_count` -> `num_experts_per_tok`), which transformers' loader reads as a Llama
  without them; an MoE file's expert counts and its experts' tensors' shapes are checked
  (ValueError naming the key or tensor);
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
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
# transformers reads a `llama` file named exactly "mistral" as Mistral (`load_gguf_checkpoint`).
_MISTRAL = ("mistral", "MistralForCausalLM")
# llama.cpp writes Mixtral as a `llama` file with `llama.expert_count` experts.
_MIXTRAL = ("mixtral", "MixtralForCausalLM")
# transformers' config tables name these architectures by their HF model_type.
_TRANSFORMERS_TABLE = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}

# Metadata keys read beyond transformers' `GGUF_CONFIG_MAPPING` (see the module docstring).
_EXTRA_CONFIG_KEYS = {
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}
# A `llama` file with experts (Mixtral): keys transformers' llama table does not have.
_MIXTRAL_CONFIG_KEYS = {"expert_count": "num_local_experts",
                        "expert_used_count": "num_experts_per_tok"}
# Metadata an MoE file must state (the expert FFN size: the Qwen files').
_REQUIRED_MOE_KEYS = {"llama": ("expert_count", "expert_used_count"),
                      "qwen2moe": ("expert_count", "expert_used_count",
                                   "expert_feed_forward_length"),
                      "qwen3moe": ("expert_count", "expert_used_count",
                                   "expert_feed_forward_length")}
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


def is_moe(meta: dict) -> bool:
    """Whether the file's layers are Mixture-of-Experts (`{arch}.expert_count` above 0)."""
    return bool(meta.get(f"{meta.get('general.architecture')}.expert_count"))


def _check_moe_metadata(meta: dict, arch: str) -> None:
    """Raises ValueError naming a missing or bad expert count of an MoE file (of an
    architecture with experts the importer reads: `_REQUIRED_MOE_KEYS`)."""
    if arch not in _REQUIRED_MOE_KEYS:
        return
    for key in _REQUIRED_MOE_KEYS[arch]:
        if not isinstance(meta.get(f"{arch}.{key}"), int) or meta[f"{arch}.{key}"] < 1:
            raise ValueError(f"GGUF {arch} MoE file: {arch}.{key} is "
                             f"{meta.get(f'{arch}.{key}')!r}, not a positive integer")
    used, count = meta[f"{arch}.expert_used_count"], meta[f"{arch}.expert_count"]
    if used > count:
        raise ValueError(f"GGUF {arch}.expert_used_count={used} exceeds "
                         f"{arch}.expert_count={count}")


def hf_config(meta: dict, tensor_names):
    """The HF config (`transformers.PretrainedConfig`) of a file with this metadata and tensors.

    Raises:
      ValueError: an unsupported architecture, RoPE scaling stated in the metadata, or an MoE
        file's expert metadata missing or out of range.
    """
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = check_architecture(meta)
    model_type, architecture = GGUF_ARCHITECTURES[arch]
    extra = dict(_EXTRA_CONFIG_KEYS.get(arch, {}))
    if arch == "llama" and is_moe(meta):
        (model_type, architecture), extra = _MIXTRAL, _MIXTRAL_CONFIG_KEYS
    elif arch == "llama" and meta.get("general.name") == "mistral":
        model_type, architecture = _MISTRAL
    stacked = any(n.endswith("_exps.weight") for n in tensor_names)  # experts' tensors
    if arch in _TRANSFORMERS_TABLE or model_type == "mixtral" or stacked:
        _check_moe_metadata(meta, arch)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF RoPE scaling {scaling!r} ({arch}.rope.scaling.*) is not supported")
    table = _TRANSFORMERS_TABLE.get(arch, arch)
    renames = {arch: {**GGUF_CONFIG_MAPPING[table], **extra},
               "tokenizer": GGUF_CONFIG_MAPPING["tokenizer"]}
    fields = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(table, {}))
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


def _family(architecture: str):
    """The engine family class (NAME_MAP, EXPERT_TENSORS) that runs the HF `architecture`."""
    from jaxpaged.models.registry import model_class

    return model_class({"architectures": [architecture]})


def _gguf_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in NumPy (HF) order: its `ne` reversed."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


class GGUFTensor:
    """One tensor of a GGUF file as the loader reads a safetensors slice (`get_shape()`,
    `reader[index]`), under its HF name: dequantized to float32 when read (`gguf.quants.
    dequantize`), llama.cpp's layout changes undone (module doc). Nothing is kept after a
    read, so a model built from these holds only its own copy of each weight. `shape`: the
    HF shape where it only adds unit axes to the file's (Qwen2-MoE's shared expert gate)."""

    def __init__(self, tensor, arch: str, config, shape: tuple[int, ...] | None = None):
        self.tensor, self.arch, self.config = tensor, arch, config
        self.shape = shape or _gguf_shape(tensor)

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

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


def _hf_names(name_map, family, n_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF name, for the tensors of the engine `family`'s NAME_MAP. Its
    stacked experts' names (no `.weight`: `loader.stack_experts`'s) are the GGUF's merged
    `ffn_*_exps.weight`. Where two HF names map to one GGUF name (a checkpoint's and
    transformers 5's module name), the first in the name map (the checkpoint's) is kept."""
    hf_names = {}
    for pattern, *_ in family.NAME_MAP:
        stacked = not pattern.endswith((".weight", ".bias"))
        base, suffix = (pattern, "weight") if stacked else pattern.rsplit(".", 1)
        for i in range(n_layers) if "{i}" in pattern else [None]:
            gguf_name = name_map.get_name(base.format(i=i))
            if gguf_name is not None:
                hf = base.format(i=i)
                hf_names.setdefault(f"{gguf_name}.{suffix}", hf if stacked else f"{hf}.{suffix}")
    return hf_names


def check_expert_shapes(shapes: dict[str, tuple[int, ...]], config) -> None:
    """Checks an MoE file's router and stacked experts' tensors against `config` (no check
    for a config without experts). `shapes`: GGUF tensor name -> shape in NumPy order; each
    layer needs `ffn_gate_inp` f[E, D], `ffn_gate_exps` and `ffn_up_exps` f[E, F, D] and
    `ffn_down_exps` f[E, D, F] (E experts of F units, hidden size D).

    Raises:
      ValueError: a layer lacks one of them, or its shape is not the one above.
    """
    E = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not E:
        return
    F = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    D = config.hidden_size
    want = {"gate_inp": (E, D), "gate_exps": (E, F, D), "up_exps": (E, F, D),
            "down_exps": (E, D, F)}
    for i in range(config.num_hidden_layers):
        for part, shape in want.items():
            name = f"blk.{i}.ffn_{part}.weight"
            if name not in shapes:
                raise ValueError(f"GGUF MoE file: layer {i} has no tensor {name!r}")
            if tuple(shapes[name]) != shape:
                raise ValueError(f"GGUF tensor {name!r} has shape {tuple(shapes[name])}, not "
                                 f"{shape} ({E} experts of {F} units, hidden size {D})")


def hf_tensor_readers(reader, arch: str, config) -> dict[str, GGUFTensor]:
    """Every tensor of the file as a `GGUFTensor`, keyed by its HF name; an MoE file's
    stacked experts under the family's stacked names (`..experts.w1`: f[E, F, D], as
    `loader.stack_experts` makes them).

    Raises:
      ValueError: a tensor has no HF name in the family (its data would be dropped), or an
        MoE file's experts' tensors do not fit its config (`check_expert_shapes`).
    """
    import gguf

    gguf_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    hf_names = _hf_names(name_map, _family(config.architectures[0]), config.num_hidden_layers)
    check_expert_shapes({t.name: _gguf_shape(t) for t in reader.tensors}, config)
    readers = {}
    for t in reader.tensors:
        if t.name not in hf_names:
            raise ValueError(f"GGUF tensor {t.name!r} has no Hugging Face name in "
                             f"{config.architectures[0]}; importing it is not supported")
        shape = None
        if t.name.endswith(".ffn_gate_inp_shexp.weight") and len(t.shape) == 1:
            shape = (1, int(t.shape[0]))  # HF's Linear(D, 1); llama.cpp may store f[D]
        readers[hf_names[t.name]] = GGUFTensor(t, arch, config, shape)
    return readers


def _per_expert_names(family, n_layers: int) -> dict[str, str]:
    """Stacked experts' HF name -> its per-expert tensors' name, `{j}` the expert (the
    family's `EXPERT_TENSORS`)."""
    return {stacked.format(i=i): each.replace("{i}", str(i))
            for each, stacked in getattr(family, "EXPERT_TENSORS", ())
            for i in range(n_layers)}


def hf_tensors(reader, arch: str, config, progress: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of the file, dequantized to float32 and keyed by its HF name; an MoE
    file's stacked experts f[E, ...] split into E tensors, one per expert, under the names
    HF checkpoints use (`...experts.{j}.w1.weight`, what `save_pretrained` writes).

    Raises:
      ValueError: see `hf_tensor_readers`.
    """
    from tqdm import tqdm

    readers = hf_tensor_readers(reader, arch, config)
    split = _per_expert_names(_family(config.architectures[0]), config.num_hidden_layers)
    out = {}
    for name, r in tqdm(readers.items(), desc="dequantizing", unit="tensor",
                        disable=not progress):
        w = r.read()
        if name in split:
            out.update({split[name].replace("{j}", str(j)): np.ascontiguousarray(w[j])
                        for j in range(w.shape[0])})
        else:
            out[name] = w
    return out


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
    """(metadata, HF config, `gguf.GGUFReader`) of a file whose config and experts' tensors'
    shapes are checked (ValueError)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    check_architecture(meta)
    config = hf_config(meta, [t.name for t in reader.tensors])
    check_expert_shapes({t.name: _gguf_shape(t) for t in reader.tensors}, config)
    return meta, config, reader


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                progress: bool = True) -> None:
    """Writes config, generation config, tokenizer and float32 safetensors into `out_dir`
    (created if missing).

    Raises:
      ValueError: the file's architecture, tokenizer model or one of its tensors is not
        supported (the message names it; for the architecture, it lists the supported ones),
        or an MoE file's expert metadata or tensors are missing or inconsistent.
    """
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    meta, config, reader = _open(gguf_path)
    tokenizer = hf_tokenizer(meta)
    tensors = hf_tensors(reader, meta["general.architecture"], config, progress=progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # readable like the other files
