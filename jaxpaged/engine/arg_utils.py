"""`EngineArgs`: every engine option in one place, as vLLM's `vllm.engine.arg_utils`.

Each field is one option with its type, default, allowed values (`choices`, or a minimum for
ints) and one line of help, in the field's metadata, and the part of `EngineConfig` it lands in
(`config`: "section.field"). Everything else is derived from the fields: `LLM(model, **kwargs)`
takes exactly them (its signature is generated, `signature`), every command of `jaxpaged` gets a
flag for each (`add_cli_args` / `from_cli_args`), and a run-batch manifest records them all
(`to_dict` / `from_dict`), so that `jaxpaged replay` builds the same engine. Adding an engine
option is adding a field here (and reading it where it acts).

`create_engine_config()` resolves the options (the model folder, `max_model_len`'s default,
"auto" quantization, the speculative config's JSON) into one frozen `EngineConfig`, which
`LLMEngine` and the server read, with the modes that will run (`engine.modes`): what was asked
for, resolved against the other options and the model, each change with its reason.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import inspect
import os
import types
import typing

from jaxpaged.config import (DTYPES, KV_CACHE_DTYPES, CacheConfig, EngineConfig,
                             ExecutionConfig, LoRAConfig, ModelLoadConfig, ParallelConfig,
                             QuantizationConfig, ReasoningConfig, SchedulerConfig,
                             SpeculativeConfig, check_precompile)
from jaxpaged.engine.modes import USAGE_CONTEXTS, resolve_modes
from jaxpaged.models.quantization import QUANTIZATION_METHODS
from jaxpaged.pallas_kernels.backends import ATTENTION_BACKENDS
from jaxpaged.core.request_queue import REQUEST_QUEUES
from jaxpaged.reasoning import REASONING_PARSERS

# Titles of the CLI's argument groups, by a field's `group`.
CLI_GROUPS = {"engine": "engine",
              "lora": "LoRA adapters",
              "processes": "several processes (hosts): one JAX runtime through jax.distributed; "
                           "run the same command on each, with its --process-id"}


class _LiveChoices(collections.abc.Collection):
    """Fixed values, then a registry's names read when asked: a scheme registered after this
    module was imported is a valid choice too."""

    def __init__(self, fixed: tuple, registry: dict):
        self.fixed, self.registry = fixed, registry

    def __iter__(self):
        yield from self.fixed
        yield from self.registry

    def __contains__(self, value) -> bool:
        return value in self.fixed or value in self.registry

    def __len__(self) -> int:
        return len(self.fixed) + len(self.registry)


def _option(default, config: str, help: str, *, choices: tuple | None = None,
            min: int | None = None, flags: tuple[str, ...] = (), group: str = "engine",
            check=None):
    """A field of `EngineArgs`: its default and metadata (see the module docstring). `flags`:
    short CLI aliases; `check(value)`: a validator replacing the generic type check."""
    return dataclasses.field(default=default, metadata=dict(
        config=config, help=help, choices=choices, min=min, flags=flags, group=group,
        check=check))


def _fraction(value) -> None:
    """`gpu_memory_utilization`'s check: None or a number in (0, 1]."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value <= 1):
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {value!r}")


