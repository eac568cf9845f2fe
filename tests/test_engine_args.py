"""`EngineArgs`: every field reaches `LLM`'s engine config, each command's flags and the
manifest. The fields are iterated, never listed: a new field is checked by these tests as it is
added (and fails them until it lands in `EngineConfig`)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing

import pytest

from jaxpaged import LLM
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.entrypoints.cli import build_parser
from jaxpaged.spec_decode import NgramProposer, SpeculativeConfig

FIELDS = dataclasses.fields(EngineArgs)
SPEC = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
# Values for the fields whose non-default value cannot be derived from their type and metadata.
FREE_FORM = {"coordinator_address": "127.0.0.1:1234", "compilation_cache_dir": "/tmp/jp-cache",
             "generation_config": "vllm", "speculative_config": SPEC,
             "gpu_memory_utilization": 0.5}
# Where a value lands in EngineConfig in another form than given.
RESOLVED = {"speculative_config": SpeculativeConfig.from_dict(SPEC)}
# The positional arguments each command with engine flags needs.
COMMANDS = {"serve": [], "generate": ["a prompt"], "chat": ["a message"],
            "run-batch": ["-i", "in.jsonl", "-o", "out.jsonl"], "replay": ["m.manifest.json"]}


def non_default(field: dataclasses.Field, model: str):
    """A valid value of `field` other than its default, derived from its type and metadata."""
    if field.name == "model":
        return model
    if field.name in FREE_FORM:
        return FREE_FORM[field.name]
    choices = field.metadata["choices"]
    if choices is not None:
        return next(c for c in choices if c != field.default)
    kinds = typing.get_args(typing.get_type_hints(EngineArgs)[field.name]) or (
        typing.get_type_hints(EngineArgs)[field.name],)
    if bool in kinds:
        return not field.default
    assert int in kinds, f"add a value for {field.name} to FREE_FORM"
    return (100 if field.default is None else field.default) + 1


@pytest.fixture(scope="module")
def all_changed(tiny_model_dir) -> dict:
    values = {f.name: non_default(f, str(tiny_model_dir)) for f in FIELDS}
    assert all(values[f.name] != f.default for f in FIELDS)
    return values


def lookup(config, path: str):
    for part in path.split("."):
        config = getattr(config, part) if part else config
    return config


def test_every_field_reaches_the_engine_config(all_changed):
    config = EngineArgs(**all_changed).create_engine_config()
    for field in FIELDS:
        want = RESOLVED.get(field.name, all_changed[field.name])
        assert lookup(config, field.metadata["config"]) == want, field.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.scheduler.max_num_seqs = 1


def test_llm_takes_exactly_the_fields():
    params = inspect.signature(LLM).parameters
    assert list(params) == [f.name for f in FIELDS]
    assert all(params[f.name].default == f.default for f in FIELDS)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
        LLM(max_num_seq=4)


@pytest.mark.parametrize("option, value, message", [
    ("max_num_seqs", 0, "max_num_seqs must be an int >= 1, got 0"),
    ("block_size", True, "block_size must be an int >= 1, got True"),
    ("dtype", "float64", "dtype 'float64' is not one of"),
    ("enable_prefix_caching", 1, "enable_prefix_caching must be a bool, got 1"),
    ("num_processes", 2, "num_processes=2 needs a coordinator_address"),
    ("speculative_config", '{"method": "eagle"}', "speculative_config: method 'eagle'"),
])
def test_a_bad_value_is_named_before_anything_loads(option, value, message):
    with pytest.raises(ValueError, match=message):
        LLM("no/such/model", **{option: value})


def test_a_tiny_model_built_with_changed_options(tiny_model_dir):
    """One real build: the engine's config is the resolved arguments', and the engine acts on
    them."""
    options = dict(max_model_len=128, max_num_seqs=3, max_num_batched_tokens=64,
                   long_prefill_token_threshold=16, max_num_partial_prefills=2,
                   num_scheduler_steps=2,
                   scheduling_policy="priority", block_size=8, num_kv_blocks=40,
                   enable_prefix_caching=False, kv_cache_dtype="int8", attention_backend="xla",
                   seed=7, precompile=False, quantization="int8", speculative_config=SPEC,
                   generation_config="vllm", reasoning_parser="qwen3")
    llm = LLM(tiny_model_dir, **options)
    engine = llm.llm_engine
    assert engine.config == EngineArgs(model=tiny_model_dir, **options).create_engine_config()
    assert engine.block_manager.num_blocks == 40 and engine.runner.block_size == 8
    assert engine.scheduler_config.max_num_seqs == 3 and engine.quantization == "int8"
    assert engine.kv_cache_dtype == "int8" and engine.attention_backend == "xla"
    assert isinstance(engine.proposer, NgramProposer) and engine.reasoning_parser == "qwen3"
    assert llm.generation_defaults == {}


def cli_tokens(field: dataclasses.Field, value) -> list[str]:
    flag = f"--{field.name.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag if value else f"--no-{field.name.replace('_', '-')}"]
    return [flag, "none" if value is None else str(value)]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_a_flag_for_each_field(command, all_changed):
    parser = build_parser()
    argv = [command, *COMMANDS[command]]
    assert EngineArgs.from_cli_args(parser.parse_args(argv)) == EngineArgs()  # none given
    for field in FIELDS:
        argv += cli_tokens(field, all_changed[field.name])
    assert EngineArgs.from_cli_args(parser.parse_args(argv)) == EngineArgs(**all_changed)
    for field in FIELDS:  # and back to the default from the command line
        if field.default is not True and field.default is not False:
            continue
        args = parser.parse_args([command, *COMMANDS[command], *cli_tokens(field, field.default)])
        assert getattr(EngineArgs.from_cli_args(args), field.name) is field.default


def test_the_manifest_round_trips_every_field(all_changed, tiny_model_dir):
    args = EngineArgs(**{**all_changed, "precompile": [1, 8]})
    recorded = json.loads(json.dumps(args.to_dict()))
    assert set(recorded) == {f.name for f in FIELDS}
    assert EngineArgs.from_dict(recorded) == args
    assert EngineArgs.from_dict({"model": str(tiny_model_dir)}) == EngineArgs(
        model=str(tiny_model_dir))  # an older manifest: the options it lacks at their defaults
    with pytest.raises(ValueError, match="'no_such_option'"):
        EngineArgs.from_dict({**recorded, "no_such_option": True})
