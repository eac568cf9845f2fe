"""The embedded default model: imported into a standard HF folder equal to transformers' GGUF load."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxpaged.model_store import DEFAULT_MODEL, _find_gguf, resolve_model


def test_default_model_folder_is_a_standard_hf_folder(default_model_dir):
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (default_model_dir / name).is_file(), name
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (576, 30, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5
    assert resolve_model(None) == resolve_model(DEFAULT_MODEL) == default_model_dir


@pytest.mark.slow
def test_imported_weights_equal_transformers_gguf_loader(default_model_dir):
    """An independent check of the dequantization and q/k un-permutation."""
    import torch
    from transformers import LlamaForCausalLM

    gguf = _find_gguf()
    reference = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32).state_dict()
    ours = load_file(default_model_dir / "model.safetensors")
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: lm_head is embed_tokens
    for name, tensor in ours.items():
        np.testing.assert_array_equal(tensor, reference[name].numpy(), err_msg=name)
