"""Rotary position embeddings (RoPE) and their frequency scalings, as transformers computes them.

Follows `transformers.modeling_rope_utils` (checked against transformers 5.24): the inverse
frequencies and attention factor of each `ROPE_INIT_FUNCTIONS[rope_type]` ("linear", "llama3",
"yarn", "longrope"; "default" is each model's `*RotaryEmbedding.compute_default_rope_parameters`),
and, for "longrope", the switch between its short and long factors that
`dynamic_rope_update` (its inner `longrope_frequency_update`) makes in the rotary embedding's
forward. The tables are computed in numpy float32 with HF's operations in HF's order and
rounding (torch's `scalar / tensor` included, which is `tensor.reciprocal() * scalar`), with one
exception: `theta ** exponent`. Torch's CPU kernel computes it with SLEEF's vectorized powf
(1-ulp accurate), this module correctly rounded (see `_pow`), so on a few elements (about 1 in
100) the power differs by one ulp, the inverse frequency by one or two; with torch's pow in its
place, every type's tables equal transformers' bit for bit (tests/test_rope.py checks both). The
angles `position * inv_freq` are then bit-identical wherever the inverse frequencies are; cos/sin
differ from torch's by about an ulp (XLA's vs torch's cos/sin), plus, on those few elements, angle
differences of position * ulp(inv_freq) (measured in the tested configs: <= 5e-6 in cos/sin up
to position 131071).

Three steps, for a model:

    rope = parse_hf_rope(config_json_dict)                 # theta, partial factor, RopeScaling
    tables = rope_tables(int(head_dim * rope.partial_rotary_factor), rope.theta, rope.scaling,
                         max_position_embeddings)          # numpy, once per model
    cos, sin = rope_cos_sin(positions, tables,             # jnp, f32[T, rotary_dim], per step
                            longrope_use_long(seq_len_seen, tables))

cos and sin come in HF's rotate-half layout (`torch.cat((freqs, freqs), -1)`), already multiplied
by the attention factor, as `LlamaRotaryEmbedding.forward` returns them. The factor therefore
multiplies q and k each, so the attention logits by its square; it is not a logit scale.

Not here: "dynamic" (NTK) RoPE and "proportional"; `parse_hf_rope` refuses them. Per-layer-type
rope parameters (transformers 5's Gemma 3 layout) are read one layer type at a time
(`parse_hf_rope(d, layer_type=...)`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")

# Fields of `rope_scaling` / `rope_parameters` each type requires to be present (transformers'
# `RotaryEmbeddingConfigMixin._validate_<type>_rope_parameters` raises KeyError without them;
# `original_max_position_embeddings` is not among them: `standardize_rope_params` defaults it).
_REQUIRED_HF_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}
# RopeScaling fields each type reads; the others keep their defaults (None).
_TYPE_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor",
                 "short_factor", "long_factor"),
}
_NEEDS_ORIGINAL_MAX = ("llama3", "yarn", "longrope")


def _error(rope_type: Any, message: str) -> ValueError:
    return ValueError(f"rope type {rope_type!r}: {message} "
                      f"(supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)) and math.isfinite(value))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: transformers' `rope_scaling` (4.x) / `rope_parameters` (5.x),
    without `rope_theta` and `partial_rotary_factor` (see `HFRope`).

    Fields a type does not read stay None. Values are checked when built: an unknown
    `rope_type`, or a field its type needs missing (None) or invalid, raises ValueError naming
    both and listing `SUPPORTED_ROPE_TYPES`. `short_factor` / `long_factor` given as lists are
    stored as tuples (the dataclass stays hashable).
    """

    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    # linear, llama3: required, > 0 (inverse frequencies divided by it). yarn, longrope: None
    # means max_position_embeddings / original_max_position_embeddings, as transformers does.
    factor: float | None = None
    low_freq_factor: float | None = None  # llama3: required
    high_freq_factor: float | None = None  # llama3: required, > low_freq_factor
    # llama3, yarn, longrope: the pre-training context length (tokens); None means the model's
    # max_position_embeddings (transformers' `standardize_rope_params` default). longrope uses
    # the long factors once a sequence's length exceeds it.
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None  # yarn; None or 0 -> 32 (HF's `or 32`)
    beta_slow: float | None = None  # yarn; None or 0 -> 1
    mscale: float | None = None  # yarn (DeepSeek): with mscale_all_dim, sets attention_factor
    mscale_all_dim: float | None = None  # yarn
    # yarn, longrope: cos and sin are multiplied by it; None -> the type's formula.
    attention_factor: float | None = None
    truncate: bool = True  # yarn: floor/ceil the correction range
    short_factor: tuple[float, ...] | None = None  # longrope: required, rotary_dim // 2 values
    long_factor: tuple[float, ...] | None = None  # longrope: required, rotary_dim // 2 values

    def __post_init__(self):
        t = self.rope_type
        if t not in SUPPORTED_ROPE_TYPES:
            raise _error(t, "is not supported")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if isinstance(value, (list, np.ndarray)):
                object.__setattr__(self, name, tuple(value))
        fields = _TYPE_FIELDS[t]

        def number(name, *, required=False, positive=False):
            value = getattr(self, name)
            if value is None:
                if required:
                    raise _error(t, f"field {name!r} is required but missing")
                return
            if not _is_number(value) or (positive and value <= 0):
                raise _error(t, f"field {name!r} must be a finite "
                                f"{'positive ' if positive else ''}number, got {value!r}")

        if "factor" in fields:
            number("factor", required=t in ("linear", "llama3"), positive=True)
        if t == "llama3":
            number("low_freq_factor", required=True, positive=True)
            number("high_freq_factor", required=True, positive=True)
            if self.high_freq_factor <= self.low_freq_factor:
                raise _error(t, f"field 'high_freq_factor' ({self.high_freq_factor}) must be "
                                f"greater than 'low_freq_factor' ({self.low_freq_factor})")
        if "original_max_position_embeddings" in fields:
            omp = self.original_max_position_embeddings
            if omp is not None and (not isinstance(omp, (int, np.integer))
                                    or isinstance(omp, (bool, np.bool_)) or omp < 1):
                raise _error(t, "field 'original_max_position_embeddings' must be a positive "
                                f"int, got {omp!r}")
        if t == "yarn":
            for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
                number(name)
            if not isinstance(self.truncate, (bool, np.bool_)):
                raise _error(t, f"field 'truncate' must be a bool, got {self.truncate!r}")
        if "attention_factor" in fields:
            number("attention_factor", positive=True)
        if t == "longrope":
            for name in ("short_factor", "long_factor"):
                value = getattr(self, name)
                if value is None:
                    raise _error(t, f"field {name!r} is required but missing")
                if (not isinstance(value, tuple) or not value
                        or not all(_is_number(x) and x > 0 for x in value)):
                    raise _error(t, f"field {name!r} must be a non-empty list of finite "
                                    f"positive numbers, got {value!r}")
            if len(self.short_factor) != len(self.long_factor):
                raise _error(t, f"fields 'short_factor' ({len(self.short_factor)} values) and "
                                f"'long_factor' ({len(self.long_factor)} values) differ in length")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], **kwargs) -> "RopeScaling":
        """The scaling of a HF `config.json` dict; `parse_hf_rope(d, **kwargs).scaling`."""
        return parse_hf_rope(d, **kwargs).scaling


