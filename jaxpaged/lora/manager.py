"""`LoRAManager`: the adapters an engine holds, on the host and in its device slots.

Adapters are kept by name on the host, the `max_cpu_loras` most recently used (a request that
names an evicted one with its `lora_path` reads it again). `max_loras` of them sit in the
model's device slots (`models.lora`); a sequence is admitted only if its adapter has a slot or
can take one that no running sequence uses (`admit`, called by the scheduler), so a step never
mixes more than `max_loras` adapters and no slot changes under a running sequence. Writing a
slot is one jitted update of the slot's rows, compiled when the engine starts: loading,
replacing and removing adapters compile nothing.

Each version of an adapter (every load or `update`) gets a new `uid`, which keys its sequences'
prefix-cache blocks (`Sequence.cache_key`): blocks computed under one adapter, or under an
older version of the same name, are never reused by another.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import LoRAConfig
from jaxpaged.lora.peft import LoRAAdapter, adapter_from_tensors, read_peft_folder
from jaxpaged.lora.request import LoRARequest
from jaxpaged.models.loader import flat_params
from jaxpaged.models.lora import LoRASite

_uids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class LoadedLoRA:
    """One version of an adapter: its weights and the id that keys its cached blocks."""

    adapter: LoRAAdapter
    request: LoRARequest
    config: dict  # its PEFT config (`adapter_config.json`)
    uid: int = dataclasses.field(default_factory=lambda: next(_uids))


def _set_slot(leaves: tuple, index: jax.Array, values: tuple) -> tuple:
    return tuple(x.at[index].set(v.astype(x.dtype)) for x, v in zip(leaves, values))


class LoRAManager:
    """The adapters of one engine (see the module docstring).

    Args:
      config: `max_loras`, `max_lora_rank`, `max_cpu_loras`.
      runner: the engine's `ModelRunner`, whose model has adapter slots (`enable_lora`).
      sites: the model's adaptable projections (`models.lora.lora_sites`).
      model_cls, model_config: the family and its (tensor-parallel) config, to map PEFT names.
    """

    def __init__(self, config: LoRAConfig, runner, sites: list[LoRASite], model_cls,
                 model_config):
        self.config = config
        self.runner = runner
        self.sites = sites
        self.model_cls, self.model_config = model_cls, model_config
        self.adapters: collections.OrderedDict[str, LoadedLoRA] = collections.OrderedDict()
        self.slots: list[LoadedLoRA | None] = [None] * config.max_loras  # slot s at s - 1
        self._slot_order: list[int] = list(range(config.max_loras))  # least recent first
        # The slot weights' positions among the runner's parameter leaves, in `sites` order:
        # each site's A, then its parts' B.
        self._order = [f"{site.path}_lora.lora_{x}" for site in sites
                       for x in ["a", *(f"b.{p}" for p in range(len(site.part_widths)))]]
        index = {p: i for i, p in enumerate(flat_params(runner.params))}  # leaves' order
        missing = [p for p in self._order if p not in index]
        if missing:
            raise ValueError(f"the model has no adapter slots at {missing[:3]} (enable_lora)")
        self._leaf_index = [index[p] for p in self._order]
        shardings = tuple(runner.param_leaves[i].sharding for i in self._leaf_index)
        self._write = jax.jit(_set_slot, donate_argnums=0, out_shardings=shardings)
        # Each slot's index and an empty slot's weights, on the device once: writing a slot
        # then moves nothing from the host unless the adapter's weights are on the host.
        self._indices = [jnp.asarray(s, jnp.int32) for s in range(config.max_loras)]
        R = config.max_lora_rank
        self._zeros = {site.path: (jnp.zeros((site.in_features, len(site.part_widths) * R)),
                                   [jnp.zeros((R, w)) for w in site.part_widths])
                       for site in sites}
        # Compiled now, for device and host weights, so that no adapter load compiles.
        self._write_slot(1, None)
        self._write_slot(1, LoRAAdapter("", 1, 1.0, {
            path: (np.asarray(a), [np.asarray(b) for b in bs])
            for path, (a, bs) in self._zeros.items()}))

    # -- adapters by name -------------------------------------------------------------------

    def add(self, request: LoRARequest) -> LoadedLoRA:
        """Reads `request.lora_path` (a PEFT folder) as adapter `request.lora_name`, replacing
        one of that name (a new version: new requests use it, running ones finish on theirs).

        Raises:
          ValueError: the folder or its contents (see `lora.peft`), named.
        """
        if not request.lora_path:
            raise ValueError(f"lora_path: adapter {request.lora_name!r} is not loaded and the "
                             "request gives no folder to read it from")
        config, tensors, sha = read_peft_folder(request.lora_path)
        adapter = self._adapter(request.lora_name, config, tensors)
        adapter.source, adapter.files_sha256 = request.lora_path, sha
        return self._keep(LoadedLoRA(adapter, request, config))

    def update(self, name: str, tensors: dict, config: dict | None = None) -> LoadedLoRA:
        """Adapter `name` from PEFT-named arrays (`...q_proj.lora_A.weight: f[r, in]`,
        `...lora_B.weight: f[out, r]`) and a PEFT config (default: the current version's, or
        `r` from the tensors and `lora_alpha = r`). All is checked before anything changes.

        Raises:
          ValueError: a bad name, shape or config field (the old version keeps serving).
        """
        current = self.adapters.get(name)
        if config is None and current is not None:
            config = current.config
        if config is None:
            rank = next((np.shape(v)[0] for k, v in tensors.items() if "lora_A" in k), None)
            config = {"r": rank, "lora_alpha": rank}
        adapter = self._adapter(name, config, tensors)
        request = current.request if current is not None else LoRARequest(name)
        return self._keep(LoadedLoRA(adapter, request, config))

    def _adapter(self, name: str, config: dict, tensors: dict) -> LoRAAdapter:
        return adapter_from_tensors(name, config, tensors, self.sites, self.model_cls,
                                    self.model_config, self.config.max_lora_rank)

    def _keep(self, loaded: LoadedLoRA) -> LoadedLoRA:
        name = loaded.adapter.name
        self.adapters.pop(name, None)
        self.adapters[name] = loaded
        while len(self.adapters) > self.config.max_cpu_loras:
            self.adapters.popitem(last=False)  # sequences holding it keep their reference
        return loaded

    def remove(self, name: str) -> bool:
        """Forgets adapter `name`; running and waiting requests finish with it. Returns
        whether it was held."""
        return self.adapters.pop(name, None) is not None

    def resolve(self, request: LoRARequest | None) -> LoadedLoRA | None:
        """The adapter a request runs under: the one held by that name, else read from
        `lora_path`.

        Raises:
          ValueError: not a `LoRARequest`, or an adapter that is not held and cannot be read.
        """
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(request).__name__}")
        loaded = self.adapters.get(request.lora_name)
        if loaded is not None:
            self.adapters.move_to_end(request.lora_name)
            return loaded
        return self.add(request)

    def list(self) -> list[LoRARequest]:
        """The adapters held, least recently used first."""
        return [loaded.request for loaded in self.adapters.values()]

    # -- device slots -------------------------------------------------------------------------

    def admit(self, seq, running) -> bool:
        """Whether `seq` may run next to `running` (sequences already admitted); if so, its
        adapter is in a slot and `seq.lora_slot` says which (0: no adapter)."""
        loaded = seq.lora
        if loaded is None:
            seq.lora_slot = 0
            return True
        for s, held in enumerate(self.slots):
            if held is loaded:
                self._touch(s)
                seq.lora_slot = s + 1
                return True
        busy = {other.lora_slot for other in running if other.lora is not None}
        free = [s for s in self._slot_order if s + 1 not in busy]
        if not free:
            return False
        s = next((s for s in free if self.slots[s] is None), free[0])
        self._write_slot(s + 1, loaded.adapter)
        self.slots[s] = loaded
        self._touch(s)
        seq.lora_slot = s + 1
        return True

    def restore_slots(self) -> None:
        """Writes the held adapters into their slots again, after the engine's parameters were
        replaced (`update_params`, or weights read again by `wake_up`)."""
        for s, loaded in enumerate(self.slots):
            self._write_slot(s + 1, None if loaded is None else loaded.adapter)

    def _touch(self, s: int) -> None:
        self._slot_order.remove(s)
        self._slot_order.append(s)

    def _write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Writes `adapter` (None: zeros) into device slot `slot` (1..max_loras)."""
        values = []
        for site in self.sites:
            a, bs = (adapter.weights.get(site.path) if adapter is not None else None) or (
                self._zeros[site.path])
            values.extend([a, *bs])
        leaves = list(self.runner.param_leaves)
        new = self._write(tuple(leaves[i] for i in self._leaf_index), self._indices[slot - 1],
                          tuple(values))
        for i, x in zip(self._leaf_index, new):
            leaves[i] = x
        self.runner.params = jax.tree.unflatten(self.runner.param_treedef, leaves)


def resolve_lora(manager: LoRAManager | None, request: LoRARequest | None):
    """`manager.resolve(request)`; a request for an adapter from an engine without LoRA is
    refused.

    Raises:
      ValueError: as `LoRAManager.resolve`, or a `lora_request` without `enable_lora`.
    """
    if manager is None:
        if request is not None:
            raise ValueError("lora_request: this engine serves no adapters (enable_lora=True)")
        return None
    return manager.resolve(request)


def check_lora_config(config) -> None:
    """Raises ValueError for options that LoRA serving does not combine with (`EngineConfig`):
    speculative decoding (its proposers and verification know no adapters)."""
    if config.lora.enable_lora and config.speculative is not None:
        raise ValueError("enable_lora: speculative decoding under adapters is not supported; "
                         "leave speculative_config unset")
