"""`models.rope` against transformers' own RoPE (float32, CPU): inverse frequencies and attention
factors against `ROPE_INIT_FUNCTIONS`, cos/sin against the models' rotary embedding modules
(`LlamaRotaryEmbedding`, `Phi3RotaryEmbedding`, with longrope's dynamic switch between short and
long factors), and the config parsing of both transformers layouts.

The one operation that is not reproduced bit for bit is `theta ** exponent`: torch's CPU kernel
(SLEEF's vectorized powf, 1-ulp accurate) and `models.rope` (correctly rounded) differ by one
ulp on a few elements (2 after longrope's factors). So the inverse frequencies are checked
twice: within 2 ulp as they are, and bit for bit with `models.rope._pow` swapped for torch's pow
(`torch_pow` fixture), which checks every other operation of each type exactly; the angles and
cos/sin are compared under the swap too.
"""

from __future__ import annotations

import copy
import warnings

import jax
import numpy as np
import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import Phi3Config as HFPhi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from jaxpaged.models import config as config_module
from jaxpaged.models import rope as rope_module
from jaxpaged.models.config import LlamaConfig
from jaxpaged.models.rope import (SUPPORTED_ROPE_TYPES, HFRope, RopeScaling, longrope_use_long,
                                  parse_hf_rope, rope_angles, rope_cos_sin, rope_tables)

# cos/sin of the same float32 angle from XLA and from torch differ by an ulp or so (angles up to
# ~1.3e5 rad here); the angles themselves are compared bit for bit.
COS_SIN_ATOL = 2e-6

_LLAMA_BASE = dict(vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)  # head_dim 128


def _phi3_factors(n: int, seed: int, low: float, high: float) -> list[float]:
    return [float(x) for x in np.random.default_rng(seed).uniform(low, high, n)]


