"""Run by tests/test_tensor_parallel.py in a fresh process (jax reads the device count once, at
start): `python tp_worker.py JSON_ARGS`; prints one JSON line of results.

JSON_ARGS: {"runs": [[model dir, tp(, kv_cache_dtype)], ...], "backend": name,
"hlo": dir or null, "shards": dir or null,
"distributed": [coordinator, num_processes, process_id] or null, "updates": [[model dir, tp], ...],
"multi_step": [[model dir, tp], ...], "expert_parallel": [[model dir, tp], ...],
"async": [[model dir, tp], ...], "forever": bool}.
Results: greedy ids and the pool arrays' shardings ("pools") by "<dir name>/<tp>" (with
"/<kv_cache_dtype>" when the run names one); for "hlo", the compiled step's collectives; for
"shards", where each parameter's shards lie; for "updates", the ids after new weights went into
a TP engine and a one-device engine (`updates`); for "multi_step", the ids with
`num_scheduler_steps=4` ("<dir name>/<tp>/steps4") and whether a multi-step call ran; for
"expert_parallel", the ids with `enable_expert_parallel` ("<dir name>/<tp>/ep") and the shapes
of layer 0's expert shards; for "async", the ids with `async_scheduling`
("<dir name>/<tp>/async") and the steps it overlapped. With "forever", the first run's ids
alone, then "GENERATING", then that run's prompts again and again until the process is killed.
"""

import json
import os
import re
import sys

args = json.loads(sys.argv[1])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.get('devices', 8)}"

import jax  # noqa: E402

from jaxpaged import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is",
           "Once upon a time, in a land far away, there lived a king who had " * 3,
           {"prompt_token_ids": [5, 17, 300, 4000, 48000, 12]}]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def llm(model, tp, kv_cache_dtype="auto", **options):
    kw = dict(tensor_parallel_size=tp, max_model_len=256, num_kv_blocks=64, precompile=False,
              attention_backend=args.get("backend", "auto"), kv_cache_dtype=kv_cache_dtype,
              **options)
    if args.get("distributed"):
        address, num, pid = args["distributed"]
        kw.update(coordinator_address=address, num_processes=num, process_id=pid)
    return LLM(model, **kw)


def collectives(engine) -> dict:
    """The compiled step's collectives of a 16-token step: op -> list of result shapes."""
    runner = engine.runner
    text = runner.lower_step(16).compile().as_text()
    found = {}
    for op in COLLECTIVES:
        found[op] = [m.group(1) for m in re.finditer(
            rf"= (\S+?)(?:\{{[^}}]*\}})? {op}(?:-start)?\(", text)]
    return found


def shards(engine) -> dict:
    """Each parameter's spec and its shards' (device id, index) as strings."""
    found = {}
    for path, x in jax.tree_util.tree_flatten_with_path(engine.runner.params)[0]:
        found[jax.tree_util.keystr(path)] = {
            "spec": str(x.sharding.spec), "shape": list(x.shape),
            "shards": [[s.device.id, str(s.index), list(s.data.shape)]
                       for s in x.addressable_shards]}
    return found


def perturbed(model) -> dict:
    """The model's safetensors, each tensor scaled by a fixed random factor per element."""
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(model, "model.safetensors"))
    rng = __import__("numpy").random.default_rng(0)
    return {k: v * rng.uniform(0.5, 1.5, v.shape).astype(v.dtype)
            for k, v in sorted(tensors.items())}


def updates(model, tp) -> dict:
    """New weights into a TP engine, compared with one device: `load_weights` of perturbed HF
    tensors into both (each device writing its shard of the stacked parameters); then the TP
    engine's parameters read back to NumPy, the original tensors loaded, and those NumPy
    (unsharded) arrays given back through `update_params`."""
    from safetensors.numpy import load_file

    one, split = llm(model, 1), llm(model, tp)
    gen = lambda e: [o.outputs[0].token_ids for o in e.generate(PROMPTS, PARAMS, use_tqdm=False)]
    out = {"before": gen(split)}
    one.load_weights(perturbed(model).items())
    out["one_device_perturbed"] = gen(one)
    split.load_weights(perturbed(model).items())
    out["load_weights_perturbed"] = gen(split)
    on_host = jax.tree.map(lambda x: __import__("numpy").asarray(x), split.get_params())
    split.load_weights(load_file(os.path.join(model, "model.safetensors")).items())
    out["load_weights_original"] = gen(split)
    split.update_params(on_host)
    out["update_params"] = gen(split)
    return out


