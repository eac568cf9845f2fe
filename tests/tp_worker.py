"""Run by tests/test_tensor_parallel.py in a fresh process (jax reads the device count once, at
start): `python tp_worker.py JSON_ARGS`; prints one JSON line of results.

JSON_ARGS: {"models": [dirs], "tps": [sizes], "backend": name, "hlo": dir or null,
"distributed": [coordinator, num_processes, process_id] or null}.
"""

import json
import os
import re
import sys

args = json.loads(sys.argv[1])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.get('devices', 8)}"

from jaxpaged import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is",
           "Once upon a time, in a land far away, there lived a king who had " * 3,
           {"prompt_token_ids": [5, 17, 300, 4000, 48000, 12]}]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def llm(model, tp):
    kw = dict(tensor_parallel_size=tp, max_model_len=256, num_kv_blocks=64, precompile=False,
              attention_backend=args.get("backend", "auto"),
              max_num_batched_tokens=48)  # the long prompt takes several chunks
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


out = {"ids": {}}
for model in args["models"]:
    for tp in args["tps"]:
        engine_llm = llm(model, tp)
        ids = [o.outputs[0].token_ids for o in engine_llm.generate(PROMPTS, PARAMS,
                                                                  use_tqdm=False)]
        out["ids"][f"{os.path.basename(model)}/{tp}"] = ids
        if args.get("hlo") == model and tp > 1:
            engine = engine_llm.llm_engine
            out["hlo"] = {
                "tp": tp, "collectives": collectives(engine),
                "weights": sorted({f"f32[{','.join(map(str, x.shape))}]"
                                   for x in __import__("jax").tree.leaves(engine.runner.params)
                                   if x.ndim == 2}),
                "num_layers": engine.model_config.num_hidden_layers,
                "kv_cache": str(engine.runner.kv_cache.sharding.spec),
                "qkv": str(engine.runner.params["layers"][0]["self_attn"]["qkv_proj"]["kernel"]
                           .sharding.spec)}
print("RESULT " + json.dumps(out), flush=True)