# name -> (HF config class, its rotary module, config kwargs in the transformers-4 layout)
CASES = {
    "default": (HFLlamaConfig, LlamaRotaryEmbedding,
                dict(_LLAMA_BASE, max_position_embeddings=4096, rope_theta=10000.0)),
    "default-theta5e5-hd64": (HFLlamaConfig, LlamaRotaryEmbedding,
                              dict(_LLAMA_BASE, hidden_size=128, max_position_embeddings=8192,
                                   rope_theta=500000.0)),
    "linear": (HFLlamaConfig, LlamaRotaryEmbedding,
               dict(_LLAMA_BASE, max_position_embeddings=16384, rope_theta=10000.0,
                    rope_scaling={"type": "linear", "factor": 4.0})),
    "llama3.1": (HFLlamaConfig, LlamaRotaryEmbedding,
                 dict(_LLAMA_BASE, max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})),
    "llama3.2-hd64": (HFLlamaConfig, LlamaRotaryEmbedding,
                      dict(_LLAMA_BASE, hidden_size=128, max_position_embeddings=131072,
                           rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192})),
    "yarn-qwen3": (HFLlamaConfig, LlamaRotaryEmbedding,
                   dict(_LLAMA_BASE, max_position_embeddings=131072, rope_theta=1000000.0,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32768})),
    "yarn-mscale": (HFLlamaConfig, LlamaRotaryEmbedding,
                    dict(_LLAMA_BASE, hidden_size=128, max_position_embeddings=163840,
                         rope_theta=10000.0,
                         rope_scaling={"type": "yarn", "factor": 40.0, "beta_fast": 32,
                                       "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0,
                                       "original_max_position_embeddings": 4096})),
    "yarn-no-truncate": (HFLlamaConfig, LlamaRotaryEmbedding,
                         dict(_LLAMA_BASE, hidden_size=128, max_position_embeddings=131072,
                              rope_theta=150000.0,
                              rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                            "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False,
                                            "original_max_position_embeddings": 4096})),
    "yarn-attention-factor-betas": (HFLlamaConfig, LlamaRotaryEmbedding,
                                    dict(_LLAMA_BASE, max_position_embeddings=65536,
                                         rope_theta=10000.0,
                                         rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                       "attention_factor": 1.25,
                                                       "beta_fast": 16, "beta_slow": 2,
                                                       "original_max_position_embeddings": 8192})),
    "yarn-factor-none": (HFLlamaConfig, LlamaRotaryEmbedding,
                         dict(_LLAMA_BASE, max_position_embeddings=16384, rope_theta=10000.0,
                              rope_scaling={"rope_type": "yarn", "factor": None,
                                            "original_max_position_embeddings": 4096})),
    "phi3-default-partial": (HFPhi3Config, Phi3RotaryEmbedding,
                             dict(_LLAMA_BASE, hidden_size=3072, num_attention_heads=24,
                                  max_position_embeddings=4096, rope_theta=10000.0,
                                  partial_rotary_factor=0.75)),
    "longrope-phi3-mini": (HFPhi3Config, Phi3RotaryEmbedding,
                           dict(_LLAMA_BASE, hidden_size=3072, num_attention_heads=32,
                                max_position_embeddings=131072,
                                original_max_position_embeddings=4096, rope_theta=10000.0,
                                rope_scaling={"type": "longrope",
                                              "short_factor": _phi3_factors(48, 0, 1.0, 1.2),
                                              "long_factor": _phi3_factors(48, 1, 1.0, 60.0)})),
    "longrope-phi4-mini-partial": (HFPhi3Config, Phi3RotaryEmbedding,
                                   dict(_LLAMA_BASE, hidden_size=3072, num_attention_heads=24,
                                        max_position_embeddings=131072,
                                        original_max_position_embeddings=4096,
                                        rope_theta=10000.0, partial_rotary_factor=0.75,
                                        rope_scaling={"type": "longrope",
                                                      "short_factor": _phi3_factors(48, 2, 1, 3),
                                                      "long_factor": _phi3_factors(48, 3, 1, 40)})),
    "longrope-explicit-factors": (HFPhi3Config, Phi3RotaryEmbedding,
                                  dict(_LLAMA_BASE, hidden_size=64, num_attention_heads=4,
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


def _hf_config(name):
    cls, _, kwargs = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**copy.deepcopy(kwargs))


def _hf_init(name, config, seq_len=None):
    """transformers' (inv_freq f32, attention_factor) for the case's type."""
    _, module_cls, _ = CASES[name]
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":  # not in ROPE_INIT_FUNCTIONS in transformers 5
        inv, factor = module_cls.compute_default_rope_parameters(config, device="cpu")
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu", seq_len=seq_len)
    return inv.numpy(), factor


def _head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _ours(config_dict, **kwargs):
    rope = parse_hf_rope(config_dict, **kwargs)
    R = int(_head_dim_of_dict(config_dict) * rope.partial_rotary_factor)
    return rope, rope_tables(R, rope.theta, rope.scaling, config_dict["max_position_embeddings"])


def _head_dim_of_dict(d):
    return d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]


def _raw_dict(name):
    """The case as a transformers-4 `config.json` would hold it."""
    _, _, kwargs = CASES[name]
    return copy.deepcopy(kwargs)


def _hf_rotary(name, config, positions):
    """cos, sin f32[T, R] and the inv_freq buffer used, from the model's rotary module."""
    _, module_cls, _ = CASES[name]
    module = module_cls(config)
    x = torch.zeros(1, len(positions), 8, dtype=torch.float32)
    pos = torch.tensor(np.asarray(positions)[None], dtype=torch.int64)
    cos, sin = module(x, pos)
    return cos[0].numpy(), sin[0].numpy(), module.inv_freq.clone().numpy()


def _assert_inv_freq(ours, hf, exact):
    assert ours.dtype == np.float32 and ours.shape == hf.shape
    if exact:
        np.testing.assert_array_equal(ours, hf)
    else:
        # the pow's ulp, and one more where a factor multiplies it before the reciprocal
        np.testing.assert_array_max_ulp(ours, hf, maxulp=2)
        np.testing.assert_allclose(ours, hf, rtol=2.5e-7, atol=0)


