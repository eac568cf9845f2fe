"""Run by tests/test_multihost_client.py, once per process: `python multihost_worker.py JSON`
with JSON {"model": dir, "distributed": [coordinator, num_processes, process_id],
"timeout_s": seconds per case, "prompt": token ids to complete, "embed": token id lists}.

Process 0 wraps its engine in a `LeaderEngine` (as `jaxpaged serve` does) and drives it
through an `AsyncLLMEngine` (the server's path): each case below, in order, each under
`timeout_s`; it prints "RESULT " and a JSON line {case: {"value": ...} or {"error": "Type:
message"} or {"timeout": true}} and the engine's stats. A case that times out ends the run
there (the engine thread is stuck in a computation the others never entered). Every other
process runs `follow` and prints its engine's stats once process 0 shuts it down.
"""

import asyncio
import json
import os
import sys

args = json.loads(sys.argv[1])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.get('devices', 1)}"

import numpy as np  # noqa: E402

from jaxpaged import LLM, SamplingParams  # noqa: E402
from jaxpaged.distributed.multihost import LeaderEngine, follow  # noqa: E402
from jaxpaged.engine.async_llm_engine import AsyncLLMEngine  # noqa: E402
from jaxpaged.sampling_params import RequestOutputKind  # noqa: E402

PROMPT = {"prompt_token_ids": args["prompt"]}
EMBED_IDS = args["embed"]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
STATS = ("num_prompt_tokens", "num_generation_tokens", "num_prefix_cache_hits",
         "num_free_blocks")


async def generate(engine: AsyncLLMEngine, request_id: str) -> list[int]:
    async for output in engine.generate(PROMPT, PARAMS, request_id):
        last = output
    return list(last.outputs[0].token_ids)


def cases(engine: AsyncLLMEngine, leader: LeaderEngine) -> list:
    """(name, coroutine function) in the order they run."""

    async def call(fn, *a):  # a synchronous engine call, on the engine's thread
        return await engine.run(fn, *a)

    async def embed():
        return (await engine.embed(EMBED_IDS, "last", True)).tolist()

    async def sleep_then_generate():
        await engine.sleep(1)
        return await generate(engine, "asleep")

    async def sleep2_wake_up_generate():
        await engine.sleep(2)
        await engine.wake_up()
        return await generate(engine, "after-sleep-2")

    return [
        ("generate", lambda: generate(engine, "first")),
        ("embed", embed),
        ("generate_after_embed", lambda: generate(engine, "after-embed")),
        ("update_params", lambda: engine.update_params({})),
        ("load_weights", lambda: engine.load_weights(
            [("model.norm.weight", np.ones(64, np.float32))])),
        ("get_params", lambda: call(lambda: leader.get_params())),
        ("scheduler", lambda: call(lambda: leader.scheduler)),
        ("reset_prefix_cache", engine.reset_prefix_cache),
        ("generate_after_reset", lambda: generate(engine, "after-reset")),
        ("sleep_then_generate", sleep_then_generate),
        ("wake_up", engine.wake_up),
        ("generate_after_wake_up", lambda: generate(engine, "after-wake-up")),
        ("sleep2_wake_up_generate", sleep2_wake_up_generate),
        ("embed_at_end", embed),
    ]


async def lead(llm: LLM) -> dict:
    leader = LeaderEngine(llm.llm_engine)
    engine = AsyncLLMEngine(leader)
    out = {}
    for name, case in cases(engine, leader):
        try:
            value = await asyncio.wait_for(case(), args["timeout_s"])
            out[name] = {"value": value}
        except asyncio.TimeoutError:
            out[name] = {"timeout": True}
            return out
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    out["stats"] = {k: leader.stats()[k] for k in STATS}
    leader.shutdown()
    await engine.shutdown()
    return out


def main() -> None:
    address, num, pid = args["distributed"]
    llm = LLM(args["model"], tensor_parallel_size=num * args.get("devices", 1),
              max_model_len=256, num_kv_blocks=64, precompile=False,
              coordinator_address=address, num_processes=num, process_id=pid)
    if pid == 0:
        out = asyncio.run(lead(llm))
    else:
        follow(llm.llm_engine)
        out = {"stats": {k: llm.llm_engine.stats()[k] for k in STATS}}
    print("RESULT " + json.dumps(out), flush=True)
    if any("timeout" in v for v in out.values()):
        os._exit(3)  # the engine thread never returns


if __name__ == "__main__":
    main()
