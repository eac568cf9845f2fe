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
from jaxpaged.config import ResolvedMode
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.entrypoints.cli import build_parser
from jaxpaged.spec_decode import NgramProposer, SpeculativeConfig

FIELDS = dataclasses.fields(EngineArgs)
SPEC = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
# Values for the fields whose non-default value cannot be derived from their type and metadata.
FREE_FORM = {"coordinator_address": "127.0.0.1:1234", "compilation_cache_dir": "/tmp/jp-cache",
             "generation_config": "vllm", "speculative_config": SPEC,
             "gpu_memory_utilization": 0.5}
# Where a value lands in EngineConfig in another form than given: the speculative config
# parsed; multi-step decoding and async scheduling off with speculation (`engine.modes`).
RESOLVED = {"speculative_config": SpeculativeConfig.from_dict(SPEC), "num_scheduler_steps": 1,
            "async_scheduling": False}
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
    # What was asked for stays beside what runs.
    assert config.modes.num_scheduler_steps.requested == all_changed["num_scheduler_steps"]
    assert config.modes.async_scheduling.requested is True
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
    # The same config, plus the kernel plan the platform chose when the engine was built.
    assert engine.config.modes.kernels is not None
    assert dataclasses.replace(engine.config, modes=dataclasses.replace(
        engine.config.modes, kernels=None)) == EngineArgs(
            model=tiny_model_dir, **options).create_engine_config("offline")
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


# -- the modes that run (`engine.modes`): resolved once, each change with its reason ----------

def _modes(model_dir, usage_context="serve", **options):
    return EngineArgs(model=str(model_dir), **options).create_engine_config(usage_context)


def test_defaults_differ_between_offline_and_serving_only_in_engine_args(tiny_model_dir):
    offline, serve = _modes(tiny_model_dir, "offline"), _modes(tiny_model_dir)
    assert offline.scheduler.num_scheduler_steps == EngineArgs.DEFAULT_SCHEDULER_STEPS[
        "offline"] == 8
    assert serve.scheduler.num_scheduler_steps == EngineArgs.DEFAULT_SCHEDULER_STEPS[
        "serve"] == 1
    for config in (offline, serve):
        assert config.modes.num_scheduler_steps.requested is None
        assert config.modes.num_scheduler_steps.reason is None
    steps = _modes(tiny_model_dir, "offline", async_scheduling=True).modes.num_scheduler_steps
    assert (steps.value, steps.reason) == (1, "async_scheduling is on")
    with pytest.raises(ValueError, match="usage_context must be one of"):
        _modes(tiny_model_dir, "batch")


@pytest.mark.parametrize("options, reason", [
    (dict(batch_invariant=True), "batch_invariant is set"),
    (dict(speculative_config=SPEC), "speculative_config is set"),
])
def test_multi_step_off_names_its_reason_and_warns_once_when_asked(tiny_model_dir, caplog,
                                                                   options, reason):
    with caplog.at_level("WARNING", logger="jaxpaged.engine.modes"):
        default = _modes(tiny_model_dir, "offline", **options)
    assert caplog.records == []  # a default that cannot hold is recorded, not warned about
    assert default.modes.num_scheduler_steps == ResolvedMode(1, None, reason)
    with caplog.at_level("WARNING", logger="jaxpaged.engine.modes"):
        asked = _modes(tiny_model_dir, num_scheduler_steps=8, **options)
    assert asked.scheduler.num_scheduler_steps == 1
    assert asked.modes.num_scheduler_steps == ResolvedMode(1, 8, reason)
    assert [r.getMessage() for r in caplog.records] == [f"num_scheduler_steps=8 is off: {reason}"]


def test_multi_step_off_for_longrope(tiny_model_dir, tmp_path):
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    half = hf["hidden_size"] // hf["num_attention_heads"] // 2  # head_dim / 2 factors
    hf["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": 64,
                          "short_factor": [1.0] * half, "long_factor": [2.0] * half}
    hf.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    steps = _modes(tmp_path, num_scheduler_steps=4).modes.num_scheduler_steps
    assert steps.value == 1 and "longrope, at 64 tokens" in steps.reason


@pytest.mark.parametrize("options, reason", [
    (dict(speculative_config=SPEC), "speculative_config is set"),
    (dict(num_processes=2, coordinator_address="127.0.0.1:1234"),
     "num_processes=2 (async scheduling runs in one process)"),
])
def test_async_scheduling_off_names_its_reason(tiny_model_dir, caplog, options, reason):
    with caplog.at_level("WARNING", logger="jaxpaged.engine.modes"):
        config = _modes(tiny_model_dir, async_scheduling=True, **options)
    assert config.scheduler.async_scheduling is False
    assert config.modes.async_scheduling == ResolvedMode(False, True, reason)
    assert [r.getMessage() for r in caplog.records] == [f"async_scheduling=True is off: {reason}"]
    assert _modes(tiny_model_dir, async_scheduling=True).modes.async_scheduling == ResolvedMode(
        True, True, None)


def test_stats_and_the_manifest_report_the_effective_modes(tiny_model_dir, tmp_path):
    from jaxpaged.entrypoints.batch import run_batch

    llm = LLM(tiny_model_dir, max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
              precompile=False, num_scheduler_steps=4, speculative_config=SPEC)
    modes = llm.stats()["effective_modes"]
    assert modes["num_scheduler_steps"] == {"value": 1, "requested": 4,
                                            "reason": "speculative_config is set"}
    assert modes["speculative"]["value"] == "ngram"
    plan = llm.llm_engine.config.modes.kernels
    assert modes["kernels"] == dataclasses.asdict(plan)
    assert plan.attention == llm.llm_engine.attention_backend
    assert llm.llm_engine.runner.num_scheduler_steps == 1
    assert llm.llm_engine.scheduler.config.num_scheduler_steps == 1
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "m", "prompt": "hi", "max_tokens": 2}}) + "\n")
    manifest = run_batch(llm, "m", str(src), str(out), progress=False)
    assert manifest["effective_modes"] == modes
    assert json.loads((tmp_path / "out.jsonl.manifest.json").read_text())[
        "effective_modes"] == modes
