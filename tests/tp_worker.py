"""Run by tests/test_tensor_parallel.py in a fresh process (jax reads the device count once, at
start): `python tp_worker.py JSON_ARGS`; prints one JSON line of results.

JSON_ARGS: {"runs": [[model dir, tp], ...], "backend": name, "hlo": dir or null,
"shards": dir or null, "distributed": [coordinator, num_processes, process_id] or null}.
Results: greedy ids by "<dir name>/<tp>"; for "hlo", the compiled step's collectives; for
"shards", where each parameter's shards lie.
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


def llm(model, tp):
    kw = dict(tensor_parallel_size=tp, max_model_len=256, num_kv_blocks=64, precompile=False,
              attention_backend=args.get("backend", "auto"))
    if args.get("distributed"):
        address, num, pid = args["distributed"]
        kw.update(coordinator_address=address, num_processes=num, process_id=pid)
    return LLM(model, **kw)


def collectives(engine) -> dict:
    """The compiled step's collectives of a 16-token step: op -> list of result shapes."""
    runner = engine.runner
    batch = runner._padding_batch(16)
    text = runner._step.lower(runner.params, runner.kv_cache, batch, False).compile().as_text()
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


if args.get("forever"):  # generate until killed (the process-failure test)
    engine_llm = llm(*args["runs"][0])
    print("GENERATING", flush=True)
    while True:
        engine_llm.generate(PROMPTS, PARAMS, use_tqdm=False)

out = {"ids": {}}
for model, tp in args["runs"]:
    engine_llm = llm(model, tp)
    engine = engine_llm.llm_engine
    ids = [o.outputs[0].token_ids for o in engine_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    out["ids"][f"{os.path.basename(model)}/{tp}"] = ids
    if args.get("hlo") == model and tp > 1:
        params = engine.runner.params
        out["hlo"] = {
            "tp": tp, "collectives": collectives(engine),
            "weights": sorted({f"f32[{','.join(map(str, x.shape))}]"
                               for x in jax.tree.leaves(params) if x.ndim == 2}),
            "num_layers": engine.model_config.num_hidden_layers,
            "kv_cache": str(engine.runner.kv_cache.sharding.spec),
            "qkv": str(params["layers"][0]["self_attn"]["qkv_proj"]["kernel"].sharding.spec)}
    if args.get("shards") == model:
        out["shards"] = shards(engine)
print("RESULT " + json.dumps(out), flush=True)
