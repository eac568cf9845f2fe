"""PEFT LoRA adapters read into the engine's layout (`models.lora`).

A PEFT folder holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, `use_rslora`,
...) and `adapter_model.safetensors`, whose tensors are named after the base model's modules:
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight: f[r, in]` and
`....lora_B.weight: f[out, r]` (peft's `LoraModel`, `save_pretrained`). Each module is mapped
through the family's name map (`NAME_MAP`, as the checkpoint loader maps `...q_proj.weight`)
to its projection and its part of a stacked one; A is transposed to f[in, r] and B to
f[r, out] times the scale `lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA), both padded
with zeros to `max_lora_rank`.

What the engine does not run is refused by name: DoRA (`use_dora`), `modules_to_save`, biases
(`bias` other than "none"), per-module ranks or alphas (`rank_pattern`, `alpha_pattern`), a rank
above `max_lora_rank`, and a target that is not one of the decoder layers' projections.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxpaged.models.loader import _compile, _match_name, repeat_kv_heads
from jaxpaged.models.lora import LoRASite

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# peft's module names for the projections (HF's), and the stacked ones some checkpoints have.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "qkv_proj", "gate_up_proj")
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])"
                     r"(?:\.[\w-]+)?\.weight$")


@dataclasses.dataclass
class LoRAAdapter:
    """One adapter in the engine's layout, on the host.

    weights: site path -> (A f32[in, parts * max_lora_rank], [B_p f32[max_lora_rank, out_p]]);
    sites the adapter does not target are absent (their slots are written with zeros).
    """

    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[np.ndarray, list[np.ndarray]]]
    source: str | None = None  # the folder it was read from
    files_sha256: dict[str, str] = dataclasses.field(default_factory=dict)


def read_peft_folder(path: str | Path) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """(adapter_config.json as a dict, its tensors by name, {file: sha256}) of a PEFT folder.

    Raises:
      ValueError: the folder, its config or its safetensors weights missing or unreadable.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"lora_path {str(path)!r} is not a folder")
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file():
        raise ValueError(f"lora_path {str(path)!r} has no {CONFIG_FILE}")
    if not weights_file.is_file():
        raise ValueError(f"lora_path {str(path)!r} has no {WEIGHTS_FILE} (only safetensors "
                         "adapters are read)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file}: not a JSON adapter config ({e})") from None
    try:
        with safe_open(weights_file, framework="numpy") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{weights_file}: not a safetensors file ({e})") from None
    sha = {name: hashlib.sha256(p.read_bytes()).hexdigest()
           for name, p in ((CONFIG_FILE, config_file), (WEIGHTS_FILE, weights_file))}
    return config, tensors, sha