class HFRope(NamedTuple):
    """What `parse_hf_rope` reads from a HF config."""

    theta: float  # rope_theta, the base of the wavelengths
    partial_rotary_factor: float  # in (0, 1]: rotary dim = int(head_dim * partial_rotary_factor)
    scaling: RopeScaling


def _rope_dict(d: Mapping[str, Any], layer_type: str | None) -> tuple[Mapping, bool]:
    """(the rope dict of `layer_type`, whether the config nests them by layer type); see
    `parse_hf_rope`."""
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"rope_scaling / rope_parameters must be a dict, got {rope!r}")
    nested = [k for k, v in rope.items() if isinstance(v, Mapping) or v is None]
    if not any(isinstance(rope[k], Mapping) for k in nested):
        return rope, False
    if layer_type is None:
        raise ValueError(f"rope parameters are nested by layer type ({nested}); pass layer_type")
    if not isinstance(rope.get(layer_type), Mapping):
        raise ValueError(f"rope parameters have no dict for layer type {layer_type!r} "
                         f"(they have {nested})")
    return rope[layer_type], True


def parse_hf_rope(d: Mapping[str, Any], *, default_theta: float = 10000.0,
                  type_aliases: Mapping[str, str] | None = None,
                  layer_type: str | None = None) -> HFRope:
    """Reads RoPE's parameters from a HF `config.json` dict, in either layout.

    transformers 4.x: `rope_theta` (and `partial_rotary_factor`) at the top level, scaling in
    `rope_scaling` named by `type` or `rope_type`; transformers 5.x: all in `rope_parameters`,
    `rope_theta` and `partial_rotary_factor` included (or still at the top level). Precedence as
    transformers' `convert_rope_params_to_dict` / `standardize_rope_params` resolve it:

    - `rope_scaling`, when not empty, is used and `rope_parameters` ignored;
    - `rope_theta` and `partial_rotary_factor` inside that dict win over the top-level ones;
      defaults `default_theta` (the model class's `default_theta`) and 1.0;
    - `rope_type` wins over `type`; absent both, "default";
    - for llama3, yarn and longrope, `original_max_position_embeddings` at the top level wins
      over the one inside the dict (transformers gives a config attribute of that name
      priority), then the dict's, then `max_position_embeddings`. A family whose HF config class
      declares the attribute with a default (Phi-3: 4096) passes it when absent:
      `parse_hf_rope({"original_max_position_embeddings": 4096, **d})`.

    `type_aliases` renames types first, for families that rename them when loading (Phi-3's
    `Phi3Config` reads "su" and "yarn" as "longrope": pass {"su": "longrope", "yarn": "longrope"}).
    Fields a type does not use are ignored, as transformers ignores them (it only warns).

    `layer_type` (e.g. "full_attention", "sliding_attention"): for rope parameters nested by
    layer type (transformers 5 saves Gemma 3's so), reads that type's dict, with the top-level
    `rope_theta` / `partial_rotary_factor` as fallbacks and, there, `original_max_position_
    embeddings` from the dict or else `max_position_embeddings` (transformers ignores a
    top-level one for nested parameters). A flat dict serves every layer type. Families whose
    transformers-4 configs keep a second base elsewhere (Gemma 3's `rope_local_base_freq`) map
    it themselves.

    Raises:
      ValueError: an unknown rope type (naming it and listing SUPPORTED_ROPE_TYPES), a field its
        type requires missing (named) or invalid, nested rope parameters without `layer_type` (or
        without that layer type), or theta / partial_rotary_factor out of range.
    """
    rope, nested = _rope_dict(d, layer_type)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    rope_type = dict(type_aliases or {}).get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _error(rope_type, "is not supported")

    theta = next((v for v in (rope.get("rope_theta"), d.get("rope_theta")) if v is not None),
                 default_theta)
    if not _is_number(theta) or theta <= 0:
        raise _error(rope_type, f"rope_theta must be a finite positive number, got {theta!r}")
    partial = next((v for v in (rope.get("partial_rotary_factor"),
                                d.get("partial_rotary_factor")) if v is not None), 1.0)
    if not _is_number(partial) or not 0 < partial <= 1:
        raise _error(rope_type, f"partial_rotary_factor must be in (0, 1], got {partial!r}")

    missing = [k for k in _REQUIRED_HF_KEYS[rope_type] if k not in rope]
    if missing:
        raise _error(rope_type, f"field {missing[0]!r} is required but missing from "
                                "rope_scaling / rope_parameters")
    fields = {k: rope[k] for k in _TYPE_FIELDS[rope_type] if k in rope}
    if rope_type in _NEEDS_ORIGINAL_MAX:
        top = None if nested else d.get("original_max_position_embeddings")
        omp = next((v for v in (top, rope.get("original_max_position_embeddings"),
                                d.get("max_position_embeddings")) if v is not None), None)
        if isinstance(omp, float) and omp.is_integer():
            omp = int(omp)
        fields["original_max_position_embeddings"] = omp
    if "truncate" in fields:  # HF: `if rope_parameters.get("truncate", True):`
        fields["truncate"] = bool(fields["truncate"])
    for name in ("short_factor", "long_factor"):
        if isinstance(fields.get(name), list):
            fields[name] = tuple(fields[name])
    return HFRope(float(theta), float(partial), RopeScaling(rope_type=rope_type, **fields))


