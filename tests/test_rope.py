"""`models.rope` against transformers' own RoPE (float32, CPU): inverse frequencies and attention
factors against `ROPE_INIT_FUNCTIONS`, cos/sin against the models' rotary embedding modules
(`LlamaRotaryEmbedding`, `Phi3RotaryEmbedding`, with longrope's dynamic switch between short and
long factors). The config parsing of both transformers layouts is tests/test_rope_config.py's.

The one operation that is not reproduced bit for bit is `theta ** exponent`: torch's CPU kernel
(SLEEF's vectorized powf, 1-ulp accurate) and `models.rope` (correctly rounded) differ by one
ulp on a few elements (2 after longrope's factors). So the inverse frequencies are checked
twice: within 2 ulp as they are, and bit for bit with `models.rope._pow` swapped for torch's pow
(`torch_pow` fixture), which checks every other operation of each type exactly; the angles and
cos/sin are compared under the swap too.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from rope_cases import CASES, HFPhi3Config, hf_config, hf_init, ours_tables, raw_dict
from rope_cases import torch_pow  # noqa: F401 (a fixture)

from jaxpaged.models.rope import (RopeScaling, longrope_use_long, rope_angles, rope_cos_sin,
                                  rope_tables)

# cos/sin of the same float32 angle from XLA and from torch differ by an ulp or so (angles up to
# ~1.3e5 rad here); the angles themselves are compared bit for bit.
COS_SIN_ATOL = 2e-6


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
    config = hf_config(name)
    hf_inv, hf_factor = hf_init(name, config)
    d = raw_dict(name) if layout == "transformers4" else config.to_dict()
    aliases = {"su": "longrope", "yarn": "longrope"} if CASES[name][0] is HFPhi3Config else None
    if CASES[name][0] is HFPhi3Config:  # Phi3Config's class default
        d = {"original_max_position_embeddings": 4096, **d}
    rope, tables = ours_tables(d, type_aliases=aliases)
    assert rope.scaling.rope_type == config.rope_parameters["rope_type"]
    _assert_inv_freq(tables.inv_freq, hf_inv, exact)
    assert tables.attention_factor == hf_factor
    if rope.scaling.rope_type == "longrope":
        # `longrope_frequency_update` computes the long set with seq_len = original + 1
        omp = config.rope_parameters["original_max_position_embeddings"]
        hf_long, hf_long_factor = hf_init(name, config, seq_len=omp + 1)
        _assert_inv_freq(tables.long_inv_freq, hf_long, exact)
        assert tables.attention_factor == hf_long_factor
        assert tables.original_max_position_embeddings == omp
        assert not np.array_equal(tables.long_inv_freq, tables.inv_freq)
    else:
        assert tables.long_inv_freq is None


@pytest.mark.parametrize("name", sorted(n for n in CASES if "longrope" not in n))
def test_cos_sin_match_the_rotary_embedding_module(name, torch_pow):
    config = hf_config(name)
    positions = np.unique(np.concatenate([
        np.arange(0, 64), np.linspace(0, config.max_position_embeddings - 1, 97).astype(int)]))
    hf_cos, hf_sin, hf_inv = _hf_rotary(name, config, positions)
    _, tables = ours_tables(config.to_dict())
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
    config = hf_config(name)
    omp = config.rope_parameters["original_max_position_embeddings"]
    _, tables = ours_tables(config.to_dict())
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
    config = hf_config(name)
    omp = config.rope_parameters["original_max_position_embeddings"]
    _, tables = ours_tables(config.to_dict())
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
    _, plain = ours_tables(raw_dict("default"))
    assert longrope_use_long(seen, plain) is None
    with pytest.raises(ValueError, match="longrope"):
        rope_cos_sin(positions, plain, use_long)


def test_attention_factor_scales_cos_and_sin():
    """yarn's factor multiplies cos and sin (so q and k each; the logits by its square)."""
    _, tables = ours_tables(raw_dict("yarn-qwen3"))
    assert tables.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
    positions = np.arange(0, 100, dtype=np.int32)
    cos, sin = rope_cos_sin(positions, tables)
    np.testing.assert_allclose(np.asarray(cos) ** 2 + np.asarray(sin) ** 2,
                               tables.attention_factor ** 2, rtol=1e-6)
    unscaled = rope_tables(tables.rotary_dim, 1e6, RopeScaling(), 131072)
    assert unscaled.attention_factor == 1.0