@dataclasses.dataclass
class EngineArgs:
    """The options of one engine (`LLM(**kwargs)`, the CLI's engine flags, the manifest).

    Raises (when built):
      ValueError: a value of the wrong type, out of range or not among the choices, naming the
        option and the value.
    """

    model: str | os.PathLike | None = _option(
        None, "model.model", "a local Hugging Face folder or a GGUF file (served from the file, "
        "int8); default: the embedded SmolLM2-135M-Instruct")
    dtype: str = _option("auto", "model.dtype", "weights' and activations' dtype; auto: "
                         "float32 on CPU, bfloat16 on GPU", choices=DTYPES)
    max_model_len: int | None = _option(
        None, "scheduler.max_model_len", "tokens per sequence, prompt and output; default the "
        "model's max_position_embeddings", min=1)
    max_num_seqs: int = _option(256, "scheduler.max_num_seqs", "sequences per step", min=1)
    max_num_batched_tokens: int | None = _option(
        None, "scheduler.max_num_batched_tokens", "tokens per step; default "
        "max(max_model_len, 2048)", min=1)
    long_prefill_token_threshold: int | None = _option(
        None, "scheduler.long_prefill_token_threshold", "prompt tokens a sequence computes at "
        "most in a step that also decodes (0: no cap; default 128); bounds inter-token latency",
        min=0)
    max_num_partial_prefills: int = _option(
        1, "scheduler.max_num_partial_prefills", "prompts computed at most in a step that also "
        "decodes", min=1)
    scheduling_policy: str = _option(
        "fcfs", "scheduler.scheduling_policy", "fcfs: arrival order; priority: a request's "
        "priority (lower first, ties by arrival), a waiting request preempting lower ones",
        choices=REQUEST_QUEUES.keys())  # a live view: policies registered later count
    num_scheduler_steps: int | None = _option(
        None, "scheduler.num_scheduler_steps", "decode steps run in one call, each step's "
        "greedy draws fed to the next on the device, while every running sequence decodes "
        "plainly greedily and nothing waits; default 8 in LLM and the one-shot commands "
        "(offline: the requests are all known; 1 with async_scheduling), 1 in jaxpaged serve "
        "(a new request would wait for the call); off (1) with batch_invariant, "
        "speculative_config or a longrope model",
        min=1)
    async_scheduling: bool = _option(
        False, "scheduler.async_scheduling", "prepare and launch each step while the device "
        "runs the one before, its draws read one step late (LLM then defaults "
        "num_scheduler_steps to 1; multi-step calls run synchronously); off with "
        "speculative_config or several processes")
    block_size: int = _option(16, "cache.block_size", "tokens per KV block", min=1)
    num_kv_blocks: int | None = _option(
        None, "cache.num_kv_blocks", "blocks in the KV pool; default: as many as "
        "kv_cache_memory_bytes holds", min=1)
    gpu_memory_utilization: float | None = _option(
        None, "cache.gpu_memory_utilization", "the fraction of the devices' memory the engine "
        "may use (weights and the largest step's activations first, the rest to the KV pool) "
        "where they report it (GPU); default 0.9; kv_cache_memory_bytes overrides it",
        check=_fraction)
    kv_cache_memory_bytes: int | None = _option(
        None, "cache.kv_cache_memory_bytes", "KV pool budget in bytes, over all devices "
        "(jaxpaged generate and chat take at most what their sequences can fill)", min=1)
    enable_prefix_caching: bool = _option(
        True, "cache.enable_prefix_caching", "reuse the KV blocks of common prompt prefixes")
    kv_cache_dtype: str = _option(
        "auto", "cache.kv_cache_dtype", "the KV pool's dtype (auto: the model's); int8 and fp8 "
        "keep one scale per token and head, about a quarter of float32's bytes",
        choices=KV_CACHE_DTYPES)
    attention_backend: str = _option(
        "auto", "execution.attention_backend", "auto: Pallas on GPU, the C++ kernel on CPU "
        "(xla without a C++ compiler); pallas-interpret runs the kernels interpreted (tests)",
        choices=_LiveChoices(("auto",), ATTENTION_BACKENDS))
    seed: int = _option(0, "model.seed", "seeds the sampling of requests that give no seed")
    precompile: bool | list[int] | None = _option(
        None, "execution.precompile", "compile every step shape at startup so serving compiles "
        "nothing new; default on (off on pallas-interpret), but generate and chat compile only "
        "the shapes they run; in Python also a list of step sizes in tokens (those alone)",
        check=check_precompile)
    tensor_parallel_size: int = _option(
        1, "parallel.tensor_parallel_size", "devices to split the model over (tensor "
        "parallelism)", min=1, flags=("-tp",))
    enable_expert_parallel: bool = _option(
        False, "parallel.enable_expert_parallel", "a Mixture-of-Experts model's experts split "
        "whole over the tensor_parallel_size devices (E / tp each) instead of each expert's "
        "hidden units")
    coordinator_address: str | None = _option(
        None, "parallel.coordinator_address", "host:port of process 0, where the processes "
        "meet (jax.distributed)", group="processes")
    num_processes: int = _option(1, "parallel.num_processes", "processes in all", min=1,
                                 group="processes")
    process_id: int = _option(0, "parallel.process_id", "this process's index, from 0", min=0,
                              group="processes")
    compilation_cache_dir: str | os.PathLike | None = _option(
        "auto", "execution.compilation_cache_dir", "keep compiled step shapes here across runs; "
        "off or None for none (auto: $JAXPAGED_COMPILATION_CACHE_DIR, else "
        "$JAXPAGED_HOME/compile-cache)")
    batch_invariant: bool = _option(
        False, "execution.batch_invariant", "results that do not depend on the batch: the same "
        "ids and logprobs whatever shares a step, chunking, prefix caching or preemption (CPU: "
        "the cpu or xla attention backend)")
    quantization: str | None = _option(
        "auto", "quantization.method", "int8 weights for the linear layers, the embedding and "
        "MoE experts: int8 (weight-only), w8a8 (int8 activations too) or q8_0 (GGUF Q8_0 "
        "blocks, a scale per 32 weights); auto: w8a8 for a GGUF file, else none", flags=("-q",),
        choices=_LiveChoices(("auto", None), QUANTIZATION_METHODS))
    speculative_config: dict | str | None = _option(
        None, "speculative", "speculative decoding, vLLM's keys as a dict or JSON: "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3} or '
        '{"model": PATH, "num_speculative_tokens": 4} (a draft model)',
        check=SpeculativeConfig.from_dict)
    generation_config: str | os.PathLike | None = _option(
        "auto", "model.generation_config", "default sampling values: auto from the model "
        "folder's generation_config.json, vllm or None for none, or a folder holding one")
    reasoning_parser: str | None = _option(
        None, "reasoning.parser", "the model thinks in <think>...</think>: structured outputs "
        "constrain only the answer, and the server returns the thinking as reasoning_content",
        choices=(None, *REASONING_PARSERS))
    enable_lora: bool = _option(False, "lora.enable_lora", "serve LoRA adapters (PEFT "
                                "folders), one per request", group="lora")
    max_loras: int = _option(1, "lora.max_loras", "adapters on the device at once; a step "
                             "mixes at most this many", min=1, group="lora")
    max_lora_rank: int = _option(16, "lora.max_lora_rank", "the largest adapter rank", min=1,
                                 group="lora")
    max_cpu_loras: int | None = _option(None, "lora.max_cpu_loras", "adapters held in host "
                                        "memory (least recently used dropped); default "
                                        "max_loras", min=1, group="lora")

    # `num_scheduler_steps` when not given, by how the engine is used (`create_engine_config`'s
    # `usage_context`): offline (`LLM`, run-batch, generate, chat) every request is known, so
    # decode steps run 8 a call (the host's work per token divided by as many; docs/scheduling.md,
    # "Several decode steps a call"); a server's new request would wait for such a call.
    DEFAULT_SCHEDULER_STEPS: typing.ClassVar[dict[str, int]] = {"serve": 1, "offline": 8}

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            _check(field, hints[field.name], getattr(self, field.name))
        ParallelConfig(self.tensor_parallel_size, coordinator_address=self.coordinator_address,
                       num_processes=self.num_processes, process_id=self.process_id)

    # -- LLM(**kwargs) ---------------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, caller: str = "LLM", **kwargs) -> EngineArgs:
        """`EngineArgs(**kwargs)`, with a TypeError naming a keyword that is no option.

        Raises:
          TypeError: an unknown keyword. ValueError: a bad value (named).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        for name in kwargs:
            if name not in names:
                raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}; the "
                                f"engine options are EngineArgs' fields: {sorted(names)}")
        return cls(**kwargs)

    @classmethod
    def signature(cls, *leading: inspect.Parameter) -> inspect.Signature:
        """The signature `f(*leading, model=None, *, <every other option>=<its default>)`, for
        a function that takes the options as keywords (`LLM.__init__`)."""
        hints = typing.get_type_hints(cls)
        params = list(leading)
        for field in dataclasses.fields(cls):
            kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if field.name == "model"
                    else inspect.Parameter.KEYWORD_ONLY)
            params.append(inspect.Parameter(field.name, kind, default=field.default,
                                            annotation=hints[field.name]))
        return inspect.Signature(params)

    # -- the manifest ----------------------------------------------------------------------

    def to_dict(self) -> dict:
        """Every option as JSON values (paths as str, the precompile sizes as a list)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = (os.fspath(value) if isinstance(value, os.PathLike)
                               else list(value) if isinstance(value, tuple) else value)
        return out

    @classmethod
    def from_dict(cls, options: dict) -> EngineArgs:
        """The inverse of `to_dict`; options it lacks (an older manifest) take their defaults.

        Raises:
          ValueError: a key that is no option, or a bad value (named).
        """
        try:
            return cls.from_kwargs("EngineArgs.from_dict", **options)
        except TypeError as e:
            raise ValueError(str(e)) from None

    # -- the command line ------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Adds a flag for each option (`--max-num-seqs`; bools as `--x/--no-x`; a choice of
        None as "none"). A flag not given is absent from the parsed namespace, so that
        `from_cli_args` leaves the option at its default and a command can tell it was not
        given."""
        hints = typing.get_type_hints(cls)
        groups: dict[str, argparse._ArgumentGroup] = {}
        for field in dataclasses.fields(cls):
            meta = field.metadata
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_argument_group(CLI_GROUPS[meta["group"]])
            group = groups[meta["group"]]
            kind = _cli_kind(hints[field.name])
            shown = "" if field.default is None else f" (default: {field.default})"
            kwargs = dict(default=argparse.SUPPRESS,
                          help=f"{meta['help']}{shown}".replace("%", "%%"))
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif meta["choices"] is not None:
                kwargs.update(type=_none_or(kind), choices=meta["choices"],
                              metavar="{" + ",".join(_cli_text(c) for c in meta["choices"]) + "}")
            else:
                kwargs["type"] = kind
            group.add_argument(f"--{field.name.replace('_', '-')}", *meta["flags"], **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options `add_cli_args`'s flags gave; the others at their defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name)})

    # -- EngineConfig ----------------------------------------------------------------------

    def create_engine_config(self, usage_context: str = "serve") -> EngineConfig:
        """The resolved, frozen configuration: the model folder (`resolve_model`: the embedded
        default is prepared on first use), `max_model_len` from the model's config when not
        given, "auto" quantization (w8a8 for a GGUF file), the speculative config parsed, and
        the modes that will run (`config.modes`, `engine.modes.resolve_modes`; the scheduler
        section holds the resolved `num_scheduler_steps` and `async_scheduling`), an explicit
        request that cannot hold logged once.

        Args:
          usage_context: "serve" (the default: `jaxpaged serve`, `EngineArgs`) or "offline"
            (`LLM`): picks the defaults that differ (`DEFAULT_SCHEDULER_STEPS`).

        Raises:
          ValueError: an unknown model or usage context, or values that do not fit together
            (named).
        """
        if usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, "
                             f"got {usage_context!r}")
        from jaxpaged.model_loader.model_store import resolve_model
        from jaxpaged.models import load_config

        sections: dict[str, dict] = {}
        for field in dataclasses.fields(self):
            section, _, name = field.metadata["config"].partition(".")
            sections.setdefault(section, {})[name] = getattr(self, field.name)
        model_dir = resolve_model(self.model)
        model = sections["model"]
        model.update(model_dir=model_dir, model=None if self.model is None
                     else os.fspath(self.model))
        if model["generation_config"] is not None:
            model["generation_config"] = os.fspath(model["generation_config"])
        model_config = load_config(model_dir)
        scheduler = sections["scheduler"]
        if scheduler["max_model_len"] is None:
            scheduler["max_model_len"] = model_config.max_position_embeddings
        speculative = SpeculativeConfig.from_dict(sections["speculative"][""])  # all of it
        modes = resolve_modes(
            num_scheduler_steps=self.num_scheduler_steps,
            default_scheduler_steps=self.DEFAULT_SCHEDULER_STEPS[usage_context],
            async_scheduling=self.async_scheduling, batch_invariant=self.batch_invariant,
            speculative=speculative, num_processes=self.num_processes,
            rope_switch_length=model_config.rope_switch_length)
        scheduler.update(num_scheduler_steps=modes.num_scheduler_steps.value,
                         async_scheduling=modes.async_scheduling.value)
        quantization = sections["quantization"]
        if quantization["method"] == "auto":
            quantization["method"] = ("w8a8" if self.model is not None
                                      and os.fspath(self.model).endswith(".gguf") else None)
        execution = sections["execution"]
        if isinstance(execution["compilation_cache_dir"], os.PathLike):
            execution["compilation_cache_dir"] = os.fspath(execution["compilation_cache_dir"])
        return EngineConfig(
            model=ModelLoadConfig(**model), cache=CacheConfig(**sections["cache"]),
            scheduler=SchedulerConfig(**scheduler), parallel=ParallelConfig(**sections["parallel"]),
            execution=ExecutionConfig(**execution),
            quantization=QuantizationConfig(**quantization),
            reasoning=ReasoningConfig(**sections["reasoning"]),
            speculative=speculative, lora=LoRAConfig(**sections["lora"]), modes=modes)


def _union(hint) -> tuple:
    """The types of a (possibly union) annotation, generic ones by their origin (list)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return tuple(typing.get_origin(a) or a for a in args)


