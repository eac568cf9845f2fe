"""The embedded default model: imported into a standard HF folder equal to transformers' GGUF load."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxpaged.model_loader.model_store import DEFAULT_MODEL, EMBEDDED_MODELS, resolve_model


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

    gguf = EMBEDDED_MODELS[DEFAULT_MODEL].find_gguf()
    reference = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32).state_dict()
    ours = load_file(default_model_dir / "model.safetensors")
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: lm_head is embed_tokens
    for name, tensor in ours.items():
        np.testing.assert_array_equal(tensor, reference[name].numpy(), err_msg=name)


TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines", "Yapay zeka geliştiricilerin",
         "数字 12345 and 3.14159", "emoji 🙂🚀 and café", "<|im_start|>user\nhi<|im_end|>",
         "def f(x):\n    return x ** 2  # comment", "UPPER lower MiXeD 'quotes' \"double\""]


def test_tokenizer_encodes_like_transformers_gguf_conversion(default_model_dir):
    from transformers import AutoTokenizer

    gguf = EMBEDDED_MODELS[DEFAULT_MODEL].find_gguf()
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ours = AutoTokenizer.from_pretrained(default_model_dir)
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == reference.decode(ids) == text
    assert ours.all_special_tokens == reference.all_special_tokens
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (2, 1, 2)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_import_needs_no_torch(tmp_path):
    """torch is test-only: the import must run where it is missing (as after `make run`)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from jaxpaged.model_loader.model_store import ensure_default_model\n"
            "print(ensure_default_model())")
    env = dict(os.environ, JAXPAGED_HOME=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert res.stdout.strip().endswith(str(folder))
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [folder.name]
    assert (folder / "model.safetensors").stat().st_size > 500e6


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gemma2", "qwen3", "qwen2",
                                        "phi3"])
def test_engine_tokenizer_equals_auto_tokenizer(default_model_dir, tmp_path, model_type):
    """The engine loads the generic fast tokenizer class directly where AutoTokenizer would
    load it too (`load_tokenizer`), and goes through AutoTokenizer where transformers forces
    a class of its own (qwen2, phi3): the same tokenizer either way."""
    from transformers import AutoTokenizer

    from conftest import copy_tokenizer
    from jaxpaged.model_loader.tokenizer import load_tokenizer

    copy_tokenizer(default_model_dir, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours, reference = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(reference)
    for text in TEXTS + ["e\u0301 combining, ﬁ ligature"]:
        assert ours(text).input_ids == reference(text).input_ids, text
    assert ours.all_special_tokens == reference.all_special_tokens
    assert ours.eos_token_id == reference.eos_token_id
    assert ours.chat_template == reference.chat_template


def test_engine_tokenizer_imports_no_torch(default_model_dir):
    """The default model's tokenizer loads in a process that never imports torch (importing
    AutoTokenizer brings it in: 1.5 s at every start)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from pathlib import Path\n"
            "from jaxpaged.model_loader.tokenizer import load_tokenizer\n"
            f"load_tokenizer(Path({str(default_model_dir)!r}))\n"
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