@pytest.mark.parametrize("exact", [False, True], ids=["own-pow", "torch-pow"])
@pytest.mark.parametrize("layout", ["transformers4", "transformers5"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_and_attention_factor_match_transformers(name, layout, exact, request):
    if exact:
        request.getfixturevalue("torch_pow")
    config = _hf_config(name)
    hf_inv, hf_factor = _hf_init(name, config)
    d = _raw_dict(name) if layout == "transformers4" else config.to_dict()
    aliases = {"su": "longrope", "yarn": "longrope"} if CASES[name][0] is HFPhi3Config else None
    if CASES[name][0] is HFPhi3Config:  # Phi3Config's class default
        d = {"original_max_position_embeddings": 4096, **d}
    rope, tables = _ours(d, type_aliases=aliases)
    assert rope.scaling.rope_type == config.rope_parameters["rope_type"]
    _assert_inv_freq(tables.inv_freq, hf_inv, exact)
    assert tables.attention_factor == hf_factor
    if rope.scaling.rope_type == "longrope":
        # `longrope_frequency_update` computes the long set with seq_len = original + 1
        omp = config.rope_parameters["original_max_position_embeddings"]
        hf_long, hf_long_factor = _hf_init(name, config, seq_len=omp + 1)
        _assert_inv_freq(tables.long_inv_freq, hf_long, exact)
        assert tables.attention_factor == hf_long_factor
        assert tables.original_max_position_embeddings == omp
        assert not np.array_equal(tables.long_inv_freq, tables.inv_freq)
    else:
        assert tables.long_inv_freq is None


@pytest.mark.parametrize("name", sorted(n for n in CASES if "longrope" not in n))
def test_cos_sin_match_the_rotary_embedding_module(name, torch_pow):
    config = _hf_config(name)
    positions = np.unique(np.concatenate([
        np.arange(0, 64), np.linspace(0, config.max_position_embeddings - 1, 97).astype(int)]))
    hf_cos, hf_sin, hf_inv = _hf_rotary(name, config, positions)
    _, tables = _ours(config.to_dict())
    np.testing.assert_array_equal(tables.inv_freq, hf_inv)
    angles = np.asarray(rope_angles(positions.astype(np.int32), tables))
    hf_angles = (torch.tensor(positions, dtype=torch.int64)[:, None].float()
                 * torch.from_numpy(hf_inv)).numpy()
    np.testing.assert_array_equal(angles, hf_angles)
    cos, sin = jax.jit(lambda p: rope_cos_sin(p, tables))(positions.astype(np.int32))
    assert cos.dtype == sin.dtype == np.float32
    assert cos.shape == sin.shape == (len(positions), tables.rotary_dim) == hf_cos.shape
    np.testing.assert_allclose(np.asarray(cos), hf_cos, rtol=0, atol=COS_SIN_ATOL)
    np.testing.assert_allclose(np.asarray(sin), hf_sin, rtol=0, atol=COS_SIN_ATOL)


@pytest.mark.parametrize("name", sorted(n for n in CASES if "longrope" in n))
def test_longrope_switches_where_transformers_dynamic_update_does(name, torch_pow):
    """The module picks the long factors for the whole call iff max(position_ids) + 1 >
    original_max_position_embeddings; a call after a long one goes back to the short ones."""
    config = _hf_config(name)
    omp = config.rope_parameters["original_max_position_embeddings"]
    _, tables = _ours(config.to_dict())
    calls = {  # positions of one forward call -> whether HF uses the long factors
        "prefix-up-to-omp-1": (np.arange(0, omp), False),  # seq_len == omp: still short
        "decode-at-omp-1": (np.array([omp - 1]), False),
        "prefix-up-to-omp": (np.arange(0, omp + 1), True),  # seq_len == omp + 1: long
        "decode-at-omp": (np.array([omp]), True),
        "decode-far": (np.array([config.max_position_embeddings - 1]), True),
        "short-again": (np.arange(0, 32), False),
    }
    for label, (positions, hf_long) in calls.items():
        hf_cos, hf_sin, hf_inv = _hf_rotary(name, config, positions)
        np.testing.assert_array_equal(hf_inv,
                                      tables.long_inv_freq if hf_long else tables.inv_freq,
                                      err_msg=label)
        seen = int(positions.max()) + 1
        use_long = longrope_use_long(seen, tables)
        assert use_long == hf_long, label
        hf_angles = (torch.tensor(positions, dtype=torch.int64)[:, None].float()
                     * torch.from_numpy(hf_inv)).numpy()
        np.testing.assert_array_equal(
            np.asarray(rope_angles(positions.astype(np.int32), tables, use_long)), hf_angles)
        cos, sin = rope_cos_sin(positions.astype(np.int32), tables, use_long)
        np.testing.assert_allclose(np.asarray(cos), hf_cos, rtol=0, atol=COS_SIN_ATOL,
                                   err_msg=label)
        np.testing.assert_allclose(np.asarray(sin), hf_sin, rtol=0, atol=COS_SIN_ATOL,
                                   err_msg=label)


def test_longrope_per_token_switch_in_a_packed_step(torch_pow):
    """Two sequences packed on one axis, one under and one past the threshold, each matching
    its own HF call; use_long as a per-token array, under jit."""
    name = "longrope-explicit-factors"
    config = _hf_config(name)
    omp = config.rope_parameters["original_max_position_embeddings"]
    _, tables = _ours(config.to_dict())
    short_seq, long_seq = np.arange(0, omp - 8), np.arange(omp - 4, omp + 12)
    positions = np.concatenate([short_seq, long_seq]).astype(np.int32)
    seen = np.concatenate([np.full(len(short_seq), short_seq.max() + 1),
                           np.full(len(long_seq), long_seq.max() + 1)])
    use_long = longrope_use_long(seen, tables)
    cos, sin = jax.jit(lambda p, u: rope_cos_sin(p, tables, u))(positions, use_long)
    for seq, rows in ((short_seq, slice(0, len(short_seq))),
                      (long_seq, slice(len(short_seq), None))):
        hf_cos, hf_sin, _ = _hf_rotary(name, config, seq)
        np.testing.assert_allclose(np.asarray(cos)[rows], hf_cos, rtol=0, atol=COS_SIN_ATOL)
        np.testing.assert_allclose(np.asarray(sin)[rows], hf_sin, rtol=0, atol=COS_SIN_ATOL)
    with pytest.raises(ValueError, match="use_long"):
        rope_cos_sin(positions, tables)
    _, plain = _ours(_raw_dict("default"))
    assert longrope_use_long(seen, plain) is None
    with pytest.raises(ValueError, match="longrope"):
        rope_cos_sin(positions, plain, use_long)


def test_attention_factor_scales_cos_and_sin():
    """yarn's factor multiplies cos and sin (so q and k each; the logits by its square)."""
    _, tables = _ours(_raw_dict("yarn-qwen3"))
    assert tables.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
    positions = np.arange(0, 100, dtype=np.int32)
    cos, sin = rope_cos_sin(positions, tables)
    np.testing.assert_allclose(np.asarray(cos) ** 2 + np.asarray(sin) ** 2,
                               tables.attention_factor ** 2, rtol=1e-6)
    unscaled = rope_tables(tables.rotary_dim, 1e6, RopeScaling(), 131072)
    assert unscaled.attention_factor == 1.0


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
        hf_saved = HFLlamaConfig(**_LLAMA_BASE, **copy.deepcopy(v4)).to_dict()
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
    d = {**_LLAMA_BASE, "max_position_embeddings": 131072, "rope_theta": 500000.0,
         "original_max_position_embeddings": 4096, "rope_scaling": rope}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = HFLlamaConfig.from_dict(copy.deepcopy(d))
        hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config, device="cpu")
    assert config.rope_parameters["original_max_position_embeddings"] == 4096  # top level won
    rope_, tables = _ours(d)
    assert rope_.scaling.original_max_position_embeddings == 4096
    np.testing.assert_array_equal(tables.inv_freq, hf_inv.numpy())
    # absent everywhere: max_position_embeddings
    no_omp = {"max_position_embeddings": 32768,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert parse_hf_rope(no_omp).scaling.original_max_position_embeddings == 32768


def test_phi3_type_aliases():
    d = _raw_dict("longrope-phi3-mini")
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
    return {"architectures": ["LlamaForCausalLM"], **_LLAMA_BASE,
            "max_position_embeddings": 131072, **rope}


def test_llama_config_delegates_and_reexports():
    assert config_module.RopeScaling is RopeScaling
    assert config_module.SUPPORTED_ROPE_TYPES == SUPPORTED_ROPE_TYPES
    for name in ("default", "linear", "llama3.1"):
        raw = _raw_dict(name)
        ours = LlamaConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **raw})
        hf_inv, _ = _hf_init(name, _hf_config(name))
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

    raw = _raw_dict("longrope-phi3-mini")
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
