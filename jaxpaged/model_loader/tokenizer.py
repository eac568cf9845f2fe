"""A model folder's tokenizer and end-of-sequence ids, loaded without importing more of
transformers (or torch) than the tokenizer needs."""

from __future__ import annotations

import json
from pathlib import Path


# Tokenizer classes that are `tokenizers`' generic fast tokenizer under another name, and the
# model types for which AutoTokenizer keeps that class when `tokenizer_config.json` names it
# (transformers 5 forces its own class on those of its `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`,
# qwen2 and phi3 among them, and may give mistral `MistralCommonBackend`): these load without
# AutoTokenizer (see `load_tokenizer`).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "gemma2", "gemma3", "gemma3_text", "qwen3")


def _read_json(path: Path) -> dict | None:
    """A JSON object file's contents; None when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_tokenizer(model_dir: Path):
    """`AutoTokenizer.from_pretrained(model_dir)`, with transformers imported here rather than
    with jaxpaged (seconds: it runs on a thread beside the model's loading).

    Where `tokenizer_config.json` names the generic fast tokenizer (`GENERIC_TOKENIZER_CLASSES`,
    as checkpoints saved by transformers 5 do) for a model type on which AutoTokenizer keeps it
    (`GENERIC_TOKENIZER_MODEL_TYPES`), with no custom code (`auto_map`) and no Mistral
    `tekken.json`, that class is loaded directly, the same tokenizer: importing AutoTokenizer
    imports `transformers.configuration_utils`, and with it torch where torch is installed
    (1.5 s of a 2-core machine's time at every start). Otherwise AutoTokenizer reads the model
    config only for its `model_type` (and `tokenizer_class`, and the name), which the generic
    `PreTrainedConfig` holds as well; `AutoConfig` would first import the family's config
    module, and with it about a second of torch.distributed."""
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json") or {}
    model_config = _read_json(model_dir / "config.json")
    tokenizer_class = tokenizer_config.get("tokenizer_class")
    if (tokenizer_class in GENERIC_TOKENIZER_CLASSES
            and (model_config or {}).get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES
            and "auto_map" not in tokenizer_config
            and (model_dir / "tokenizer.json").is_file()
            and not (model_dir / "tekken.json").exists()):
        import transformers
        return getattr(transformers, tokenizer_class).from_pretrained(model_dir)

    from transformers import AutoTokenizer, PreTrainedConfig

    if model_config is None:  # no or an odd config.json: AutoConfig's way
        return AutoTokenizer.from_pretrained(model_dir)
    try:
        config = PreTrainedConfig(**model_config)
    except (ValueError, TypeError):  # fields the generic config refuses: AutoConfig's way
        return AutoTokenizer.from_pretrained(model_dir)
    config._name_or_path = str(model_dir)  # as AutoConfig sets it
    return AutoTokenizer.from_pretrained(model_dir, config=config)


def eos_token_ids(model_dir: Path, config_eos_ids, tokenizer) -> set[int]:
    """The config's (`config_eos_ids`), the generation config's and the tokenizer's
    end-of-sequence ids.

    `generation_config.json` is read as JSON, as `GenerationConfig.from_pretrained` reads
    its `eos_token_id` (an id or a list), without importing transformers' generation
    module (and torch with it).

    Raises:
      ValueError: `generation_config.json` is not a JSON object (its path named).
    """
    ids = set(config_eos_ids)
    path = model_dir / "generation_config.json"
    if path.is_file():
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{path} is not a JSON object: {e}") from e
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
