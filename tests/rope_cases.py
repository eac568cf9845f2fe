"""Shared by the RoPE tests (tests/test_rope.py, tests/test_rope_config.py): rope configurations
of transformers' Llama and Phi-3 families (`CASES`), transformers' own inverse frequencies for
them, `models.rope`'s tables of the same config dict, and `torch_pow`, the fixture that swaps
`models.rope._pow` for torch's pow (the one operation not reproduced bit for bit)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import Phi3Config as HFPhi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from jaxpaged.models import rope as rope_module
from jaxpaged.models.rope import parse_hf_rope, rope_tables

LLAMA_BASE = dict(vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)  # head_dim 128


def _phi3_factors(n: int, seed: int, low: float, high: float) -> list[float]:
    return [float(x) for x in np.random.default_rng(seed).uniform(low, high, n)]


# name -> (HF config class, its rotary module, config kwargs in the transformers-4 layout)
CASES = {
    "default": (HFLlamaConfig, LlamaRotaryEmbedding,
                dict(LLAMA_BASE, max_position_embeddings=4096, rope_theta=10000.0)),
    "default-theta5e5-hd64": (HFLlamaConfig, LlamaRotaryEmbedding,
                              dict(LLAMA_BASE, hidden_size=128, max_position_embeddings=8192,
                                   rope_theta=500000.0)),
    "linear": (HFLlamaConfig, LlamaRotaryEmbedding,
               dict(LLAMA_BASE, max_position_embeddings=16384, rope_theta=10000.0,
                    rope_scaling={"type": "linear", "factor": 4.0})),
    "llama3.1": (HFLlamaConfig, LlamaRotaryEmbedding,
                 dict(LLAMA_BASE, max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})),
    "llama3.2-hd64": (HFLlamaConfig, LlamaRotaryEmbedding,
                      dict(LLAMA_BASE, hidden_size=128, max_position_embeddings=131072,
                           rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192})),
    "yarn-qwen3": (HFLlamaConfig, LlamaRotaryEmbedding,
                   dict(LLAMA_BASE, max_position_embeddings=131072, rope_theta=1000000.0,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32768})),
    "yarn-mscale": (HFLlamaConfig, LlamaRotaryEmbedding,
                    dict(LLAMA_BASE, hidden_size=128, max_position_embeddings=163840,
                         rope_theta=10000.0,
                         rope_scaling={"type": "yarn", "factor": 40.0, "beta_fast": 32,
                                       "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0,
                                       "original_max_position_embeddings": 4096})),
    "yarn-no-truncate": (HFLlamaConfig, LlamaRotaryEmbedding,
                         dict(LLAMA_BASE, hidden_size=128, max_position_embeddings=131072,
                              rope_theta=150000.0,
                              rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                            "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False,
                                            "original_max_position_embeddings": 4096})),
    "yarn-attention-factor-betas": (HFLlamaConfig, LlamaRotaryEmbedding,
                                    dict(LLAMA_BASE, max_position_embeddings=65536,
                                         rope_theta=10000.0,
                                         rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                       "attention_factor": 1.25,
                                                       "beta_fast": 16, "beta_slow": 2,
                                                       "original_max_position_embeddings": 8192})),
    "yarn-factor-none": (HFLlamaConfig, LlamaRotaryEmbedding,
                         dict(LLAMA_BASE, max_position_embeddings=16384, rope_theta=10000.0,
                              rope_scaling={"rope_type": "yarn", "factor": None,
                                            "original_max_position_embeddings": 4096})),
    "phi3-default-partial": (HFPhi3Config, Phi3RotaryEmbedding,
                             dict(LLAMA_BASE, hidden_size=3072, num_attention_heads=24,
                                  max_position_embeddings=4096, rope_theta=10000.0,
                                  partial_rotary_factor=0.75)),
    "longrope-phi3-mini": (HFPhi3Config, Phi3RotaryEmbedding,
                           dict(LLAMA_BASE, hidden_size=3072, num_attention_heads=32,
                                max_position_embeddings=131072,
                                original_max_position_embeddings=4096, rope_theta=10000.0,
                                rope_scaling={"type": "longrope",
                                              "short_factor": _phi3_factors(48, 0, 1.0, 1.2),
                                              "long_factor": _phi3_factors(48, 1, 1.0, 60.0)})),
    "longrope-phi4-mini-partial": (HFPhi3Config, Phi3RotaryEmbedding,
                                   dict(LLAMA_BASE, hidden_size=3072, num_attention_heads=24,
                                        max_position_embeddings=131072,
                                        original_max_position_embeddings=4096,
                                        rope_theta=10000.0, partial_rotary_factor=0.75,
                                        rope_scaling={"type": "longrope",
                                                      "short_factor": _phi3_factors(48, 2, 1, 3),
                                                      "long_factor": _phi3_factors(48, 3, 1, 40)})),
    "longrope-explicit-factors": (HFPhi3Config, Phi3RotaryEmbedding,
                                  dict(LLAMA_BASE, hidden_size=64, num_attention_heads=4,
                                       max_position_embeddings=1024,
                                       original_max_position_embeddings=64, rope_theta=10000.0,
                                       rope_scaling={"rope_type": "longrope", "factor": 8.0,
                                                     "attention_factor": 1.1,
                                                     "short_factor": _phi3_factors(8, 4, 1, 2),
                                                     "long_factor": _phi3_factors(8, 5, 1, 9)})),
}


@pytest.fixture
def torch_pow(monkeypatch):
    """`models.rope._pow` computed by torch as transformers computes `base ** exponents`."""
    def pow_(base, exponents):
        return (base ** torch.from_numpy(np.asarray(exponents, np.float32))).numpy()
    monkeypatch.setattr(rope_module, "_pow", pow_)


def hf_config(name):
    """The case's transformers config object."""
    cls, _, kwargs = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**copy.deepcopy(kwargs))


def hf_init(name, config, seq_len=None):
    """transformers' (inv_freq f32, attention_factor) for the case's type."""
    _, module_cls, _ = CASES[name]
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":  # not in ROPE_INIT_FUNCTIONS in transformers 5
        inv, factor = module_cls.compute_default_rope_parameters(config, device="cpu")
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu", seq_len=seq_len)
    return inv.numpy(), factor


def ours_tables(config_dict, **kwargs):
    """(HFRope, RopeTables) of `models.rope` for an HF config dict (kwargs: `parse_hf_rope`'s)."""
    rope = parse_hf_rope(config_dict, **kwargs)
    R = int(_head_dim_of_dict(config_dict) * rope.partial_rotary_factor)
    return rope, rope_tables(R, rope.theta, rope.scaling, config_dict["max_position_embeddings"])


def _head_dim_of_dict(d):
    return d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]


def raw_dict(name):
    """The case as a transformers-4 `config.json` would hold it."""
    _, _, kwargs = CASES[name]
    return copy.deepcopy(kwargs)
