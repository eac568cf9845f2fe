"""Shared fixtures: the default model's folder, a tiny random Llama saved with HF, and a leak check.

Every `LLM` built through the `make_llm` fixture is checked after each test: all its KV blocks
must be free again (no leaks), whatever the test did.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil
from pathlib import Path

import pytest
from output_utils import assert_idle

TINY_CONFIG = dict(  # GQA (4 query heads on 2 KV heads), untied embeddings
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
    bos_token_id=1, eos_token_id=2)


# The SmolLM2 engines of test_structured_outputs, test_tool_calling and test_responses: the same
# limits, so that an xdist worker running two of those modules compiles their programs once.
DEFAULT_MODEL_LIMITS = dict(max_model_len=1024, num_kv_blocks=512)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copies the tokenizer files (`TOKENIZER_FILES`) that HF folder `src` has into `dst`."""
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from jaxpaged.model_loader.model_store import ensure_default_model
    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A random 2-layer Llama saved with `save_pretrained`, with the default model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
    model.save_pretrained(path)
    copy_tokenizer(default_model_dir, path)
    return path


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory, tiny_model_dir) -> Path:
    """A random 2-layer Mixtral (8 experts, top-2) saved with `save_pretrained`."""
    import torch
    import transformers

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-mixtral")
    transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **TINY_CONFIG, num_local_experts=8, num_experts_per_tok=2)).save_pretrained(path)
    copy_tokenizer(tiny_model_dir, path)
    return path


@pytest.fixture(scope="session")
def head64_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Llama with 64-feature heads: the C++ kernel's compiled head size, as SmolLM2's
    (the tiny model's 16 take its generic path)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-h64")
    config = LlamaConfig(**{**TINY_CONFIG, "hidden_size": 128, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "head_dim": 64})
    LlamaForCausalLM(config).save_pretrained(path)
    copy_tokenizer(tiny_model_dir, path)
    return path


@pytest.fixture(scope="session")
def f160_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Llama (16-feature heads) with an intermediate size of 160: shapes at which
    XLA:CPU's compiled step is not row-invariant below 64 rows though each of its weights'
    products alone is (tests/test_batch_invariance.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-f160")
    LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "intermediate_size": 160})).save_pretrained(
        path)
    copy_tokenizer(tiny_model_dir, path)
    return path


_built = []


@pytest.fixture
def make_llm():
    """`make_llm(model_dir, **kwargs) -> LLM`, leak-checked after the test."""
    from jaxpaged import LLM

    def make(model_dir, **kwargs):
        kwargs.setdefault("max_model_len", 256)
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("precompile", False)  # tests that count compilations ask for it
        llm = LLM(model_dir, **kwargs)
        _built.append(llm)
        return llm

    make.built = _built  # the engines built so far in this test, in order
    yield make
    for llm in _built:
        assert_idle(llm)
    _built.clear()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where jax's default backend is a GPU (set JAX_PLATFORMS=cuda:
    this file defaults it to cpu)."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import jax

    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs a GPU: JAX_PLATFORMS=cuda pytest -m gpu")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    """One engine on the tiny model shared by a module's tests (leak-checked by `no_leaks`)."""
    from jaxpaged import LLM
    return LLM(tiny_model_dir, max_model_len=256, num_kv_blocks=256, max_num_seqs=8,
               precompile=False)


@pytest.fixture(autouse=True)
def no_leaks(request):
    """After each test, in every shared engine it used (`tiny_llm`, and the module-scoped engine
    fixtures its module names in `SHARED_ENGINES`): every block free, nothing queued."""
    yield
    for name in ("tiny_llm", *getattr(request.module, "SHARED_ENGINES", ())):
        if name in request.fixturenames:
            assert_idle(request.getfixturevalue(name))