def check_config(config: dict, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config.

    Raises:
      ValueError: a field the engine does not support, named.
    """
    if not isinstance(config, dict):
        raise ValueError("adapter config: expected a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"adapter config: peft_type {peft_type!r} is not LORA")
    refused = {"use_dora": bool(config.get("use_dora")),
               "modules_to_save": bool(config.get("modules_to_save")),
               "rank_pattern": bool(config.get("rank_pattern")),
               "alpha_pattern": bool(config.get("alpha_pattern")),
               "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
               "bias": config.get("bias", "none") not in (None, "none")}
    for field, is_set in refused.items():
        if is_set:
            raise ValueError(f"adapter config: {field}={config.get(field)!r} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"adapter config: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"adapter config: r={rank} is above max_lora_rank={max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"adapter config: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = [t for t in targets if t.split(".")[-1] not in PROJECTIONS]
        if unknown:
            raise ValueError(f"adapter config: target_modules {unknown} are not projections "
                             f"this engine adapts ({', '.join(PROJECTIONS)})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one PEFT module's A and B (tensors `a_key`, `b_key`) go: `site` (a projection's
    path), and for each part of it the module fills, (part, first row of that part in B, its
    width as the adapter has it, whether tensor parallelism repeats its KV heads)."""

    a_key: str
    b_key: str
    site: str
    parts: tuple[tuple[int, int, int, bool], ...]


def plan_adapter(config: dict, shapes: dict[str, tuple[int, ...]], sites: list[LoRASite],
                 model_cls, model_config, max_lora_rank: int
                 ) -> tuple[int, float, tuple[Target, ...]]:
    """(rank, scale, targets) of an adapter given its PEFT `config` and its tensors' shapes
    by PEFT name (`...q_proj.lora_A.weight: [r, in]`, `...lora_B.weight: [out, r]`), in the
    layout of `sites`; nothing is read but shapes.

    Raises:
      ValueError: an unsupported config field, a tensor that names no projection of the
        model, a missing A or B, or a shape that does not fit (each named).
    """
    rank, scale = check_config(config, max_lora_rank)
    by_site = {site.path: site for site in sites}
    patterns = _compile(model_cls.NAME_MAP)
    kernels = {f"{path}.kernel" for path in by_site}
    pairs: dict[str, dict[str, str]] = {}  # module -> A/B -> tensor name
    for key, shape in shapes.items():
        m = _TENSOR.match(key)
        if m is None:
            raise ValueError(f"adapter tensor {key!r} is not a LoRA A or B weight")
        pairs.setdefault(m["module"], {})[m["ab"]] = key
    replicas, kv_parts = model_config.kv_head_replicas, model_cls.KV_HEAD_PARTS
    targets = []
    for module, ab in sorted(pairs.items()):
        missing = sorted({"A", "B"} - set(ab))
        if missing:
            raise ValueError(f"adapter module {module!r} has no lora_{missing[0]}")
        try:
            match = _match_name(patterns, f"{module}.weight", model_config, kernels)
        except KeyError:
            match = None
        if match is None:
            raise ValueError(f"adapter module {module!r} is not a projection this engine "
                             f"adapts ({', '.join(PROJECTIONS)} of a decoder layer)")
        path, _, part = match
        site = by_site[path.removesuffix(".kernel")]
        below = re.sub(r"^layers\.\d+\.", "", path)
        repeated = kv_parts.get(below, ()) if replicas > 1 else ()
        # The parts' widths as the checkpoint (and so the adapter) has them: KV heads not yet
        # repeated for tensor parallelism.
        widths = tuple(w // replicas if j in repeated else w
                       for j, w in enumerate(site.part_widths))
        want_out = sum(widths) if part is None else widths[part[0]]
        a_shape, b_shape = (tuple(shapes[ab[x]]) for x in "AB")
        if a_shape != (rank, site.in_features) or b_shape != (want_out, rank):
            raise ValueError(f"adapter module {module!r}: lora_A {list(a_shape)} and lora_B "
                             f"{list(b_shape)}, expected [{rank}, {site.in_features}] and "
                             f"[{want_out}, {rank}] (r={rank})")
        starts = np.cumsum((0,) + widths)
        js = range(len(widths)) if part is None else [part[0]]
        targets.append(Target(ab["A"], ab["B"], site.path, tuple(
            (j, int(starts[j]) if part is None else 0, widths[j], j in repeated) for j in js)))
    if not targets:
        raise ValueError("adapter has no LoRA weights")
    return rank, scale, tuple(targets)


def fill_adapter(xp, targets: tuple[Target, ...], sites: tuple[LoRASite, ...], rank: int,
                 scale: float, max_lora_rank: int, head_dim: int, replicas: int,
                 tensors: dict, every_site: bool) -> dict:
    """The slots' layout of an adapter (`LoRAAdapter.weights`) from its PEFT-named `tensors`,
    placed as `plan_adapter`'s `targets` say: A transposed to f[in, r] and each part's B to
    f[r, out_p] times `scale`, both padded with zeros to `max_lora_rank`. `xp` is `numpy`
    (arrays on the host) or `jax.numpy` (traced under jit: nothing leaves the device). Sites
    no target fills are left out, or with `every_site` filled with zeros."""
    R = max_lora_rank
    filled: dict[str, dict[int, tuple]] = {}
    for t in targets:
        a, b = (xp.asarray(tensors[key], xp.float32) for key in (t.a_key, t.b_key))
        for j, offset, width, repeated in t.parts:
            b_j = b[offset:offset + width].T * scale  # [r, out_j]
            if repeated:  # each KV head as many times as tensor parallelism repeats it
                b_j = repeat_kv_heads(b_j, replicas, head_dim, xp)
            filled.setdefault(t.site, {})[j] = (xp.pad(a.T, ((0, 0), (0, R - rank))),
                                               xp.pad(b_j, ((0, R - rank), (0, 0))))
    weights = {}
    for site in sites:
        parts = filled.get(site.path)
        if parts is None and not every_site:
            continue
        parts = parts or {}
        a_blocks = [parts[j][0] if j in parts else xp.zeros((site.in_features, R), xp.float32)
                    for j in range(len(site.part_widths))]
        weights[site.path] = (xp.concatenate(a_blocks, axis=1),
                              [parts[j][1] if j in parts else xp.zeros((R, w), xp.float32)
                               for j, w in enumerate(site.part_widths)])
    return weights


def adapter_from_tensors(name: str, config: dict, tensors: dict, sites: list[LoRASite],
                         model_cls, model_config, max_lora_rank: int) -> LoRAAdapter:
    """The adapter that PEFT-named `tensors` (`...q_proj.lora_A.weight: f[r, in]`,
    `...lora_B.weight: f[out, r]`) and a PEFT `config` describe, in the layout of `sites`
    (`models.lora.lora_sites`). NumPy arrays are laid out on the host (nothing compiles);
    `jax.Array`s on their device, by a function jitted once per adapter layout, with every
    site filled, so that writing the adapter into a slot moves nothing between host and
    device (a training loop's `update_lora` under `jax.transfer_guard`).

    Raises:
      ValueError: see `plan_adapter`.
    """
    shapes = {key: tuple(np.shape(value)) for key, value in tensors.items()}
    rank, scale, targets = plan_adapter(config, shapes, sites, model_cls, model_config,
                                        max_lora_rank)
    static = (targets, tuple(sites), rank, scale, max_lora_rank, model_config.head_dim,
              model_config.kv_head_replicas)
    if any(isinstance(value, jax.Array) for value in tensors.values()):
        weights = _device_fill(*static)(dict(tensors))
    else:
        weights = fill_adapter(np, *static, tensors, every_site=False)
    return LoRAAdapter(name, rank, scale, weights)


@functools.lru_cache(maxsize=16)
def _device_fill(*static):
    return jax.jit(lambda tensors: fill_adapter(jnp, *static, tensors, every_site=True))