def _cli_kind(hint) -> type:
    """The type a flag parses: the first of bool, int, float and str in the field's union."""
    return next(t for t in _union(hint) if t in (bool, int, float, str))


def _cli_text(choice) -> str:
    return "none" if choice is None else str(choice)


def _none_or(kind: type):
    """A flag's `type` for choices that include None: "none" is None."""
    def parse(text: str):
        return None if text == "none" else kind(text)
    parse.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return parse


_TYPE_NAMES = {bool: "a bool", int: "an int", str: "a str", os.PathLike: "a path", dict: "a dict",
               list: "a list", type(None): "None"}


def _check(field: dataclasses.Field, hint, value) -> None:
    """Raises ValueError naming `field` unless `value` has one of its types, is among its
    choices and at least its minimum."""
    meta, name = field.metadata, field.name
    if meta["check"] is not None:
        meta["check"](value)
        return
    if meta["choices"] is not None:
        if value not in meta["choices"]:
            raise ValueError(f"{name} {value!r} is not one of {tuple(meta['choices'])}")
        return
    kinds = _union(hint)
    if value is None and type(None) in kinds:
        return
    if int in kinds and not isinstance(value, bool) and isinstance(value, int):
        if meta["min"] is not None and value < meta["min"]:
            raise ValueError(f"{name} must be an int >= {meta['min']}, got {value!r}")
        return
    if any(k is not int and isinstance(value, k) for k in kinds if k is not type(None)):
        return
    wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
    if int in kinds and meta["min"] is not None:
        wanted = f"an int >= {meta['min']}" + (" or None" if type(None) in kinds else "")
    raise ValueError(f"{name} must be {wanted}, got {value!r}")
