"""Where a Mixture-of-Experts decode step's time goes, at batch 1 and 32: routing, the experts,
and the rest (attention, the dense projections, norms, the LM head, the host).

    python bench/moe_breakdown.py                      # the synthetic qwen3-moe-0.7b
    python bench/moe_breakdown.py --model DIR --batch 1 8 32

For each quantization (float32, w8a8: int8 experts) and batch size B, B short prompts decode
`--tokens` tokens each, greedy, one step a call (`num_scheduler_steps=1`), and each decode
step of the engine is timed (`LLMEngine.step`, host included; median). Then the step's MoE
parts are timed alone, jitted, on the model's shapes, B tokens at a time, and multiplied by
its MoE layers:
  - routing: the router's matmul and top-k (`models.moe.route`);
  - experts: the path the engine takes (the C++ kernel on one CPU device: its counting sort
    and row gather, both GEMMs and the weighted sum, in one call), on the same routing.
The parts run alone, with caches warm for them, so their shares are estimates. Writes
bench/results/moe-breakdown.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _median_ms(fn, *args, rounds: int = 20) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def engine_step_ms(llm, batch: int, tokens: int) -> float:
    """The median decode step of `batch` sequences (every step after the prefill)."""
    from jaxpaged import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"Request {i} asks about the weather in city number {i}.", params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def moe_parts_ms(llm, batch: int) -> dict:
    """Routing and experts of one MoE layer at `batch` tokens, times the MoE layers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxpaged.models import moe

    model = nnx.merge(llm.llm_engine.runner.graphdef, llm.llm_engine.runner.params)
    blocks = [n for _, n in nnx.iter_graph(model) if isinstance(n, moe.SparseMoeBlock)]
    block = blocks[0]
    D = block.router.kernel.shape[0]
    x = jnp.asarray(np.random.default_rng(batch).standard_normal((batch, D)), jnp.float32)
    routing = jax.jit(lambda x: moe.route(block.router(x), block.routing))
    weights, ids = routing(x)
    experts = jax.jit(lambda x, w, i: block_experts(block, x, w, i))
    return {"routing_ms": len(blocks) * _median_ms(routing, x),
            "experts_ms": len(blocks) * _median_ms(experts, x, weights, ids),
            "moe_layers": len(blocks)}


def block_experts(block, x, weights, ids):
    """What `SparseMoeBlock.__call__` runs after routing (its path, its experts' dtype)."""
    from jaxpaged.models import moe
    from jaxpaged.pallas_kernels import moe_experts

    gate_up, down = block.experts_gate_up[...], block.experts_down[...]
    scales = None if block.experts_gate_up_scale is None else (
        block.experts_gate_up_scale[...], block.experts_down_scale[...])
    path = block.path
    if path is None and block.moe_kernel and moe_experts.fits(x, gate_up, down, block.activation,
                                                          block.tp):
        path = "kernel"
    return moe.experts_forward(x, weights, ids, gate_up, down, block.act, path, block.tp,
                               scales)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder; default: synthetic qwen3-moe-0.7b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--tokens", type=int, default=48, help="tokens decoded per sequence")
    p.add_argument("--quantization", nargs="+", default=["none", "w8a8"])
    p.add_argument("--out", type=Path, default=RESULTS / "moe-breakdown.json")
    args = p.parse_args(argv)

    import jax

    from jaxpaged import LLM
    from synthetic_models import ensure

    model = args.model or ensure("qwen3-moe-0.7b")
    rows = []
    for quantization in args.quantization:
        llm = LLM(model, max_model_len=512, max_num_seqs=max(args.batch),
                  num_scheduler_steps=1,
                  quantization=None if quantization == "none" else quantization)
        for B in args.batch:
            step = engine_step_ms(llm, B, args.tokens)
            parts = moe_parts_ms(llm, B)
            rest = step - parts["routing_ms"] - parts["experts_ms"]
            row = {"quantization": quantization, "batch": B, "step_ms": step, **parts,
                   "rest_ms": rest,
                   "share": {"routing": parts["routing_ms"] / step,
                             "experts": parts["experts_ms"] / step, "rest": rest / step}}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
    report = {"config": {"model": "synthetic qwen3-moe-0.7b" if args.model is None
                         else Path(args.model).name, "tokens": args.tokens,
                         "cpu": platform.processor() or platform.machine(),
                         "devices": str(jax.devices())},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