@dataclasses.dataclass(frozen=True, eq=False)
class RopeTables:
    """What `rope_cos_sin` needs: `rope_tables`' result, numpy, built once per model.

    cos/sin(position p) = cos/sin(p * inv_freq) * attention_factor, in float32. For longrope,
    `inv_freq` holds the short-factor frequencies and `long_inv_freq` the long-factor ones, used
    for tokens whose sequence has grown past `original_max_position_embeddings` (see
    `longrope_use_long`); both are None for the other types.
    """

    inv_freq: np.ndarray  # f32[rotary_dim // 2]
    attention_factor: float = 1.0  # multiplies cos and sin (so q and k each)
    long_inv_freq: np.ndarray | None = None  # f32[rotary_dim // 2], longrope only
    original_max_position_embeddings: int | None = None  # tokens, longrope only

    @property
    def rotary_dim(self) -> int:
        """R: the features of each head that are rotated (the first R)."""
        return 2 * self.inv_freq.shape[0]

    @property
    def is_longrope(self) -> bool:
        return self.long_inv_freq is not None


def _exponents(dim: int) -> np.ndarray:
    """f32[dim // 2]: `torch.arange(0, dim, 2, dtype=torch.int64).float() / dim`."""
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _pow(base: float, exponents: np.ndarray) -> np.ndarray:
    """f32[n] `base ** exponents` (exponents f32[n]): base rounded to float32 as torch rounds
    its python scalar, the power correctly rounded (libm's pow in double, then to float32).

    Torch's CPU kernel (SLEEF powf, 1 ulp) differs from this by an ulp on a few elements, and
    numpy's float32 `**` (a SIMD pow) by up to an ulp on more; reproducing SLEEF's bits would
    mean porting its algorithm, which is also platform-dependent (FMA or not)."""
    b = float(np.float32(base))
    return np.array([math.pow(b, float(e)) for e in exponents], np.float64).astype(np.float32)


