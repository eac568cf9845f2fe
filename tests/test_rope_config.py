"""`models.rope`'s reading of HF configs against transformers: both config layouts
(transformers 4's `rope_scaling` and 5's `rope_parameters`, nested by layer type too), the
precedence of their fields, type aliases, errors naming the bad field, and `LlamaConfig`'s
rope tables and the types each family applies. The numbers themselves are tests/test_rope.py's."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
from rope_cases import (LLAMA_BASE, HFLlamaConfig, HFPhi3Config, hf_config, hf_init, ours_tables,
                        raw_dict)
from rope_cases import torch_pow  # noqa: F401 (a fixture)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxpaged.models import config as config_module
from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.rope import (SUPPORTED_ROPE_TYPES, HFRope, RopeScaling, parse_hf_rope,
                                  rope_tables)


# -- parsing -------------------------------------------------------------------------------------

def test_both_config_layouts_parse_the_same():
    v4 = {"max_position_embeddings": 131072, "rope_theta": 500000.0,
          "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    v5 = {"max_position_embeddings": 131072,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_saved = HFLlamaConfig(**LLAMA_BASE, **copy.deepcopy(v4)).to_dict()
    assert "rope_parameters" in hf_saved
    parsed = [parse_hf_rope(d) for d in (v4, v5, hf_saved)]
    assert parsed[0] == parsed[1] == parsed[2]
    assert parsed[0] == HFRope(500000.0, 1.0, RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))
    assert RopeScaling.from_hf(v4) == parsed[0].scaling
    # `rope_type` over `type`, and theta / partial factor inside the dict over the top level
    d = {"max_position_embeddings": 64, "rope_theta": 1.0, "partial_rotary_factor": 0.25,
         "rope_parameters": {"type": "default", "rope_type": "linear", "factor": 2.0,
                             "rope_theta": 20000.0, "partial_rotary_factor": 0.5}}
    assert parse_hf_rope(d) == HFRope(20000.0, 0.5, RopeScaling("linear", factor=2.0))
    top = {"max_position_embeddings": 64, "partial_rotary_factor": 0.75}
    assert parse_hf_rope(top) == HFRope(10000.0, 0.75, RopeScaling())
    assert parse_hf_rope(top, default_theta=1e6).theta == 1e6
    # transformers: a non-empty `rope_scaling` replaces `rope_parameters`
    both = {"rope_scaling": {"type": "linear", "factor": 2.0},
            "rope_parameters": {"rope_type": "linear", "factor": 3.0}}
    assert parse_hf_rope(both).scaling.factor == 2.0


def test_original_max_position_embeddings_precedence_follows_transformers():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    d = {**LLAMA_BASE, "max_position_embeddings": 131072, "rope_theta": 500000.0,
         "original_max_position_embeddings": 4096, "rope_scaling": rope}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = HFLlamaConfig.from_dict(copy.deepcopy(d))
        hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config, device="cpu")
    assert config.rope_parameters["original_max_position_embeddings"] == 4096  # top level won
    rope_, tables = ours_tables(d)
    assert rope_.scaling.original_max_position_embeddings == 4096
    np.testing.assert_array_equal(tables.inv_freq, hf_inv.numpy())
    # absent everywhere: max_position_embeddings
    no_omp = {"max_position_embeddings": 32768,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert parse_hf_rope(no_omp).scaling.original_max_position_embeddings == 32768


def test_phi3_type_aliases():
    d = raw_dict("longrope-phi3-mini")
    d["rope_scaling"]["type"] = "su"
    assert parse_hf_rope(d, type_aliases={"su": "longrope"}).scaling.rope_type == "longrope"
    with pytest.raises(ValueError, match="'su'"):
        parse_hf_rope(d)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"type": "ntk-by-parts"}])
def test_an_unknown_rope_type_is_named(rope):
    name = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ValueError, match=f"'{name}'.*not supported") as info:
        parse_hf_rope({"rope_scaling": rope, "max_position_embeddings": 64})
    for t in SUPPORTED_ROPE_TYPES:
        assert t in str(info.value)
    with pytest.raises(ValueError, match=f"'{name}'"):
        RopeScaling(rope_type=name)


@pytest.mark.parametrize("rope, field", [
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
    ({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "factor"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, "factor"),
    ({"rope_type": "longrope", "short_factor": [1.0, 1.0]}, "long_factor"),
    ({"rope_type": "longrope", "long_factor": [1.0, 1.0]}, "short_factor"),
])
def test_a_missing_field_is_named(rope, field):
    with pytest.raises(ValueError, match=f"'{field}'.*missing") as info:
        parse_hf_rope({"rope_scaling": rope, "max_position_embeddings": 64})
    assert repr(rope["rope_type"]) in str(info.value)


@pytest.mark.parametrize("rope, field", [
    ({"rope_type": "linear", "factor": "4"}, "factor"),
    ({"rope_type": "linear", "factor": -2.0}, "factor"),
    ({"rope_type": "linear", "factor": None}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "high_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}, "attention_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": "fast"}, "beta_fast"),
    ({"rope_type": "longrope", "short_factor": [1.0, "x"], "long_factor": [1.0, 2.0]},
     "short_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 2.0]},
     "long_factor"),
])
def test_an_invalid_field_is_named(rope, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        parse_hf_rope({"rope_scaling": rope, "max_position_embeddings": 64})


def test_invalid_theta_partial_factor_rotary_dim_and_nested_parameters():
    with pytest.raises(ValueError, match="rope_theta"):
        parse_hf_rope({"rope_theta": 0})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        parse_hf_rope({"partial_rotary_factor": 1.5})
    with pytest.raises(ValueError, match="nested by layer type.*layer_type"):
        parse_hf_rope({"rope_parameters": {"full_attention": {"rope_type": "default"},
                                           "sliding_attention": {"rope_type": "default"}}})
    with pytest.raises(ValueError, match="'chunked_attention'"):
        parse_hf_rope({"rope_parameters": {"full_attention": {"rope_type": "default"}}},
                      layer_type="chunked_attention")
    with pytest.raises(ValueError, match="rotary dim"):
        rope_tables(7, 10000.0, RopeScaling(), 64)
    longrope = RopeScaling("longrope", short_factor=(1.0,) * 4, long_factor=(2.0,) * 4,
                           original_max_position_embeddings=32)
    with pytest.raises(ValueError, match="'short_factor' has 4 values.*needs 8"):
        rope_tables(16, 10000.0, longrope, 64)
    assert rope_tables(8, 10000.0, longrope, 64).is_longrope


# -- LlamaConfig ---------------------------------------------------------------------------------

def _llama_dict(**rope):
    return {"architectures": ["LlamaForCausalLM"], **LLAMA_BASE,
            "max_position_embeddings": 131072, **rope}


def test_llama_config_delegates_and_reexports():
    assert config_module.RopeScaling is RopeScaling
    assert config_module.SUPPORTED_ROPE_TYPES == SUPPORTED_ROPE_TYPES
    for name in ("default", "linear", "llama3.1"):
        raw = raw_dict(name)
        ours = LlamaConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **raw})
        hf_inv, _ = hf_init(name, hf_config(name))
        inv = ours.rope_inv_freq()
        assert inv.dtype == np.float32 and inv.shape == (ours.head_dim // 2,)
        np.testing.assert_array_equal(inv, hf_inv)
        np.testing.assert_array_equal(ours.rope_tables().inv_freq, hf_inv)
        assert ours.partial_rotary_factor == 1.0 and ours.rotary_dim == ours.head_dim


def test_config_refuses_types_its_family_does_not_apply():
    yarn = _llama_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768})
    with pytest.raises(ValueError, match="'dynamic'"):
        LlamaConfig.from_hf_dict(_llama_dict(rope_scaling={"rope_type": "dynamic",
                                                           "factor": 2.0}))

    class Restricted(LlamaConfig):  # a family whose forward applies fewer types
        ROPE_TYPES = ("default", "linear", "llama3")

    with pytest.raises(ValueError, match="'yarn' is not supported by Restricted"):
        Restricted.from_hf_dict(yarn)
    config = LlamaConfig.from_hf_dict(yarn)  # Llama's forward applies every type
    assert config.rope_tables().attention_factor > 1.0
    with pytest.raises(ValueError, match="rope_tables"):
        config.rope_inv_freq()
    partial = LlamaConfig.from_hf_dict(_llama_dict(partial_rotary_factor=0.5))
    assert partial.rotary_dim == 64 and partial.rope_inv_freq().shape == (32,)


def test_llama_config_subclass_reads_rope_as_its_hf_class_does(torch_pow):
    """A Phi-3-like family: "su" read as longrope, original_max_position_embeddings 4096 by
    default; its tables equal transformers' Phi3Config's."""

    class Phi3Like(LlamaConfig):
        ARCHITECTURES = ("Phi3ForCausalLM",)
        ROPE_TYPES = SUPPORTED_ROPE_TYPES
        ROPE_TYPE_ALIASES = {"su": "longrope", "yarn": "longrope"}
        HF_ROPE_DEFAULTS = {"original_max_position_embeddings": 4096}

    raw = raw_dict("longrope-phi3-mini")
    del raw["original_max_position_embeddings"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = HFPhi3Config(**copy.deepcopy(raw))
    # (transformers 5.24 itself refuses "su" without the key inside rope_scaling: KeyError)
    raw["rope_scaling"]["type"] = "su"
    config = Phi3Like.from_hf_dict({"architectures": ["Phi3ForCausalLM"], **raw})
    tables = config.rope_tables()
    hf_short, hf_factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    hf_long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=4097)
    assert tables.original_max_position_embeddings == 4096
    np.testing.assert_array_equal(tables.inv_freq, hf_short.numpy())
    np.testing.assert_array_equal(tables.long_inv_freq, hf_long.numpy())
    assert tables.attention_factor == hf_factor


def test_rope_parameters_nested_by_layer_type(torch_pow):
    """transformers 5 saves Gemma 3's rope parameters per layer type; each one is read alone."""
    from transformers import Gemma3TextConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = Gemma3TextConfig(rope_scaling={"rope_type": "linear", "factor": 8.0},
                                  rope_theta=1e6, rope_local_base_freq=1e4, head_dim=256,
                                  max_position_embeddings=131072)
    d = config.to_dict()
    assert set(d["rope_parameters"]) == {"full_attention", "sliding_attention"}
    for layer_type, rope_type in (("full_attention", "linear"),
                                  ("sliding_attention", "default")):
        rope = parse_hf_rope(d, layer_type=layer_type)
        assert rope.scaling.rope_type == rope_type
        tables = rope_tables(256, rope.theta, rope.scaling, 131072)
        if rope_type == "default":
            hf_inv, hf_factor = _gemma3_default(config, layer_type)
        else:
            hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu",
                                                               layer_type=layer_type)
        np.testing.assert_array_equal(tables.inv_freq, np.asarray(hf_inv))
        assert tables.attention_factor == hf_factor
    # a flat dict serves every layer type
    flat = parse_hf_rope({"rope_theta": 1e6}, layer_type="full_attention")
    assert flat == HFRope(1e6, 1.0, RopeScaling())


def _gemma3_default(config, layer_type):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    return Gemma3RotaryEmbedding.compute_default_rope_parameters(config, "cpu",
                                                                 layer_type=layer_type)