if args.get("forever"):  # the first run's ids, then generate until killed (process failure)
    model, tp, *kv_cache_dtype = args["runs"][0]
    engine_llm = llm(model, tp, *kv_cache_dtype)
    ids = [o.outputs[0].token_ids for o in engine_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    key = "/".join([os.path.basename(model), str(tp), *kv_cache_dtype])
    print("RESULT " + json.dumps({"ids": {key: ids}}), flush=True)
    print("GENERATING", flush=True)
    while True:
        engine_llm.generate(PROMPTS, PARAMS, use_tqdm=False)

out = {"ids": {}, "pools": {}}
for model, tp, *kv_cache_dtype in args["runs"]:
    engine_llm = llm(model, tp, *kv_cache_dtype)
    engine = engine_llm.llm_engine
    ids = [o.outputs[0].token_ids for o in engine_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    key = "/".join([os.path.basename(model), str(tp), *kv_cache_dtype])
    out["ids"][key] = ids
    # Each pool array's (spec, shard shape): codes and scales of an 8-bit pool alike.
    out["pools"][key] = [[str(x.sharding.spec), list(x.addressable_shards[0].data.shape)]
                         for x in jax.tree.leaves(engine.runner.kv_cache.pool)]
    if args.get("hlo") == model and tp > 1 and not kv_cache_dtype:
        params = engine.runner.params
        out["hlo"] = {
            "tp": tp, "collectives": collectives(engine),
            "weights": sorted({f"f32[{','.join(map(str, x.shape))}]"
                               for x in jax.tree.leaves(params) if x.ndim == 2}),
            "num_layers": engine.model_config.num_hidden_layers,
            "kv_cache": str(engine.runner.kv_cache.pool.sharding.spec),
            "qkv": str(params["layers"][0]["self_attn"]["qkv_proj"]["kernel"].sharding.spec)}
    if args.get("shards") == model:
        out["shards"] = shards(engine)
for model, tp in args.get("expert_parallel", []):  # `enable_expert_parallel`
    engine_llm = llm(model, tp, enable_expert_parallel=True)
    ids = [o.outputs[0].token_ids for o in engine_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    out["ids"][f"{os.path.basename(model)}/{tp}/ep"] = ids
    gate_up = engine_llm.llm_engine.runner.params["layers"][0]["mlp"]["experts_gate_up"]
    out.setdefault("expert_shards", {})[f"{os.path.basename(model)}/{tp}"] = [
        list(x.data.shape) for x in gate_up.addressable_shards]
for model, tp in args.get("multi_step", []):  # 4 decode steps a call (`num_scheduler_steps`)
    engine_llm = llm(model, tp, num_scheduler_steps=4)
    ids = [o.outputs[0].token_ids for o in engine_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    runner = engine_llm.llm_engine.runner
    out["ids"][f"{os.path.basename(model)}/{tp}/steps4"] = ids
    out.setdefault("multi_step_ran", {})[f"{os.path.basename(model)}/{tp}"] = (
        runner.num_multi_step_executables > 0)
for model, tp in args.get("async", []):  # `async_scheduling`, one step a call
    engine_llm = llm(model, tp, async_scheduling=True, num_scheduler_steps=1)
    ids = [o.outputs[0].token_ids for o in engine_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    out["ids"][f"{os.path.basename(model)}/{tp}/async"] = ids
    out.setdefault("overlapped", {})[f"{os.path.basename(model)}/{tp}"] = \
        engine_llm.llm_engine.async_scheduling.num_overlapped_steps
for model, tp in args.get("updates", []):
    out.setdefault("updates", {})[f"{os.path.basename(model)}/{tp}"] = updates(model, tp)
print("RESULT " + json.dumps(out), flush=True)