def _f32(x) -> np.float32:
    return np.float32(x)


def _default(dim: int, theta: float) -> np.ndarray:
    """`compute_default_rope_parameters`: 1 / theta ** (2i / dim), f32[dim // 2]."""
    return _f32(1.0) / _pow(theta, _exponents(dim))


def _llama3(dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """`_compute_llama3_parameters`, operation for operation in float32."""
    inv_freq = _default(dim, theta)
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_context_len = s.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low  # python floats, as HF
    high_freq_wavelen = old_context_len / high
    # torch's `scalar / tensor` is `tensor.reciprocal() * scalar` (`Tensor.__rdiv__`): two
    # roundings, reproduced here.
    wavelen = (_f32(1) / inv_freq) * _f32(2 * math.pi)
    inv_freq_llama = np.where(wavelen > _f32(low_freq_wavelen), inv_freq / _f32(factor),
                              inv_freq)
    smooth = ((_f32(1) / wavelen) * _f32(old_context_len) - _f32(low)) / _f32(high - low)
    smoothed = (_f32(1) - smooth) * inv_freq_llama / _f32(factor) + smooth * inv_freq_llama
    is_medium = ~(wavelen < _f32(high_freq_wavelen)) & ~(wavelen > _f32(low_freq_wavelen))
    return np.where(is_medium, smoothed, inv_freq_llama).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling,
          max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """`_compute_yarn_parameters`: float32 frequencies, python-float attention factor."""
    omp = s.original_max_position_embeddings or max_position_embeddings
    factor = s.factor if s.factor is not None else max_position_embeddings / omp
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, s.mscale)
                                     / _yarn_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    def correction_dim(num_rotations):
        return (dim * math.log(omp / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: "Prevent singularity"
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - _f32(low)) / _f32(high - low), 0, 1)
    extrapolation_factor = _f32(1) - ramp.astype(np.float32)

    pos_freqs = _pow(theta, _exponents(dim))
    inv_freq_extrapolation = _f32(1) / pos_freqs
    inv_freq_interpolation = _f32(1) / (_f32(factor) * pos_freqs)
    inv_freq = (inv_freq_interpolation * (_f32(1) - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq.astype(np.float32), float(attention_factor)


def _longrope(dim: int, theta: float, s: RopeScaling, max_position_embeddings: int):
    """`_compute_longrope_parameters`, for seq_len <= and > original_max_position_embeddings."""
    omp = s.original_max_position_embeddings or max_position_embeddings
    for name in ("short_factor", "long_factor"):
        if len(getattr(s, name)) != dim // 2:
            raise _error("longrope", f"field {name!r} has {len(getattr(s, name))} values; the "
                                     f"rotary dim {dim} needs {dim // 2}")
    factor = s.factor if s.factor is not None else max_position_embeddings / omp
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(omp)))
    base_pow = _pow(theta, _exponents(dim))

    def inv(ext):
        return (_f32(1) / (np.asarray(ext, np.float32) * base_pow)).astype(np.float32)

    return inv(s.short_factor), inv(s.long_factor), float(attention_factor), omp


def rope_tables(head_dim_rotary: int, theta: float, scaling: RopeScaling,
                max_position_embeddings: int) -> RopeTables:
    """The tables RoPE needs, computed in float32 as transformers computes them (to the bit
    but for `_pow`'s ulp; see the module docstring).

    Args:
      head_dim_rotary: R, the rotated features of a head: `int(head_dim * partial_rotary_factor)`
        (transformers' `dim`); even, >= 2.
      theta: rope_theta, the wavelength base.
      scaling: the type and its parameters.
      max_position_embeddings: the model's context length (tokens): the default for
        `original_max_position_embeddings`, and for yarn's / longrope's `factor` it is divided by
        that (transformers' `config.max_position_embeddings`).

    Returns:
      `RopeTables`: inv_freq f32[R // 2] and the attention factor (python float; 1.0 for
      default, linear and llama3), following, per type:
        default  `LlamaRotaryEmbedding.compute_default_rope_parameters` (the Phi-3 one with R)
        linear   `_compute_linear_scaling_rope_parameters`
        llama3   `_compute_llama3_parameters`
        yarn     `_compute_yarn_parameters`
        longrope `_compute_longrope_parameters` with seq_len None (short factors, `inv_freq`)
                 and with seq_len = original_max_position_embeddings + 1 (long factors,
                 `long_inv_freq`, as `longrope_frequency_update` computes them), plus
                 `original_max_position_embeddings`.

    Raises:
      ValueError: R odd or < 2, theta not a positive number, or longrope factors whose length
        is not R // 2.
    """
    if (not isinstance(head_dim_rotary, (int, np.integer)) or head_dim_rotary < 2
            or head_dim_rotary % 2):
        raise _error(scaling.rope_type,
                     f"the rotary dim must be an even int >= 2, got {head_dim_rotary!r}")
    if not _is_number(theta) or theta <= 0:
        raise _error(scaling.rope_type, f"theta must be a finite positive number, got {theta!r}")
    R, t = int(head_dim_rotary), scaling.rope_type
    if t == "default":
        return RopeTables(_default(R, theta))
    if t == "linear":
        return RopeTables((_default(R, theta) / _f32(scaling.factor)).astype(np.float32))
    if t == "llama3":
        s = scaling
        if s.original_max_position_embeddings is None:
            s = dataclasses.replace(s, original_max_position_embeddings=max_position_embeddings)
        return RopeTables(_llama3(R, theta, s))
    if t == "yarn":
        inv_freq, attention_factor = _yarn(R, theta, scaling, max_position_embeddings)
        return RopeTables(inv_freq, attention_factor)
    if t == "longrope":
        short, long, attention_factor, omp = _longrope(R, theta, scaling,
                                                       max_position_embeddings)
        return RopeTables(short, attention_factor, long, omp)
    raise _error(t, "is not supported")  # unreachable: RopeScaling checked the type


def longrope_use_long(seq_len_seen, tables: RopeTables):
    """For longrope tables: whether transformers would rotate with the long factors, i.e.
    `seq_len_seen > original_max_position_embeddings` (strictly; bool, the shape of
    `seq_len_seen`, numpy or jnp as given). None for other tables, which is what
    `rope_cos_sin` then takes, so a model can call both whatever the type.

    `seq_len_seen`: per token, the length of its sequence as the HF forward computing that token
    sees it: transformers 5.24 (`longrope_frequency_update`) takes `max(position_ids) + 1` over
    the whole forward call, so for a sequence run as HF's `generate` runs it, the prompt length
    for every prompt token (one forward over the whole prompt) and `position + 1` for each
    decoded token. Keys already cached are never re-rotated when the switch happens.
    """
    if not tables.is_longrope:
        return None
    return seq_len_seen > tables.original_max_position_embeddings


def rope_angles(positions, tables: RopeTables, use_long=None):
    """positions: int[...] -> angles f32[..., R // 2]: `position.float() * inv_freq`, as HF.

    use_long: longrope only (required then): bool, scalar or broadcastable to positions; where
    True the long-factor frequencies are used (see `longrope_use_long`). Must be None for the
    other types.
    """
    pos = jnp.asarray(positions).astype(jnp.float32)[..., None]
    if tables.is_longrope:
        if use_long is None:
            raise ValueError("longrope tables need use_long (see longrope_use_long)")
        inv_freq = jnp.where(jnp.asarray(use_long, bool)[..., None],
                             jnp.asarray(tables.long_inv_freq), jnp.asarray(tables.inv_freq))
    else:
        if use_long is not None:
            raise ValueError("use_long is for longrope tables only")
        inv_freq = jnp.asarray(tables.inv_freq)
    return pos * inv_freq


def rope_cos_sin(positions, tables: RopeTables, use_long=None):
    """positions: int[T] (any shape [...]) -> (cos, sin): f32[T, R] each, as HF's
    `*RotaryEmbedding.forward` returns them before its cast to the activations' dtype:
    angles concatenated twice (rotate-half layout), cos and sin multiplied by the attention
    factor. use_long as in `rope_angles`. jnp; traceable under jit (tables are constants)."""
    freqs = rope_angles(positions, tables, use_long)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if tables.attention_factor != 1.0:
        scale = jnp.float32(tables.attention_factor)
        cos, sin = cos * scale, sin * scale
    return cos, sin
